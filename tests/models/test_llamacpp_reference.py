"""llama.cpp as the reference for GGUF: the engine's greedy tokens against llama.cpp's, on the same
file and the same prompt token ids (ids are compared, never text).

Optional: llama.cpp's Python bindings (``llama-cpp-python``, the ``llamacpp`` extra; they build
from source, ~10 minutes) are not a test dependency, so the module is skipped when ``llama_cpp``
does not import. docs/installation.md says how to install them.

The two sides do not run the same arithmetic. llama.cpp multiplies the quantized weights by
activations it quantizes to 8 bits per block (Q8_0 or Q8_K); the engine holds the weights as
stored (types MLX cannot hold, such as Q6_K, re-quantized to 8 bits) and multiplies in float32. Their logits differ by a little, so their greedy paths may part
where two tokens are nearly tied. What must hold, per checkpoint:

* the tokenizers (llama.cpp's, and ours built from the file's metadata) split the prompt and
  ``TEXTS`` into the same ids;
* the first step (the prompt's logits): the same argmax, and the top candidates' log-probabilities
  within ``FIRST_STEP_ATOL`` of each other;
* the greedy paths agree for at least ``MIN_AGREEMENT`` tokens; where they part (step k, after
  the same k tokens, so both sides saw the same context), each side rates the two candidates
  within ``TIE`` nats of each other: a near tie that either choice resolves, not a wrong model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's bindings (the `llamacpp` extra) are not installed")

from vllm_mlx.core.request import SamplingParams  # noqa: E402
from vllm_mlx.llm import LLM  # noqa: E402

pytestmark = pytest.mark.e2e  # real checkpoints through the engine

STEPS = 16
TOP = 5
MIN_AGREEMENT = 4
# The size of llama.cpp's own error. Against the float64 numpy oracle of tests/gguf_reference.py
# (exact dequantization), the engine's logits of the default model are off by < 1e-3 and
# llama.cpp's by up to 1.4 (logits span -28..28; most of it from its 8-bit activations: an F32
# KV cache still leaves 1.0), which moves the top-5 log-probabilities by up to 0.31 (observed;
# Gemma-3: 0.10). A wrong model is off by more: converted with the RoPE rows left un-permuted,
# the same five log-probabilities move by up to 6.9 and the paths part at step 5 (checked by hand).
FIRST_STEP_ATOL = 0.5
# Where the paths part, the two candidates were observed 0.013 (llama.cpp) and 0.16 (engine) nats
# apart (Gemma-3, step 5); the default model's paths agree for all 16 tokens.
TIE = 0.5

# Texts both tokenizers must split alike (llama.cpp's from the file's metadata; ours built from it).
TEXTS = (
    "Hello world",
    "  two leading spaces, a\ttab and\n\ntwo newlines",
    "naïve café — 1234567 + 89 = ? ¿Qué?",
    "日本語のテキストと emoji 🙂",
    "def f(x):\n    return x**2  # comment",
)

# A prompt whose continuation is factual for the first tokens (no tie there), then free text.
PROMPT = "The capital of France is Paris. The capital of Germany is"


@dataclass
class Greedy:
    """A greedy path: the tokens, and at each step the log-probabilities of the top candidates
    (llama.cpp: of every token)."""

    tokens: list[int]
    logprobs: list[dict[int, float]]


@dataclass
class Reference:
    """Both sides on one checkpoint: the prompt ids (ours; llama.cpp's tokenization checked
    equal), the engine's path and llama.cpp's."""

    prompt: list[int]
    ours: Greedy
    llamacpp: Greedy
    tokenized: dict[str, tuple[list[int], list[int]]]  # text -> (ours, llama.cpp's)

    @property
    def agreement(self) -> int:
        return next((i for i, (a, b) in enumerate(zip(self.ours.tokens, self.llamacpp.tokens)) if a != b), STEPS)


def gguf_path(request, name: str) -> Path:
    if name == "gemma3":
        return request.getfixturevalue("gemma3_gguf_path")
    from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf

    return checkpoint_gguf(SMOLLM2)


def engine_greedy(gguf: Path, text: str) -> tuple[dict[str, list[int]], Greedy]:
    """The engine's tokenization of ``text`` and of ``TEXTS``, and its greedy path from ``text``."""
    llm = LLM(str(gguf), force_model_takeover=True)
    try:
        tokenized = {t: llm.get_tokenizer().encode(t) for t in (text, *TEXTS)}
        prompt = tokenized[text]
        params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=TOP)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    finally:
        llm.shutdown()
    completion = out.outputs[0]
    return tokenized, Greedy(list(completion.token_ids), list(completion.logprobs))


def open_llamacpp(gguf: Path, n_ctx: int):
    """A llama.cpp context on ``gguf`` on every core, without its chatter."""
    return llama_cpp.Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=os.cpu_count(),
        logits_all=False, verbose=False,
    )  # fmt: skip


def last_logits(llm) -> np.ndarray:
    """The logits llama.cpp computed for the last token it evaluated."""
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).astype(np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - math.log(np.exp(shifted).sum())


def llamacpp_greedy(llm, prompt: list[int], steps: int) -> Greedy:
    llm.reset()
    llm.eval(prompt)
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = log_softmax(last_logits(llm))
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(dict(enumerate(lp.tolist())))
        llm.eval([token])
    return Greedy(tokens, logprobs)


@pytest.fixture(scope="module", params=["default", "gemma3"])
def reference(request) -> Reference:
    gguf = gguf_path(request, request.param)
    ours_tokenized, ours = engine_greedy(gguf, PROMPT)
    prompt = ours_tokenized[PROMPT]
    llm = open_llamacpp(gguf, n_ctx=len(prompt) + STEPS + 8)
    try:
        tokenized = {t: (ids, llm.tokenize(t.encode(), add_bos=True, special=False))
                     for t, ids in ours_tokenized.items()}  # fmt: skip
        theirs = llamacpp_greedy(llm, prompt, STEPS)
    finally:
        llm.close()
    return Reference(prompt, ours, theirs, tokenized)


def test_tokenizers_agree(reference):
    for text, (ours, theirs) in reference.tokenized.items():
        assert ours == theirs, text


def test_first_step_logprobs_agree(reference):
    ours, theirs = reference.ours.logprobs[0], reference.llamacpp.logprobs[0]
    assert reference.ours.tokens[0] == reference.llamacpp.tokens[0]
    diffs = {token: abs(lp - theirs[token]) for token, lp in ours.items()}
    assert max(diffs.values()) < FIRST_STEP_ATOL, diffs


def test_greedy_tokens_agree_up_to_a_near_tie(reference):
    k = reference.agreement
    assert k >= MIN_AGREEMENT, (reference.ours.tokens, reference.llamacpp.tokens)
    if k == STEPS:
        return
    ours, theirs = reference.ours.tokens[k], reference.llamacpp.tokens[k]
    llamacpp_margin = reference.llamacpp.logprobs[k][theirs] - reference.llamacpp.logprobs[k][ours]
    # The engine's top candidates must include llama.cpp's choice for the tie to be near.
    our_logprobs = reference.ours.logprobs[k]
    assert theirs in our_logprobs, f"step {k}: llama.cpp's {theirs} is not among the engine's top {TOP}"
    our_margin = our_logprobs[ours] - our_logprobs[theirs]
    assert 0 <= llamacpp_margin < TIE and 0 <= our_margin < TIE, (k, llamacpp_margin, our_margin)

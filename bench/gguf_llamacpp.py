"""The engine against llama.cpp on the same GGUF file: prefill and decode speed, greedy agreement.

For each checkpoint (a catalog name such as ``default`` or ``gemma3-270m-q4_k_m``, or a ``.gguf``
path), both sides run the same file and the same prompt token ids (the engine's tokenizer makes
them; llama.cpp is fed the ids):

* prefill  -- a ``--prompt-tokens`` prompt (the package's own prose) to its first greedy token,
              median of ``--repeats``; tokens/s = prompt tokens / seconds
* decode   -- one stream, ``--decode-tokens`` greedy tokens after a short prompt (EOS ignored);
              tokens/s after the first token
* agreement -- how many leading tokens of the two decode runs are equal

Each side runs in a fresh subprocess (llama.cpp's OpenMP threads would otherwise spin beside
MLX's). The engine: ``EngineCore`` with its defaults (weight format ``auto``) and prefix caching
off. llama.cpp: its Python bindings (``pip install -e ".[llamacpp]"``, a ~10 minute build from
source), ``--threads`` threads (default: every core), one batch for the whole prompt, its default
f16 KV cache; its greedy step is an argmax over the logits in Python, as the engine's is in MLX.

    python bench/gguf_llamacpp.py [--models default gemma3-270m-q4_k_m] [--prompt-tokens 256]
                                  [--decode-tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DECODE_PROMPT = "The capital of France is Paris. The capital of Germany is"


@dataclass
class Job:
    """What both sides run: the file, the prompts (token ids), and how much."""

    gguf: str
    prefill: list[int]
    decode: list[int]
    decode_tokens: int
    repeats: int
    threads: int  # llama.cpp's


@dataclass
class Side:
    """One side's figures on one checkpoint."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int]  # the decode run's greedy tokens


def gguf_of(model: str) -> str:
    """A ``.gguf`` path as it is; otherwise the file of the catalog checkpoint of that name."""
    from vllm_mlx.models.catalog import checkpoint_gguf_path

    return model if os.path.isfile(model) else str(checkpoint_gguf_path(model))


def prompts(tokenizer, prompt_tokens: int) -> tuple[list[int], list[int]]:
    """(the long prefill prompt, the short decode prompt), as token ids."""
    from vllm_mlx.entrypoints.bench import corpus_text

    ids = tokenizer.encode(corpus_text())
    while len(ids) < prompt_tokens:
        ids += ids
    return ids[:prompt_tokens], tokenizer.encode(DECODE_PROMPT)


def measure(run, job: Job) -> Side:
    """Medians over ``job.repeats`` after a warm-up; ``run(prompt, max_tokens)`` returns (seconds
    to the first token, seconds for the rest, the tokens)."""
    run(job.prefill, 4)  # warm-up
    prefill_s = statistics.median(run(job.prefill, 1)[0] for _ in range(job.repeats))
    decodes = [run(job.decode, job.decode_tokens) for _ in range(job.repeats)]
    decode_s = statistics.median(seconds for _, seconds, _ in decodes)
    tokens = decodes[0][2]
    return Side(len(job.prefill) / prefill_s, (len(tokens) - 1) / decode_s, tokens)


def engine_side(job: Job) -> Side:
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=job.gguf, enable_prefix_caching=False, force_model_takeover=True,
                        max_num_batched_tokens=max(512, len(job.prefill)))  # fmt: skip

    def run(prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start, first, tokens = time.perf_counter(), None, []
        request = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request and out.outputs[0].token_ids and first is None:
                    first = time.perf_counter()
                if out.request_id == request and out.finished:
                    tokens = list(out.outputs[0].token_ids)
        return first - start, time.perf_counter() - first, tokens

    try:
        return measure(run, job)
    finally:
        engine.shutdown()


def llamacpp_side(job: Job) -> Side:
    import llama_cpp
    import numpy as np

    n_ctx = max(len(job.prefill), len(job.decode) + job.decode_tokens) + 8
    llm = llama_cpp.Llama(model_path=job.gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=job.threads, verbose=False)

    def argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        return int(logits.argmax())

    def run(prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        tokens = [argmax()]
        first = time.perf_counter()
        while len(tokens) < max_tokens:
            llm.eval(tokens[-1:])
            tokens.append(argmax())
        return first - start, time.perf_counter() - first, tokens

    try:
        return measure(run, job)
    finally:
        llm.close()


SIDES = {"engine": engine_side, "llama.cpp": llamacpp_side}


def child(side: str, job_file: str) -> None:
    """Run one side (in a fresh process) on the job in ``job_file``; print its figures as JSON."""
    job = json.loads(Path(job_file).read_text())
    result = SIDES[side](Job(**job))
    print(json.dumps(asdict(result)))


def run_side(side: str, job: Job) -> Side:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(asdict(job), f)
    try:
        out = subprocess.run([sys.executable, __file__, "--child", side, f.name],
                             capture_output=True, text=True, check=True)  # fmt: skip
    except subprocess.CalledProcessError as exc:
        sys.exit(f"{side} failed:\n{exc.stderr[-2000:]}")
    finally:
        os.unlink(f.name)
    return Side(**json.loads(out.stdout.strip().splitlines()[-1]))


def compare(model: str, args: argparse.Namespace) -> None:
    from vllm_mlx.models import load_model

    gguf = gguf_of(model)
    prefill, decode = prompts(load_model(gguf).tokenizer, args.prompt_tokens)
    job = Job(gguf, prefill, decode, args.decode_tokens, args.repeats, args.threads)
    load_before = os.getloadavg()[0]
    ours, theirs = run_side("engine", job), run_side("llama.cpp", job)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    agree = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b), len(ours.tokens))
    print(f"\n{model} ({os.path.basename(gguf)}), {os.cpu_count()} cores ({load}), "
          f"llama.cpp on {args.threads} threads:")  # fmt: skip
    print(f"{'':28s} {'vllm-mlx':>10s} {'llama.cpp':>10s} {'ratio':>7s}")
    for label, a, b in (
        (f"prefill tok/s ({len(prefill)} tokens)", ours.prefill_tps, theirs.prefill_tps),
        ("decode tok/s (1 stream)", ours.decode_tps, theirs.decode_tps),
    ):
        print(f"{label:28s} {a:10.1f} {b:10.1f} {a / b:6.2f}x")
    print(f"greedy agreement: {agree} of {len(ours.tokens)} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "gemma3-270m-q4_k_m"])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (default: every core)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    for model in args.models:
        compare(model, args)


if __name__ == "__main__":
    main()

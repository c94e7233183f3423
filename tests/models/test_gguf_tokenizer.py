"""The tokenizer built from GGUF metadata against an independent BPE implementation."""

from __future__ import annotations

import pytest

from bpe_reference import ReferenceBPE

SAMPLES = [
    "What is the capital of France?",
    "Hello 12345 world! 3.14159 and 2,000,000",
    "ünïcödé — naïve café, 日本語のテキスト, emoji 🚀🎉, Ελληνικά, русский",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tif x != 0: pass",
    "  leading spaces, trailing spaces   \n\n\n multiple\r\nnewlines",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't, I'll, we're, they've, it's",
]


@pytest.fixture(scope="module")
def gguf_metadata():
    import mlx.core as mx

    from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf

    _, metadata = mx.load(str(checkpoint_gguf(SMOLLM2)), return_metadata=True)
    return metadata


@pytest.fixture(scope="module")
def reference(gguf_metadata):
    tokens = list(gguf_metadata["tokenizer.ggml.tokens"])
    types = gguf_metadata["tokenizer.ggml.token_type"].tolist()
    special = [t for t, kind in zip(tokens, types) if kind == 3]
    return ReferenceBPE(tokens, list(gguf_metadata["tokenizer.ggml.merges"]), special, split_digits=True)


@pytest.fixture(scope="module")
def converted_tokenizer():
    import mlx_lm

    from vllm_mlx.models import resolve_model

    return mlx_lm.tokenizer_utils.load(resolve_model("default"))


@pytest.mark.parametrize("text", SAMPLES)
def test_token_ids_match_independent_bpe(text, reference, converted_tokenizer):
    expected = reference.encode(text)
    assert converted_tokenizer.encode(text, add_special_tokens=False) == expected


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(text, converted_tokenizer):
    ids = converted_tokenizer.encode(text, add_special_tokens=False)
    assert converted_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(converted_tokenizer):
    tok = converted_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)  # no BOS
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


def test_reference_is_not_trivially_equal(reference):
    # The oracle must split digits one by one and merge words: guards against a degenerate reference.
    ids = reference.encode("the 2024")
    assert len(ids) == 6  # "the", " ", "2", "0", "2", "4"

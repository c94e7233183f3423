"""GGUF -> MLX conversion, checked against an independent numpy forward pass of the GGUF file.

The oracle (``gguf_reference.py``) reads the file with gguf-py, dequantizes with gguf-py and runs
the weights as llama.cpp stores them, with llama.cpp's interleaved RoPE; the converted model runs
in mlx-lm with half-split RoPE. Equal logits prove the Q/K row un-permutation, the quantized
triples, grouped-query attention and tied embeddings; the negative control proves that the
oracle notices a wrong permutation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf_builder import write_tiny_llama_gguf
from gguf_reference import reference_logits

import vllm_mlx.models.gguf.convert as gguf_module
from vllm_mlx.models import resolve_model
from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf
from vllm_mlx.models.gguf import convert_gguf, resolve_gguf
from vllm_mlx.platform.errors import ModelSourceError

TOKEN_IDS = [1, 72, 263, 40, 259, 3, 120, 2, 88, 17]  # control, byte and merged tokens, 10 positions


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(quant)`` -> path of a tiny llama GGUF, written once per quant type."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    written: dict[str, Path] = {}

    def get(quant: str = "Q4_1") -> Path:
        if quant not in written:
            written[quant] = root / f"tiny-{quant.lower()}.gguf"
            write_tiny_llama_gguf(written[quant], quant=quant)
        return written[quant]

    return get


def mlx_logits(model_dir: Path, token_ids) -> np.ndarray:
    model, _ = mlx_lm.load(str(model_dir))
    return np.array(model(mx.array([token_ids]))[0].astype(mx.float32))


def assert_close_logits(out: np.ndarray, ref: np.ndarray, rel: float) -> None:
    assert out.shape == ref.shape
    diff = np.abs(out - ref).max()
    scale = np.abs(ref).max()
    assert diff < rel * scale, f"max |mlx - reference| = {diff:.3g} (logit scale {scale:.3g})"
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


# ---------------------------------------------------------------------------
# Tiny model: logits equal the reference, for quantized and float weights


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_0", "Q8_0", "F16", "F32"])
def test_tiny_model_logits_match_reference(tiny_gguf, tmp_path, quant):
    path = tiny_gguf(quant)
    out_dir = convert_gguf(path, tmp_path / "model", scale_dtype="float32")
    out = mlx_logits(out_dir, TOKEN_IDS)
    ref = reference_logits(path, TOKEN_IDS)
    assert_close_logits(out, ref, rel=1e-4)  # observed ~1e-6 relative: float32 summation order only


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL"])
def test_k_and_i_quant_logits_match_reference(tmp_path, quant):
    """Layer matrices in the K-quant and i-quant layouts (random blocks: gguf-py has no quantizer
    for them; K-quant rows are whole super-blocks of 256). Q4_K/Q5_K are held exactly, so only
    float32 summation order separates them from the reference; the others go through the 8-bit
    re-quantization: observed at most 0.6% of the logit scale, the same top-1 everywhere."""
    path = tmp_path / f"tiny-{quant}.gguf"
    write_tiny_llama_gguf(path, quant=quant, hidden=256, ffn=256, heads=4, kv_heads=2)
    out_dir = convert_gguf(path, tmp_path / "model", scale_dtype="float32")
    exact = quant in ("Q4_K", "Q5_K")
    assert_close_logits(mlx_logits(out_dir, TOKEN_IDS), reference_logits(path, TOKEN_IDS), rel=1e-4 if exact else 1e-2)


def test_tiny_model_config_and_scales(tiny_gguf, tmp_path):
    out_dir = convert_gguf(tiny_gguf("Q4_1"), tmp_path / "model", scale_dtype="float32")
    config = json.loads((out_dir / "config.json").read_text())
    # Q4_1 layers, Q8_0 embedding: 4 bits by default, an 8-bit override for the embedding only.
    embedding = {"group_size": 32, "bits": 8}
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": embedding}
    assert config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["vocab_size"] == 264 and config["rope_traditional"] is False
    weights = mx.load(str(out_dir / "model.safetensors"))
    aux = {name: a.dtype for name, a in weights.items() if name.endswith((".scales", ".biases"))}
    assert len(aux) == 2 * (1 + 2 * 7)  # embedding + 7 matrices per layer, two layers
    assert set(aux.values()) == {mx.float32}
    assert "lm_head.weight" not in weights


def test_float_model_has_no_quantization(tiny_gguf, tmp_path):
    out_dir = convert_gguf(tiny_gguf("F32"), tmp_path / "model", scale_dtype="float32")
    assert "quantization" not in json.loads((out_dir / "config.json").read_text())


def test_skipping_the_rope_unpermutation_disagrees_with_reference(tiny_gguf, tmp_path, monkeypatch):
    """Negative control: the oracle sees the Q/K row layout, so a converter that forgets it fails."""
    monkeypatch.setattr(gguf_module, "unpermute_rope_rows", lambda array, n_heads: array)
    path = tiny_gguf("Q4_1")
    out = mlx_logits(convert_gguf(path, tmp_path / "model", scale_dtype="float32"), TOKEN_IDS)
    ref = reference_logits(path, TOKEN_IDS)
    # Position 0 has no rotation, so it agrees; every later one is far off (observed ~10 vs 15 scale).
    np.testing.assert_allclose(out[0], ref[0], atol=1e-3)
    per_position = np.abs(out - ref).max(-1)[1:]
    assert (per_position > 1e-2 * np.abs(ref).max()).all(), per_position


# ---------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct Q4_1), from the user's cache


@pytest.mark.e2e
def test_default_model_logits_match_reference():
    model_dir = resolve_model("default")
    model, tokenizer = mlx_lm.load(str(model_dir))
    # float16 scales (Metal's default) are exact in float32; compute in float32 on every backend.
    model.set_dtype(mx.float32)
    messages = [{"role": "user", "content": "Capital of France"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = ids[[i for i, t in enumerate(ids) if t == im_start][-2] :]  # drop the default system turn
    assert tokenizer.decode(ids) == "<|im_start|>user\nCapital of France<|im_end|>\n<|im_start|>assistant\n"
    assert len(ids) <= 12
    out = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    ref = reference_logits(checkpoint_gguf(SMOLLM2), ids)
    # Observed max |diff| ~1.2e-4 (logits up to ~35); with the un-permutation skipped it is > 1 at
    # every position after the first (checked by hand), so 2e-3 passes with margin and still bites.
    assert np.abs(out - ref).max() < 2e-3, np.abs(out - ref).max(-1)
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


# ---------------------------------------------------------------------------
# Bad files: one-line ModelSourceError, nothing left in the cache


def assert_nothing_cached(cache: Path) -> None:
    models = cache / "models"
    leftovers = sorted(p.name for p in models.iterdir()) if models.exists() else []
    assert leftovers == []


def _truncated(tmp_path: Path, tiny: Path) -> Path:
    data = tiny.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])
    return path


def _random_bytes(tmp_path: Path, tiny: Path) -> Path:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path


def _text_file(tmp_path: Path, tiny: Path) -> Path:
    path = tmp_path / "x.gguf"
    path.write_text("this is a text file, not a model\n")
    return path


def _mamba(tmp_path: Path, tiny: Path) -> Path:
    path = tmp_path / "mamba.gguf"
    write_tiny_llama_gguf(path, arch="mamba")
    return path


def _missing(tmp_path: Path, tiny: Path) -> Path:
    return tmp_path / "no-such-model.gguf"


@pytest.mark.parametrize(
    "make, reason",
    [
        (_truncated, "extends past the end of the file"),
        (_random_bytes, "not a GGUF file"),
        (_text_file, "not a GGUF file"),
        (_mamba, "'mamba'"),
        (_missing, "not found"),
    ],
    ids=["truncated", "random-bytes", "text-file", "mamba", "missing"],
)
def test_bad_gguf_is_a_one_line_error_and_leaves_nothing(tiny_gguf, tmp_path, empty_cache, make, reason):
    path = make(tmp_path, tiny_gguf("Q4_1"))
    with pytest.raises(ModelSourceError) as info:
        resolve_model(path)
    message = str(info.value)
    assert "\n" not in message
    assert reason in message
    if make is not _mamba:
        assert path.name in message
    assert_nothing_cached(empty_cache)


def run_child(code: str, *args: str, cache: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_MLX_CACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


RESOLVE_OR_EXIT_3 = """
    import sys
    from vllm_mlx.platform.errors import ModelSourceError
    from vllm_mlx.models import resolve_model
    try:
        resolve_model(sys.argv[1])
    except ModelSourceError as exc:
        print(exc)
        sys.exit(3)
    print("converted without an error")
"""


def test_gguf_magic_followed_by_garbage_is_a_clear_error(tmp_path):
    # In a child process: MLX's C reader would crash the interpreter on such a header.
    path = tmp_path / "garbage-after-magic.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + np.random.default_rng(0).bytes(4096))
    result = run_child(RESOLVE_OR_EXIT_3, str(path), cache=tmp_path / "cache")
    assert_nothing_cached(tmp_path / "cache")
    assert result.returncode == 3, f"exit status {result.returncode}: {result.stderr[-500:]}"
    assert path.name in result.stdout and result.stdout.count("\n") == 1


# ---------------------------------------------------------------------------
# Disk full (file size limit) during conversion

DISK_LIMIT = 20_000

CONVERT_UNDER_FSIZE_LIMIT = f"""
    import resource, signal
    resource.setrlimit(resource.RLIMIT_FSIZE, ({DISK_LIMIT}, {DISK_LIMIT}))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
""" + RESOLVE_OR_EXIT_3


@pytest.fixture(scope="module")
def disk_full_run(tiny_gguf, tmp_path_factory):
    tiny = tiny_gguf("Q4_1")
    root = tmp_path_factory.mktemp("disk-full")
    reference = convert_gguf(tiny, root / "unlimited", scale_dtype="float32")
    assert (reference / "model.safetensors").stat().st_size > 2 * DISK_LIMIT  # the limit must bite
    result = run_child(CONVERT_UNDER_FSIZE_LIMIT, str(tiny), cache=root / "cache")
    return result, root / "cache"


def test_disk_full_leaves_no_directory(disk_full_run):
    result, cache = disk_full_run
    assert result.returncode != 0, result.stdout  # the conversion did fail
    assert (cache / "models").is_dir()  # it got as far as the cache ...
    assert_nothing_cached(cache)  # ... and left neither a model nor a temporary directory


def test_disk_full_is_a_model_source_error(disk_full_run):
    result, _ = disk_full_run
    assert result.returncode == 3, f"exit status {result.returncode}: {result.stderr.strip().splitlines()[-1:]}"
    assert "could not write the model" in result.stdout and result.stdout.count("\n") == 1


# ---------------------------------------------------------------------------
# The cache is keyed by file content


def hash_part(model_dir: Path) -> str:
    return model_dir.name.rsplit("-", 2)[-2]  # gguf-<stem>-<sha256[:12]>-<scale dtype>


def test_resolve_gguf_caches_by_content(tiny_gguf, tmp_path, empty_cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_gguf("Q4_1"), path)
    first = resolve_gguf(path)
    assert first.parent == empty_cache / "models"
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_module, "convert_gguf", no_conversion)
        assert resolve_gguf(path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    renamed = tmp_path / "Another-Name.gguf"
    shutil.copyfile(path, renamed)
    second = resolve_gguf(renamed)
    assert second != first and hash_part(second) == hash_part(first)

    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    changed = tmp_path / "tiny-changed" / "tiny.gguf"
    changed.parent.mkdir()
    changed.write_bytes(bytes(data))
    third = resolve_gguf(changed)
    assert hash_part(third) != hash_part(first) and third.name != first.name
    assert sorted(p.name for p in (empty_cache / "models").iterdir()) == sorted({first.name, second.name, third.name})


def test_convert_command_writes_a_directory_mlx_lm_loads(tiny_gguf, tmp_path, capsys):
    from vllm_mlx.entrypoints.cli import main

    out_dir = tmp_path / "converted"
    assert main(["convert", str(tiny_gguf("Q4_1")), str(out_dir), "--scale-dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(out_dir)
    assert_close_logits(mlx_logits(out_dir, TOKEN_IDS), reference_logits(tiny_gguf("Q4_1"), TOKEN_IDS), rel=1e-4)
    manifest = json.loads((out_dir / "vllm_mlx_model.json").read_text())
    assert manifest["source_sha256"] == gguf_module.file_sha256(tiny_gguf("Q4_1"))
    assert main(["convert", str(tiny_gguf("Q4_1")), str(out_dir)]) == 1  # never over an existing directory
    assert "exists" in capsys.readouterr().err


def test_generation_stops_where_llama_cpp_stops(tiny_gguf, tmp_path):
    """EOS and the end-of-turn tokens llama.cpp stops on (here <|endoftext|> beside the file's
    EOS <|im_end|>) are all the converted model's EOS ids, which the engine stops on."""
    out_dir = convert_gguf(tiny_gguf("Q4_1"), tmp_path / "model", scale_dtype="float32")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["eos_token_id"] == [0, 2]  # <|endoftext|>, <|im_end|>
    _, tokenizer = mlx_lm.load(str(out_dir))
    assert set(tokenizer.eos_token_ids) == {0, 2}


def test_engine_greedy_on_a_k_quant_file_equals_the_reference(tmp_path, empty_cache):
    """The engine on a Q4_K file (held exactly; float32 on the CPU backend) generates the tokens
    an independent float64 forward pass over gguf-py's dequantized weights picks (the file is
    converted into an empty cache, as --model FILE.gguf does)."""
    from vllm_mlx import LLM, SamplingParams

    path = tmp_path / "tiny-q4_k.gguf"
    write_tiny_llama_gguf(path, quant="Q4_K", hidden=256, ffn=256, heads=4, kv_heads=2)
    expected = list(TOKEN_IDS)
    for _ in range(6):
        expected.append(int(reference_logits(path, expected)[-1].argmax()))
    llm = LLM(str(path), kv_cache_memory=8 << 20, max_num_seqs=2)
    try:
        out = llm.generate({"prompt_token_ids": TOKEN_IDS}, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == expected[len(TOKEN_IDS) :]


LYING_METADATA = {
    "more-layers-than-held": ({"llama.block_count": 100_000}, "block_count is 100000, but the file holds layers 0..1"),
    "no-layers": ({"llama.block_count": 0}, "block_count is 0"),
    "no-heads": ({"llama.attention.head_count": 0}, "head_count is 0"),
    "heads-missing": ({"llama.attention.head_count": None}, "lacks llama.attention.head_count"),
    "array-for-a-number": ({"llama.embedding_length": [64, 64]}, "embedding_length is [64, 64]"),
    "tokens-not-strings": ({"tokenizer.ggml.tokens": [1, 2, 3]}, "tokens is not a list of strings"),
    "token-types-short": ({"tokenizer.ggml.token_type": [1]}, "token_type does not hold one number per token"),
    "scores-short": ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.5]}, "scores does not hold"),
    "merges-not-strings": ({"tokenizer.ggml.merges": [1, 2]}, "merges is not a list of strings"),
    "special-id-not-int": ({"tokenizer.ggml.bos_token_id": "one"}, "bos_token_id is not an integer"),
}


@pytest.mark.parametrize("name", list(LYING_METADATA))
def test_metadata_that_lies_is_a_one_line_error_before_any_tensor(tmp_path, empty_cache, name):
    """A file whose metadata disagrees with its tensors or has the wrong shape of value fails
    at once with one line, before a tensor is converted, and leaves nothing in the cache."""
    metadata, reason = LYING_METADATA[name]
    path = tmp_path / f"{name}.gguf"
    write_tiny_llama_gguf(path, metadata=metadata)
    with pytest.raises(ModelSourceError) as info:
        resolve_model(path)
    assert "\n" not in str(info.value) and reason in str(info.value)
    assert_nothing_cached(empty_cache)

"""Every supported GGUF architecture converts back to the model it was written from.

A tiny random-weight mlx-lm model of each architecture is written as llama.cpp's converter
would (``tests/gguf_arch_builder.py``: gguf-py's name table, the converter's row permutation and
norm offset), converted with vllm-mlx, and loaded with mlx-lm: equal logits prove the names, the
config (head dims, soft-capping, sliding windows, multipliers, experts, shared experts), the
undone permutation and offset. Then the engine's greedy tokens on the converted directory equal
mlx-lm's, and an architecture we do not support is refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf_arch_builder import CASES, build_model, write_arch_gguf
from gguf_builder import write_tiny_llama_gguf

from vllm_mlx.models.gguf import convert_gguf
from vllm_mlx.models.gguf.architectures import ARCHITECTURES
from vllm_mlx.platform.errors import ModelSourceError

TOKEN_IDS = [1, 72, 263, 40, 259, 3, 120, 2, 88, 17, 45, 99]  # longer than gemma3's window of 4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``converted(case_name, qtype)`` -> (original model, converted directory), once each."""
    root = tmp_path_factory.mktemp("gguf-arch")
    done = {}

    def get(name: str, qtype: str = "F32"):
        if (name, qtype) not in done:
            case = CASES[name]
            model = build_model(case)
            path = root / f"{name}-{qtype}.gguf"
            write_arch_gguf(path, case, model, qtype)
            done[name, qtype] = model, convert_gguf(path, root / f"{name}-{qtype}", scale_dtype="float32")
        return done[name, qtype]

    return get


def logits(model, token_ids) -> np.ndarray:
    return np.array(model(mx.array([token_ids]))[0].astype(mx.float32))


def test_every_architecture_has_a_case():
    assert {case.gguf_arch for case in CASES.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_converted_model_equals_the_original(converted, name):
    original, model_dir = converted(name)
    loaded, _ = mlx_lm.load(str(model_dir))
    out, ref = logits(loaded, TOKEN_IDS), logits(original, TOKEN_IDS)
    scale = np.abs(ref).max()
    assert np.abs(out - ref).max() < 1e-4 * scale, (name, np.abs(out - ref).max(), scale)
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gemma3", "gemma", "llama", "granitemoe"])
def test_undoing_nothing_is_noticed(converted, name, monkeypatch):
    """Negative control: the oracle tells a conversion that skips the offset or permutation."""
    from vllm_mlx.models.gguf import architectures

    original, model_dir = converted(name)
    arch = ARCHITECTURES[CASES[name].gguf_arch]
    assert arch.rope_permuted or arch.norm_offset
    broken = dataclasses.replace(arch, rope_permuted=False, norm_offset=0.0)
    monkeypatch.setitem(architectures.ARCHITECTURES, arch.name, broken)
    path = next(model_dir.parent.glob(f"{name}-F32.gguf"))
    bad = convert_gguf(path, model_dir.parent / f"{name}-broken", scale_dtype="float32")
    loaded, _ = mlx_lm.load(str(bad))
    out, ref = logits(loaded, TOKEN_IDS), logits(original, TOKEN_IDS)
    assert np.abs(out - ref).max() > 0.05 * np.abs(ref).max()


def test_quantized_layers_convert_with_their_bits(converted):
    original, model_dir = converted("qwen3", "Q8_0")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    loaded, _ = mlx_lm.load(str(model_dir))
    out, ref = logits(loaded, TOKEN_IDS), logits(original, TOKEN_IDS)
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()  # Q8_0's own rounding, not ours


def test_manifest_records_source_digest_and_architecture(converted):
    from vllm_mlx.models.gguf import file_sha256

    _, model_dir = converted("phi3")
    manifest = json.loads((model_dir / "vllm_mlx_model.json").read_text())
    assert manifest["architecture"] == "phi3"
    assert manifest["source_sha256"] == file_sha256(next(model_dir.parent.glob("phi3-F32.gguf")))


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_greedy_equals_mlx_lm_on_the_converted_model(converted, name):
    from mlx_lm.generate import generate_step

    from vllm_mlx import LLM, SamplingParams

    _, model_dir = converted(name)
    model, _ = mlx_lm.load(str(model_dir))
    steps = generate_step(mx.array(TOKEN_IDS), model, sampler=lambda x: mx.argmax(x, axis=-1))
    expected = [int(token) for (token, _), _ in zip(steps, range(8))]
    llm = LLM(str(model_dir), kv_cache_memory=8 << 20, max_num_seqs=2)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": TOKEN_IDS}, params)
    finally:
        llm.shutdown()
    assert list(out[0].outputs[0].token_ids) == expected


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_llama_gguf(path, arch="falcon")
    with pytest.raises(ModelSourceError) as error:
        convert_gguf(path, tmp_path / "out")
    message = str(error.value)
    assert "'falcon'" in message and all(name in message for name in ARCHITECTURES)
    assert not (tmp_path / "out").exists()


def test_a_tensor_the_model_has_no_place_for_is_refused_before_converting(converted, tmp_path, monkeypatch):
    """E.g. GraniteMoeShared is written as granitemoe plus shared-expert tensors, which mlx-lm's
    granitemoe lacks: refused by name, before anything is converted or written."""
    from vllm_mlx.models.gguf import architectures

    _, model_dir = converted("qwen2moe")
    arch = ARCHITECTURES["qwen2moe"]
    no_shared = {k: v for k, v in arch.layers.items() if not k.endswith("_shexp")}
    monkeypatch.setitem(architectures.ARCHITECTURES, "qwen2moe", dataclasses.replace(arch, layers=no_shared))
    with pytest.raises(ModelSourceError, match=r"blk\.0\.ffn_\w+_shexp\.weight"):
        convert_gguf(next(model_dir.parent.glob("qwen2moe-F32.gguf")), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_olmo3_written_as_olmo2_is_refused(tmp_path):
    """llama.cpp writes OLMo 3 as ``olmo2`` with a sliding window: not the mlx-lm olmo2 model."""
    case = dataclasses.replace(CASES["olmo2"], extra_metadata={"attention.sliding_window": 4})
    path = tmp_path / "olmo3.gguf"
    write_arch_gguf(path, case, build_model(case))
    with pytest.raises(ModelSourceError, match="OLMo 3"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_large_models_are_written_in_shards(converted, tmp_path, monkeypatch):
    """A conversion holds one shard in memory: with small shards the model still loads whole."""
    from vllm_mlx.models.gguf import convert as convert_module

    original, model_dir = converted("qwen3moe")
    monkeypatch.setattr(convert_module, "SHARD_BYTES", 64 << 10)
    path = next(model_dir.parent.glob("qwen3moe-F32.gguf"))
    sharded = convert_gguf(path, tmp_path / "sharded", scale_dtype="float32")
    shards = sorted(p.name for p in sharded.glob("model*.safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    loaded, _ = mlx_lm.load(str(sharded))
    np.testing.assert_array_equal(logits(loaded, TOKEN_IDS), logits(mlx_lm.load(str(model_dir))[0], TOKEN_IDS))

"""KV pool sizing from the layout the model really writes (``measure_kv_layout``): the dtype
of its keys and values, its KV heads and head sizes, per layer group."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_model import build_tiny_llama

from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore

BUDGET = 64 * 2**10  # holds a whole number of float32 blocks of the tiny llama (block_size 4)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def cast_weights(model_dir, dtype) -> None:
    """Rewrite the directory's floating-point weights in ``dtype`` (as a converted checkpoint)."""
    path = str(model_dir / "model.safetensors")
    weights = mx.load(path)
    mx.save_safetensors(path, {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
                               for k, v in weights.items()})  # fmt: skip


@pytest.fixture(scope="module")
def dtype_dirs(tmp_path_factory, default_model_dir):
    dirs = {}
    for name, dtype in (("float32", None), ("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        dirs[name] = build_tiny_llama(tmp_path_factory.mktemp(name), default_model_dir)
        if dtype is not None:
            cast_weights(dirs[name], dtype)
    return dirs


def sized_engine(model_dir) -> EngineCore:
    return EngineCore(model=str(model_dir), kv_cache_memory=BUDGET, block_size=4, force_model_takeover=True)


def run_a_request(engine: EngineCore) -> None:
    engine.add_request("The quick brown fox jumps over the lazy dog.", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_precision_model_gets_twice_the_blocks(dtype_dirs, half):
    engines = {}
    try:
        for name in ("float32", half):
            engines[name] = engine = sized_engine(dtype_dirs[name])
            run_a_request(engine)
            assert engine.kv_layout.dtype == name
            # The pool the model filled is exactly what the budget counted.
            pool = engine.runner.pool
            assert pool.dtype == name
            assert pool.nbytes == engine.kv_layout.bytes_per_token * pool.num_slots
            assert pool.nbytes == BUDGET + engine.kv_layout.bytes_per_token * 4  # + the null block
        full, reduced = engines["float32"], engines[half]
        assert reduced.kv_layout.bytes_per_token * 2 == full.kv_layout.bytes_per_token
        blocks = [e.kv_cache.num_blocks - 1 for e in (full, reduced)]  # without the null block
        assert blocks[1] == 2 * blocks[0]
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_layout_counts_heads_and_sizes_per_group(dtype_dirs):
    engine = sized_engine(dtype_dirs["bfloat16"])
    try:
        [group] = engine.kv_layout.groups
        # K + V, 2 layers, 2 KV heads of 16, 2 bytes each (tests/tiny_model.py's llama).
        assert group.bytes_per_token == 2 * 2 * 2 * 16 * 2
        assert group.layers == (0, 1)
        [info] = engine.cache_snapshot(include_blocks=False)["kv_groups"]
        assert info == {"kind": "full_attention", "window": None, "layers": [0, 1], "bytes_per_token": 256,
                        "dtype": "bfloat16", "num_blocks": engine.kv_cache.num_blocks}  # fmt: skip
    finally:
        engine.shutdown()


# DeepSeek-V3's multi-head latent attention: mlx-lm caches one compressed "head" per token (the
# kv_lora_rank latent as keys, the rotary part as values), not num_key_value_heads full heads.
TINY_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
}  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, default_model_dir):
    return build_tiny_llama(tmp_path_factory.mktemp("deepseek_v3"), default_model_dir, **TINY_DEEPSEEK_V3)


def test_latent_attention_is_sized_by_its_latent(deepseek_dir):
    from vllm_mlx.engine.core import kv_bytes_per_token

    engine = sized_engine(deepseek_dir)
    try:
        run_a_request(engine)
        # 2 layers of a 16-wide latent (keys) and an 8-wide rotary part (values), float32.
        assert engine.kv_layout.bytes_per_token == 2 * (16 + 8) * 4
        assert engine.runner.pool.nbytes == engine.kv_layout.bytes_per_token * engine.runner.pool.num_slots
        # Heads x head size from the config would have counted 2 KV heads of 16 for keys and values.
        assert kv_bytes_per_token(engine.model_config, 4, engine.runner.model) > 2 * engine.kv_layout.bytes_per_token
    finally:
        engine.shutdown()


def test_latent_attention_equals_mlx_lm(deepseek_dir):
    """The oracle for deepseek_v3 (model_support.TESTED_ARCHITECTURES): greedy tokens of prompts
    batched with chunked prefill and small blocks equal mlx-lm's, prompt by prompt."""
    import mlx_lm

    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "One two three four five six seven " * 3]
    model, tokenizer = mlx_lm.load(str(deepseek_dir))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [[r.token for r in mlx_lm.stream_generate(model, tokenizer, tokenizer.encode(p), max_tokens=8)]
                for p in prompts]  # fmt: skip
    engine = EngineCore(model=str(deepseek_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        final = {}
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        engine.shutdown()
    assert [final[i].outputs[0].token_ids for i in ids] == expected

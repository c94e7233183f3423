"""The weight format by memory (``vllm_mlx/engine/weight_plan.py``): what "auto" picks on the CPU
backend for the memory the engine may use (``memory_limit``), and the refusal, before loading,
of a format that cannot fit. Real engines on a tiny random-weight quantized model: its float32
copy is ~13 MB, bfloat16 ~6.4 MB, the 4-bit checkpoint ~3.6 MB."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from vllm_mlx.config import EngineConfig
from vllm_mlx.core.kv.sizing import MEMORY_MARGIN_FLOOR, EngineMemory, format_bytes
from vllm_mlx.core.request import SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.engine.weight_plan import kv_pool_bytes, plan_weight_format
from vllm_mlx.models.weight_sizes import weight_sizes
from vllm_mlx.platform.cpu_backend import choose_weight_format
from vllm_mlx.platform.errors import ModelMemoryError

pytestmark = pytest.mark.skipif(choose_weight_format("auto") != "float32", reason="auto is by memory on the CPU backend only")

POOL = {"num_kv_blocks": 64, "block_size": 16}  # a small pool: 1024 tokens, 128 KB in float32
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory, default_model_dir):
    from tiny_model import build_tiny_quantized

    return build_tiny_quantized(tmp_path_factory.mktemp("wq") / "model", default_model_dir)


def _config(**options) -> EngineConfig:
    config = EngineConfig(**options)
    config.normalize()
    return config


def _needs(model_dir) -> dict[str, int]:
    """Every format's need (weights + the small pool) for the tiny model, in bytes."""
    plan = plan_weight_format(_config(model=str(model_dir), memory_limit=1 << 40, **POOL), model_dir)
    return {n.weight_format: n.total for n in plan.needs}


def _between(low: int, high: int) -> int:
    return (low + high) // 2


def _engine(model_dir, limit: int, **options) -> EngineCore:
    return EngineCore(model=str(model_dir), memory_limit=limit, **POOL, **options)


def _dtypes(engine) -> set:
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(engine.runner.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def _engine_tokens(engine) -> list[list[int]]:
    from oracles import engine_tokens

    try:
        return engine_tokens(engine, PROMPTS, GREEDY)
    finally:
        engine.shutdown()


def _reference_tokens(model_dir, weight_format: str) -> list[list[int]]:
    """mlx-lm's greedy tokens with the weights put in ``weight_format`` as the engine puts them."""
    import mlx_lm

    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    model, tokenizer = mlx_lm.load(str(model_dir))
    assert prepare_model_weights(model, weight_format) == weight_format
    return [
        [r.token for r in mlx_lm.stream_generate(model, tokenizer, tokenizer.encode(p), max_tokens=GREEDY.max_tokens)]
        for p in PROMPTS
    ]


def test_needs_are_the_weights_plus_the_pool(quantized_dir):
    sizes = weight_sizes(quantized_dir)
    needs = _needs(quantized_dir)
    per_token_f32 = 2 * 2 * 2 * 16 * 4  # K + V, 2 layers, 2 KV heads of 16 (tests/tiny_model.py)
    assert needs["float32"] == sizes.float32 + 64 * 16 * per_token_f32
    assert needs["bfloat16"] == sizes.bfloat16 + 64 * 16 * per_token_f32 // 2
    assert needs["quantized"] == sizes.quantized + 64 * 16 * per_token_f32 // 2  # the checkpoint's bfloat16
    assert needs["quantized"] < needs["bfloat16"] < needs["float32"]


def test_auto_runs_float32_when_it_fits(quantized_dir):
    needs = _needs(quantized_dir)
    engine = _engine(quantized_dir, needs["float32"] + (1 << 20))
    assert engine.weight_format == "float32" and _dtypes(engine) == {mx.float32}
    assert engine.weight_plan.fits("float32")
    engine.shutdown()


def test_auto_falls_back_to_bfloat16_and_serves(quantized_dir, caplog):
    needs = _needs(quantized_dir)
    with caplog.at_level(logging.INFO, logger="vllm_mlx.engine.weight_plan"):
        engine = _engine(quantized_dir, _between(needs["bfloat16"], needs["float32"]))
    assert engine.weight_format == "bfloat16" and _dtypes(engine) == {mx.bfloat16}
    # One line, a warning (the fastest format was given up), with the figures.
    lines = [r for r in caplog.records if r.name == "vllm_mlx.engine.weight_plan"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    message = lines[0].getMessage()
    assert "bfloat16 weights (auto)" in message and f"float32 would need {format_bytes(needs['float32'])}" in message
    # It serves: greedy tokens equal mlx-lm's on the same weights in bfloat16.
    assert _engine_tokens(engine) == _reference_tokens(quantized_dir, "bfloat16")


def test_auto_keeps_the_quantized_checkpoint_when_only_it_fits(quantized_dir):
    needs = _needs(quantized_dir)
    engine = _engine(quantized_dir, _between(needs["quantized"], needs["bfloat16"]))
    assert engine.weight_format == "quantized"
    assert "float32 would need" in engine.weight_plan.line() and "bfloat16 would need" in engine.weight_plan.line()
    tokens = _engine_tokens(engine)
    # The same tokens as the checkpoint run as is without a limit. (Not compared with mlx-lm's
    # whole sequences: with quantized bfloat16 weights our CPU kernels round differently from
    # mlx-lm's and this random model's second prompt parts ways after one token;
    # VLLM_MLX_CPU_KERNELS=0 matches it.)
    assert tokens == _engine_tokens(EngineCore(model=str(quantized_dir), weight_format="quantized", **POOL))
    reference = _reference_tokens(quantized_dir, "quantized")
    assert [t[:1] for t in tokens] == [t[:1] for t in reference] and all(len(t) == 8 for t in tokens)


def test_an_explicit_format_over_the_limit_is_refused_before_loading(quantized_dir):
    needs, sizes = _needs(quantized_dir), weight_sizes(quantized_dir)
    limit = _between(needs["bfloat16"], needs["float32"])
    mx.eval(mx.zeros(1))
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    with pytest.raises(ModelMemoryError) as info:
        _engine(quantized_dir, limit, weight_format="float32")
    # Nothing was loaded: MLX allocated less than the checkpoint's smallest form.
    assert mx.get_peak_memory() - active < sizes.quantized
    message = str(info.value)
    assert f"needed {format_bytes(needs['float32'])} = weights {format_bytes(sizes.float32)} + KV pool" in message
    assert f"available {format_bytes(limit)} (memory_limit)" in message
    assert f"weight_format='bfloat16' (needs {format_bytes(needs['bfloat16'])})" in message


def test_auto_refuses_a_model_that_fits_in_no_format(quantized_dir):
    needs = _needs(quantized_dir)
    with pytest.raises(ModelMemoryError, match="as quantized weights: needed"):
        _engine(quantized_dir, needs["quantized"] - 1)


def test_an_explicit_format_that_fits_is_kept(quantized_dir):
    needs = _needs(quantized_dir)
    engine = _engine(quantized_dir, needs["float32"] * 2, weight_format="bfloat16")
    assert engine.weight_format == "bfloat16" and _dtypes(engine) == {mx.bfloat16}
    engine.shutdown()


def test_a_float_checkpoint_too_large_is_refused_as_stored(tiny_model_dir):
    sizes = weight_sizes(tiny_model_dir)
    with pytest.raises(ModelMemoryError, match="as float32 \\(as stored\\) weights"):
        _engine(tiny_model_dir, sizes.float32)  # the weights alone, no room for the pool


def test_the_default_model_still_runs_float32_here(default_model_dir):
    """On a machine with a few GB free, the default model's float32 copy (~0.5 GB) and 1 GiB
    pool fit what the engine may use by default, as before."""
    plan = plan_weight_format(_config(), default_model_dir)
    if plan.memory.limit < plan.need("float32").total:
        pytest.skip(f"only {format_bytes(plan.memory.limit)} may be used on this machine now")
    assert plan.weight_format == "float32" and not plan.memory.explicit


# -- the arithmetic ----------------------------------------------------------------------------


def test_memory_the_engine_may_use():
    assert EngineMemory.of(None, available=20 * 10**9) == EngineMemory(18 * 10**9, 20 * 10**9, 2 * 10**9, False)
    small = EngineMemory.of(None, available=3 << 30)
    assert small.margin == MEMORY_MARGIN_FLOOR and small.limit == 2 << 30
    assert EngineMemory.of(None, available=1 << 29).limit == 0
    assert EngineMemory.of(5 << 30, available=1 << 29) == EngineMemory(5 << 30, 1 << 29, 0, True)
    assert EngineMemory.of(None, available=20 * 10**9).describe() == "20.0 GB available less a 2.0 GB margin"


def test_kv_pool_bytes_follow_the_pool_options():
    model_config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    per_token = 2 * 2 * 2 * 16 * 4
    assert kv_pool_bytes(_config(num_kv_blocks=10, block_size=16), model_config, 4) == 10 * 16 * per_token
    # A byte budget buys whole blocks, plus the null block.
    budget = 100 * 16 * per_token + 5
    assert kv_pool_bytes(_config(kv_cache_memory=budget), model_config, 4) == 101 * 16 * per_token
    # A fraction: the smallest workable pool (one full step, 512 tokens, + the null block) / fraction.
    assert kv_pool_bytes(_config(kv_cache_memory=0.5), model_config, 4) == 2 * 33 * 16 * per_token
    assert kv_pool_bytes(_config(kv_cache_memory=0.5, max_model_len=100), model_config, 4) == 2 * 8 * 16 * per_token
    # A config without head counts: the byte budget as it is.
    assert kv_pool_bytes(_config(kv_cache_memory=12345), {}, 4) == 12345

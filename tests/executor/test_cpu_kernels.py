"""Our exp-based CPU kernels (``vllm_mlx/executor/cpu_kernels.py``) against MLX's own.

Oracles: ``mx.exp``, mlx-lm's ``swiglu`` and ``mx.fast.scaled_dot_product_attention`` on the
same inputs (to float32 rounding), for the masks our paged caches build (causal chunks with past
context, padded rows, sliding windows) with and without skipping keys no query sees; and the
engine's greedy tokens with the kernels equal those without them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations, base, llama
from oracles import engine_tokens
from tiny_model import TINY_GEMMA3, build_tiny_llama

from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.executor import cpu_kernels
from vllm_mlx.executor.attention import BatchLayout, RowSpec
from vllm_mlx.executor.cpu_kernels import CPUKernels, SplitLinear, SharedRoPE, attention, query_blocks

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernels serve the CPU backend")


def test_exp_matches_mlx_within_float32_rounding():
    x = mx.concatenate([mx.linspace(-87, 87.9, 200_001), mx.random.uniform(-30, 5, (10_000,))])
    ours, theirs = cpu_kernels.exp(x), mx.exp(x)
    assert (mx.abs(ours - theirs) / theirs).max().item() < 5e-7
    tiny = cpu_kernels.exp(mx.array([-1e4, -200.0, -100.0]))  # below 2**-126: ~0, never NaN
    assert (tiny <= 1.2e-38).all().item() and not mx.isnan(tiny).any().item()
    huge = cpu_kernels.exp(mx.array([89.0, 1e4]))  # saturates where mx.exp overflows (above 88)
    assert ((huge > 2e38) & (huge < 3e38)).all().item()


def test_swiglu_matches_mlx_lm():
    gate, x = mx.random.normal((64, 96)) * 6, mx.random.normal((64, 96))
    np.testing.assert_allclose(cpu_kernels.swiglu(gate, x), activations.swiglu(gate, x), rtol=2e-6, atol=2e-6)


def stock_attention(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)


def qkv(batch, queries, keys, q_heads=6, kv_heads=2, dim=16, seed=0):
    mx.random.seed(seed)
    return (
        mx.random.normal((batch, q_heads, queries, dim)),
        mx.random.normal((batch, kv_heads, keys, dim)),
        mx.random.normal((batch, kv_heads, keys, dim)),
    )


def layout_for(rows: list[tuple[int, int]], block_size=4) -> BatchLayout:
    """A layout of rows given as (tokens already computed, new tokens)."""
    specs = []
    for computed, new in rows:
        blocks = list(range(1, 2 + (computed + new) // block_size))
        specs.append(RowSpec(tokens=[1] * new, num_computed=computed, block_ids=blocks))
    return BatchLayout.build(specs, block_size)


@pytest.mark.parametrize(
    "rows, window",
    [
        ([(0, 40)], None),  # a first prefill chunk: causal
        ([(37, 24)], None),  # a later chunk: past context + causal
        ([(37, 24), (0, 9), (60, 1)], None),  # padded rows of other lengths, a decode row
        ([(30, 20), (3, 12)], 8),  # sliding window
    ],
)
@pytest.mark.parametrize("block_elements", [1 << 16, 700])  # one block; many, with keys skipped
def test_attention_equals_mlx_for_paged_masks(rows, window, block_elements, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "SCORE_BLOCK_ELEMENTS", block_elements)
    layout = layout_for(rows)
    mask = layout.mask(window, window)
    q, k, v = qkv(len(rows), layout.num_new, mask.shape[-1])
    expected = stock_attention(q, k, v, mask)
    ranges = layout.key_ranges(mask)
    blocks = query_blocks(q.shape[2], q.shape[1], k.shape[2], ranges)
    if block_elements < 1 << 16:
        assert len(blocks) > 1
        # a decode row's padded queries see key 0 and its query every key: nothing to skip then
        skips = any(b.key_stop - b.key_start < k.shape[2] for b in blocks)
        assert skips == all(new > 1 for _, new in rows)
    for got in (attention(q, k, v, 0.125, mask), attention(q, k, v, 0.125, mask, blocks)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-6)


def test_attention_on_two_streams_equals_one(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "SCORE_BLOCK_ELEMENTS", 700)
    layout = layout_for([(37, 24), (0, 9)])
    mask = layout.mask(None, None)
    q, k, v = qkv(2, layout.num_new, mask.shape[-1])
    streams = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    np.testing.assert_array_equal(attention(q, k, v, 0.125, mask, streams=streams), attention(q, k, v, 0.125, mask))


@pytest.mark.parametrize("bias", [False, True])
def test_split_linear_equals_linear(bias):
    linear = nn.Linear(48, 80, bias=bias)
    split = SplitLinear(linear, mx.new_stream(mx.cpu))
    for shape in [(1, 1, 48), (2, 70, 48), (3, 33, 48)]:  # a decode row; calls split in halves
        x = mx.random.normal(shape)
        np.testing.assert_allclose(split(x), linear(x), rtol=1e-5, atol=1e-5)


def test_attention_with_additive_and_no_mask():
    q, k, v = qkv(2, 12, 30, q_heads=4, kv_heads=4)
    additive = mx.where(mx.random.uniform(shape=(2, 1, 12, 30)) < 0.7, 0.0, -1e9)
    np.testing.assert_allclose(attention(q, k, v, 0.125, additive), stock_attention(q, k, v, additive), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(attention(q, k, v, 0.125, None), stock_attention(q, k, v, None), rtol=1e-5, atol=2e-6)


def test_query_blocks_cover_every_visible_key():
    layout = layout_for([(37, 24), (0, 9), (10, 20)])
    mask = layout.mask(None, None)
    visible = np.array(mask)[:, 0]  # (B, T, L)
    blocks = query_blocks(layout.num_new, 6, visible.shape[-1], layout.key_ranges(mask))
    assert [b.start for b in blocks] == [0] + [b.stop for b in blocks[:-1]] and blocks[-1].stop == layout.num_new
    for b in blocks:
        seen = np.flatnonzero(visible[:, b.start : b.stop].any(axis=(0, 1)))
        assert b.key_start <= seen.min() and seen.max() < b.key_stop
        assert b.start + 1 == b.stop or (b.stop - b.start) * 6 * (b.key_stop - b.key_start) <= cpu_kernels.SCORE_BLOCK_ELEMENTS


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims, width, base, scale", [(16, 16, 10000.0, 1.0), (8, 16, 500000.0, 0.25)])
def test_shared_rope_is_bit_identical_to_mlx(traditional, dims, width, base, scale):
    stock = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    ours = SharedRoPE(stock)
    x = mx.random.normal((3, 4, 7, width))
    for offset in (0, 41, mx.array([5, 900, 17])):
        assert mx.array_equal(ours(x, offset=offset), stock(x, offset=offset)).item()
    offsets = mx.array([1, 2, 3])
    first = ours(x, offset=offsets)
    assert mx.array_equal(ours(x * 2, offset=offsets), stock(x * 2, offset=offsets)).item()  # reused angles
    assert mx.array_equal(first, stock(x, offset=offsets)).item()


def test_active_swaps_the_model_modules_and_restores_them(tiny_model_dir):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    kernels = CPUKernels.for_model(model)
    assert kernels is not None and llama in kernels.modules
    stock_ropes = [layer.self_attn.rope for layer in model.layers]
    stock_projections = [layer.mlp.down_proj for layer in model.layers]
    assert len(kernels.ropes) == len(stock_ropes) and len({id(swap.ours) for swap in kernels.ropes}) == 1
    assert len(kernels.linears) == 7 * len(model.layers)  # q, k, v, o; gate, up, down
    with kernels.active(num_tokens=1):  # decode: the linear layers stay on one stream
        assert all(isinstance(layer.self_attn.rope, SharedRoPE) for layer in model.layers)
        assert all(layer.mlp.down_proj is stock for layer, stock in zip(model.layers, stock_projections))
    with pytest.raises(RuntimeError):
        with kernels.active(num_tokens=cpu_kernels.PARALLEL_MIN_ROWS):
            assert llama.swiglu is cpu_kernels.swiglu
            assert llama.scaled_dot_product_attention is not base.scaled_dot_product_attention
            assert all(isinstance(layer.mlp.down_proj, SplitLinear) for layer in model.layers)
            raise RuntimeError("a failed forward")
    assert llama.swiglu is activations.swiglu
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert all(layer.self_attn.rope is stock for layer, stock in zip(model.layers, stock_ropes))
    assert all(layer.mlp.down_proj is stock for layer, stock in zip(model.layers, stock_projections))


def test_engines_on_one_thread_share_its_second_stream(tiny_model_dir):
    import threading

    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    first, second = CPUKernels.for_model(model), CPUKernels.for_model(model)
    assert first.second == second.second  # MLX never stops a stream's thread: one per thread
    other = []
    thread = threading.Thread(target=lambda: other.append(CPUKernels.for_model(model).second))
    thread.start()
    thread.join()
    assert other[0] != first.second


def test_turned_off_by_the_environment(tiny_model_dir, monkeypatch):
    import mlx_lm

    monkeypatch.setenv("VLLM_MLX_CPU_KERNELS", "0")
    assert CPUKernels.for_model(mlx_lm.load(str(tiny_model_dir))[0]) is None


PROMPTS = ["A much longer prompt " * 9, "Hello there", "One two three four five six seven eight nine ten eleven"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_engine_with_kernels_equals_without(arch, tiny_model_dir, default_model_dir, tmp_path, monkeypatch):
    path = tiny_model_dir if arch == "llama" else build_tiny_llama(tmp_path / arch, default_model_dir, **TINY_GEMMA3)
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("VLLM_MLX_CPU_KERNELS", setting)
        engine = EngineCore(model=str(path), max_num_batched_tokens=32, enable_prefix_caching=False)
        try:
            assert (engine.runner.kernels is not None) == (setting == "1")
            results[setting] = engine_tokens(engine, PROMPTS, GREEDY)
        finally:
            engine.shutdown()
    assert results["1"] == results["0"]
    assert math.prod(len(t) for t in results["1"]) > 0

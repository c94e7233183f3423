"""Muse Spark's fused Metal kernels on a backend without Metal: each twin in MLX operations
(``vllm_mlx.models.portable_kernels``) against the kernel's semantics written out in numpy
(float32, with bfloat16 rounding done on the bits), and the rebinding that routes a model's calls
to them. The engine against mlx-lm on a whole Muse Spark model is the breadth sweep's
(tests/models/test_architecture_sweep.py::...[muse_spark])."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from vllm_mlx.models import portable_kernels as pk

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="on Metal the kernels themselves run")

DTYPES = [mx.float32, mx.bfloat16]
# One step of the output dtype's rounding: float32 sums in another order may round across it.
ULP = {mx.float32: 2e-6, mx.bfloat16: 2**-7}


def bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to the nearest bfloat16 (ties to even), as float32: the top 16 bits kept."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def rounder(dtype):
    """The numpy rounding a kernel's ``static_cast<T>`` does for ``dtype``."""
    return bf16 if dtype == mx.bfloat16 else (lambda a: np.asarray(a, np.float32))


def random(rng, shape, dtype=mx.float32, scale=1.0) -> tuple[mx.array, np.ndarray]:
    """Random normal values representable in ``dtype``: the MLX array and the same values in numpy."""
    values = rounder(dtype)(rng.standard_normal(shape).astype(np.float32) * scale)
    return mx.array(values).astype(dtype), values


def rms_inverse(v: np.ndarray, eps: float) -> np.ndarray:
    return (1.0 / np.sqrt((v * v).sum(-1, keepdims=True) / v.shape[-1] + np.float32(eps))).astype(np.float32)


def close(actual: mx.array, expected: np.ndarray, dtype) -> None:
    """Within one rounding step of ``dtype``; in bfloat16 also equal but for a rare value (a float32 sum
    in another order may round across a bfloat16 step; a missed or extra rounding shows everywhere)."""
    assert actual.dtype == dtype
    values = np.array(actual.astype(mx.float32))
    np.testing.assert_allclose(values, expected, rtol=ULP[dtype], atol=1e-6)
    if dtype == mx.bfloat16:
        assert np.mean(values != expected) <= 0.01


def test_the_test_rounding_is_bfloat16s():
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    np.testing.assert_array_equal(bf16(values), np.array(mx.array(values).astype(mx.bfloat16).astype(mx.float32)))


def routing_reference(logits, bias, top_k, multiplier, eps, scale):
    """Per token: sigmoid scores, the top-k of score + bias picked one by one (lower expert on a
    tie), their unbiased scores over their sum plus eps, times scale."""
    inds, weights = [], []
    for row in logits.reshape(-1, logits.shape[-1]):
        score = 1.0 / (1.0 + np.exp(-(row * np.float32(multiplier)).astype(np.float64)))
        order = sorted(range(len(row)), key=lambda e: (-(score[e] + bias[e]), e))[:top_k]
        inds.append(order)
        weights.append(score[order] / (score[order].sum() + eps) * scale)
    shape = logits.shape[:-1] + (top_k,)
    return np.array(inds).reshape(shape), np.array(weights).reshape(shape)


def test_expert_routing_picks_the_top_biased_scores_and_weights_them():
    rng = np.random.default_rng(1)
    logits, logits_np = random(rng, (2, 5, 48), scale=3.0)
    bias, bias_np = random(rng, (48,), scale=0.1)
    kwargs = {"top_k": 4, "multiplier": 0.7, "score_eps": 1e-3, "route_scale": 2.5}
    inds, weights = pk.expert_routing(logits, bias, **kwargs)
    want_inds, want_weights = routing_reference(logits_np, bias_np, *kwargs.values())
    assert inds.dtype == mx.uint32 and weights.dtype == mx.float32
    np.testing.assert_array_equal(np.array(inds), want_inds)
    np.testing.assert_allclose(np.array(weights), want_weights, rtol=1e-6)


def test_expert_routing_picks_the_lower_expert_on_a_tie():
    logits = mx.zeros((3, 8))  # every score 0.5
    bias = mx.array([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    inds, weights = pk.expert_routing(logits, bias, top_k=5, multiplier=1.0, score_eps=0.0, route_scale=1.0)
    assert np.array(inds).tolist() == [[1, 3, 6, 0, 2]] * 3
    np.testing.assert_allclose(np.array(weights), 0.2, rtol=1e-6)


def norm_add_reference(branch, stream, alpha, beta, post_weight, eps, dtype):
    """The branch (scaled by the post weight, in T) RMS-normed and rounded to T, added to the
    stream with the gate weights, in float32."""
    r = rounder(dtype)
    v = branch if post_weight is None else r(r(post_weight) * branch)
    return alpha * stream + beta * r(v * rms_inverse(v, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaled", [False, True])
def test_norm_add_norm_adds_the_normed_branch_and_pre_norms_the_sum(dtype, scaled):
    rng = np.random.default_rng(2)
    branch, branch_np = random(rng, (2, 3, 64), dtype, scale=4.0)
    stream, stream_np = random(rng, (2, 3, 64), scale=2.0)
    (alpha, alpha_np), (beta, beta_np) = (random(rng, (64,)) for _ in range(2))
    post, post_np = random(rng, (64,)) if scaled else (None, None)
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight, weight_np = random(rng, (64,), dtype)
    new_stream, normed = pk.norm_add_norm(
        branch, stream, alpha=alpha, beta=beta, post_weight=post, post_eps=1e-6, next_norm=norm
    )
    want = norm_add_reference(branch_np, stream_np, alpha_np, beta_np, post_np, 1e-6, dtype)
    close(new_stream, want, mx.float32)
    close(normed, rounder(dtype)(want * rms_inverse(want, 1e-5) * weight_np), dtype)
    alone, none = pk.norm_add_norm(branch, stream, alpha=alpha, beta=beta, post_weight=post, post_eps=1e-6,
                                   next_norm=None)  # fmt: skip
    assert none is None
    close(alone, want, mx.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pre_norm_is_the_rms_norm_of_the_stream_rounded_once(dtype):
    rng = np.random.default_rng(3)
    stream, stream_np = random(rng, (2, 3, 64), scale=3.0)
    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight, weight_np = random(rng, (64,), dtype)
    want = rounder(dtype)(stream_np * rms_inverse(stream_np, 1e-5) * weight_np)
    close(pk.pre_norm(stream, norm, dtype=dtype), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_post_expert_norm_combine_norms_each_expert_and_adds_them_in_order(dtype):
    rng = np.random.default_rng(4)
    experts, experts_np = random(rng, (2, 3, 4, 32), dtype, scale=5.0)
    weights, weights_np = random(rng, (2, 3, 4))
    norm_weight, norm_weight_np = random(rng, (32,), dtype)
    r = rounder(dtype)
    v = experts_np * norm_weight_np  # the weight scales in float32, unrounded
    normed = v * rms_inverse(v, 1e-5)
    acc = np.zeros((2, 3, 32), np.float32)
    for k in range(4):
        acc = r(acc + normed[..., k, :] * r(weights_np[..., k : k + 1]))
    close(pk.post_expert_norm_combine(experts, weights, norm_weight=norm_weight, eps=1e-5), acc, dtype)


def qk_reference(qkvg, n_heads, n_kv_heads, head_dim, eps, scale, dtype):
    """Each q and k head of the qkvg rows RMS-normed and rounded; q then scaled and rounded."""
    r = rounder(dtype)
    heads = qkvg[..., : (n_heads + n_kv_heads) * head_dim].reshape(*qkvg.shape[:-1], -1, head_dim)
    y = r(heads * rms_inverse(heads, eps))
    return r(y[..., :n_heads, :] * np.float32(scale)), y[..., n_heads:, :]


QK = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "eps": 1e-5, "query_scale": 5.4730064863875}


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_norms_the_q_and_k_heads_and_scales_q(dtype):
    rng = np.random.default_rng(5)
    qkvg, qkvg_np = random(rng, (2, 5, 2 * 6 * 16), dtype, scale=3.0)
    q, k = pk.qk_norm(qkvg, **QK)
    want_q, want_k = qk_reference(qkvg_np, *QK.values(), dtype)
    close(q, want_q, dtype)
    close(k, want_k, dtype)


def rope_reference(y, positions, base, dtype):
    """Neighbour pairs (2i, 2i + 1) of each head rotated by position * base ** (-i / (D / 2))
    (the base's log2 in float32), rounded."""
    half = y.shape[-1] // 2
    inv_freq = 2.0 ** (-(np.arange(half) / half) * float(np.float32(math.log2(base))))
    theta = positions[..., None, None] * inv_freq  # (..., L, 1, half)
    cos, sin = np.cos(theta), np.sin(theta)
    even, odd = y[..., 0::2], y[..., 1::2]
    out = np.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(y.shape)
    return rounder(dtype)(out.astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [7, "per row"])
def test_qk_norm_rope_rotates_the_normed_heads_at_their_positions(dtype, offset):
    rng = np.random.default_rng(6)
    qkvg, qkvg_np = random(rng, (2, 5, 2 * 6 * 16), dtype, scale=3.0)
    offsets = np.array([3, 11]) if offset == "per row" else np.array([offset, offset])
    arg = mx.array(offsets) if offset == "per row" else offset
    q, k = pk.qk_norm_rope(qkvg, **QK, rope_base=500000.0, offset=arg)
    positions = offsets[:, None] + np.arange(5)[None, :]
    want_q, want_k = qk_reference(qkvg_np, *QK.values(), dtype)
    # One rounding step (of q or k before rotating, or after) is 1 ulp of each rotated term.
    close(q, rope_reference(want_q, positions, 500000.0, dtype), dtype)
    close(k, rope_reference(want_k, positions, 500000.0, dtype), dtype)


def test_qk_norm_rope_rotates_as_mlx_fast_rope_traditional():
    qkvg = mx.random.normal((1, 6, 2 * 6 * 16), key=mx.random.key(7))
    q, k = pk.qk_norm_rope(qkvg, **QK, rope_base=10000.0, offset=9)
    normed = pk.qk_norm(qkvg, **QK)
    for rotated, heads in zip((q, k), normed):
        rope = mx.fast.rope(heads.transpose(0, 2, 1, 3), 16, traditional=True, base=10000.0, scale=1.0, offset=9)
        np.testing.assert_allclose(np.array(rotated), np.array(rope.transpose(0, 2, 1, 3)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_sigmoid_gate_norms_each_head_and_gates_it(dtype):
    rng = np.random.default_rng(8)
    x, x_np = random(rng, (2, 4, 5, 16), dtype, scale=2.0)
    gate, gate_np = random(rng, (2, 5, 64), dtype, scale=2.0)
    v = x_np.transpose(0, 2, 1, 3)
    sig = 1.0 / (1.0 + np.exp(-gate_np.reshape(2, 5, 4, 16)))
    want = rounder(dtype)(v * rms_inverse(v, 1e-5) * sig).reshape(2, 5, 64)
    close(pk.rms_norm_sigmoid_gate(x, gate, eps=1e-5), want, dtype)


KERNELS = ("expert_routing", "norm_add_norm", "post_expert_norm_combine", "pre_norm", "qk_norm", "qk_norm_rope",
           "rms_norm_sigmoid_gate")  # fmt: skip
TINY_TEXT = {
    "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
    "vocab_size": 128, "rms_norm_eps": 1e-5, "post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0},
    "layer_rope_theta": [10000.0, 0.0], "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "num_local_experts": 4, "num_experts_per_tok": 2,
    "moe_hidden_size": 32, "moe_intermediate_size": 32,
}  # fmt: skip


def as_imported(monkeypatch, module, package) -> None:
    """``module``'s kernel names bound to ``package``'s Metal kernels, as its import binds them
    (another test in this process may have routed them already); restored after the test."""
    for name in KERNELS:
        monkeypatch.setattr(module, name, getattr(package, name))


def test_make_portable_routes_mlx_lm_muse_sparks_kernel_calls_to_the_twins(monkeypatch):
    muse_spark = pytest.importorskip("mlx_lm.models.muse_spark")
    import mlx_lm.kernels

    from vllm_mlx.models.portable_layers import make_portable

    as_imported(monkeypatch, muse_spark, mlx_lm.kernels)
    model = muse_spark.Model(muse_spark.ModelArgs.from_dict({"model_type": "muse_spark", "text_config": TINY_TEXT}))
    assert make_portable(model) == len(KERNELS)
    assert all(getattr(muse_spark, name) is getattr(pk, name) for name in KERNELS)
    assert all(getattr(mlx_lm.kernels, name) is not getattr(pk, name) for name in KERNELS)  # the package's own
    assert make_portable(model) == 0  # already routed
    logits = model(mx.array([[1, 2, 3, 4]]), cache=model.make_cache())
    assert logits.shape == (1, 4, 128) and bool(mx.all(mx.isfinite(logits)))


def test_a_model_without_the_kernels_is_left_alone():
    assert pk.route_kernels(nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4))) == 0


def test_mlx_vlms_kernels_are_mlx_lms_so_the_same_twins_serve_its_muse_spark(monkeypatch):
    """mlx-vlm's ``kernels`` package holds the same kernels as mlx-lm's, source for source: its Muse
    Spark language model's calls are routed to the same twins (when one differs, this fails)."""
    language = pytest.importorskip("mlx_vlm.models.muse_spark.language")
    import inspect

    import mlx_lm.kernels
    import mlx_vlm.kernels

    for name in KERNELS:
        lm, vlm = getattr(mlx_lm.kernels, name), getattr(mlx_vlm.kernels, name)
        assert inspect.getsource(inspect.getmodule(lm)) == inspect.getsource(inspect.getmodule(vlm)), name
    as_imported(monkeypatch, language, mlx_vlm.kernels)
    from mlx_vlm.models.muse_spark import TextConfig

    model = language.LanguageModel(TextConfig(**TINY_TEXT))
    assert pk.route_kernels(model) == len(KERNELS)
    assert all(getattr(language, name) is getattr(pk, name) for name in KERNELS)
    logits = model(mx.array([[1, 2, 3, 4]]), cache=model.make_cache()).logits
    assert logits.shape == (1, 4, 128) and bool(mx.all(mx.isfinite(logits)))

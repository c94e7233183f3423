"""Muse Spark's fused Metal kernels, computed in MLX operations for a backend without Metal.

mlx-lm's ``muse_spark`` model and mlx-vlm's ``muse_spark`` language model call fused kernels
written for Metal (``mx.fast.metal_kernel``), from ``mlx_lm.kernels`` and ``mlx_vlm.kernels``
(the two packages hold the same seven kernels, the same source). MLX's CPU and CUDA back-ends have
no Metal, so the model cannot run there at all. Each function here is the twin of the kernel of
its name: the same values, in float32, rounded to the output dtype where the kernel rounds (its
``static_cast<T>``), in the kernel's order of operations. What differs is only the order of the
float32 sums over a row (a kernel sums by SIMD lanes, MLX by its own reduction).

The models import the kernels by name (``from ..kernels import qk_norm, ...``), so the kernel a
model calls is a global of the model's own module. ``route_kernels`` rebinds those globals to the
twins; ``portable_layers.make_portable`` calls it, and only where MLX has no Metal, so on Metal the
kernels run, untouched. It is the one place that rebinds them.

A row below is the last axis of ``D`` values; ``rms(v) = 1 / sqrt(sum(v * v) / D + eps)``, in
float32, as every kernel computes it (``rsqrt(sum_sq / D + eps)``).
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx

__all__ = [
    "KERNEL_PACKAGES",
    "expert_routing",
    "norm_add_norm",
    "post_expert_norm_combine",
    "pre_norm",
    "qk_norm",
    "qk_norm_rope",
    "rms_norm_sigmoid_gate",
    "route_kernels",
]

F32 = mx.float32

# The packages whose kernels have twins here (each kernel is a function of the package's namespace).
KERNEL_PACKAGES = ("mlx_lm.kernels", "mlx_vlm.kernels")


def _rms_inverse(v: mx.array, eps: float) -> mx.array:
    """``1 / sqrt(sum(v²) / D + eps)`` of each row of the float32 ``v`` (kept as a last axis of 1)."""
    return mx.rsqrt(mx.sum(v * v, axis=-1, keepdims=True) / v.shape[-1] + eps)


def _rounded(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x`` rounded to ``dtype`` and read back as float32: a kernel's ``static_cast<T>`` mid-computation."""
    return x.astype(dtype).astype(F32)


def expert_routing(
    logits: mx.array, expert_bias: mx.array, *, top_k: int, multiplier: float, score_eps: float, route_scale: float
) -> list[mx.array]:
    """The top-k experts of each token and their weights (the kernel ``expert_routing``).

    ``score = sigmoid(logits * multiplier)`` (as ``1 / (1 + exp(|x|))``, taken from one for a
    positive ``x``); the experts are picked one by one by the largest ``score + expert_bias``, the
    lower expert on a tie; their weights are their unbiased scores over the scores' sum (added in
    pick order) plus ``score_eps``, times ``route_scale``. Returns ``inds`` (uint32) and
    ``weights`` (float32), each ``logits.shape[:-1] + (top_k,)``, in pick order."""
    x = logits.astype(F32) * multiplier
    y = 1.0 / (1.0 + mx.exp(mx.abs(x)))
    score = mx.where(x < 0, y, 1.0 - y)
    biased = score + expert_bias.astype(F32)
    experts = mx.arange(logits.shape[-1])
    inds, picked = [], []
    for _ in range(top_k):
        best = mx.argmax(biased, axis=-1, keepdims=True)  # the first of equal maxima: the lower expert
        inds.append(best)
        picked.append(mx.take_along_axis(score, best, axis=-1))
        biased = mx.where(experts == best, -mx.inf, biased)
    total = picked[0]
    for w in picked[1:]:  # the kernel's sum, in pick order
        total = total + w
    weights = mx.concatenate(picked, axis=-1) / (total + score_eps) * route_scale
    return [mx.concatenate(inds, axis=-1).astype(mx.uint32), weights]


def _pre_normed(stream: mx.array, weight: mx.array, eps: float, dtype: mx.Dtype) -> mx.array:
    """``stream * rms(stream) * weight``, in float32, rounded once to ``dtype``."""
    return (stream * _rms_inverse(stream, eps) * weight.astype(F32)).astype(dtype)


def norm_add_norm(
    branch: mx.array,
    stream: mx.array,
    *,
    alpha: mx.array,
    beta: mx.array,
    post_weight: mx.array | None,
    post_eps: float,
    next_norm,
) -> tuple[mx.array, mx.array | None]:
    """The gated residual add of a block (the kernels ``norm_add_norm`` and ``norm_add``).

    With ``T`` the branch's dtype: ``v = branch``, first scaled by ``post_weight`` where given
    (the weight rounded to ``T``, the product rounded to ``T``, as the norm module scales its
    input); ``n = v * rms(v)`` (``post_eps``) rounded to ``T``; the new float32 stream is
    ``alpha * stream + beta * n``. With ``next_norm``, also that stream pre-normed by it
    (``pre_norm``), in ``T``; else None."""
    dtype = branch.dtype
    v = branch.astype(F32)
    if post_weight is not None:
        v = _rounded(_rounded(post_weight, dtype) * v, dtype)
    n = _rounded(v * _rms_inverse(v, post_eps), dtype)
    new_stream = alpha.astype(F32) * stream.astype(F32) + beta.astype(F32) * n
    if next_norm is None:
        return new_stream, None
    return new_stream, _pre_normed(new_stream, next_norm.weight, next_norm.eps, dtype)


def pre_norm(stream: mx.array, norm, *, dtype: mx.Dtype) -> mx.array:
    """The float32 ``stream`` RMS-normed by ``norm`` (its weight and eps), in float32, rounded once
    to ``dtype`` (the kernel ``norm_add_norm_pre_norm``): ``norm_add_norm``'s pre-norm alone."""
    return _pre_normed(stream.astype(F32), norm.weight, norm.eps, dtype)


def post_expert_norm_combine(experts: mx.array, weights: mx.array, *, norm_weight: mx.array, eps: float) -> mx.array:
    """The experts' outputs normed and added with their weights (the kernel of that name).

    ``experts`` is ``(..., K, D)`` in ``T``, ``weights`` ``(..., K)``. Each expert's
    ``v = experts * norm_weight`` (in float32: the weight is not rounded) is normed,
    ``v * rms(v)``, times its weight rounded to ``T``; the K terms are added in expert order into
    an accumulator rounded to ``T`` after each add. Returns ``(..., D)`` in ``T``."""
    dtype = experts.dtype
    v = experts.astype(F32) * norm_weight.astype(F32)
    normed = v * _rms_inverse(v, eps)
    ew = _rounded(weights, dtype)[..., None]
    acc = mx.zeros(experts.shape[:-2] + experts.shape[-1:], dtype=F32)
    for k in range(experts.shape[-2]):
        acc = _rounded(acc + normed[..., k, :] * ew[..., k, :], dtype)
    return acc.astype(dtype)


def _normed_heads(
    qkvg: mx.array, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, query_scale: float
) -> tuple[mx.array, mx.array]:
    """q and k of ``qkvg``, head-normed and q scaled, each value representable in ``qkvg.dtype``
    (returned in float32): ``y = x * rms(x)`` rounded, q ``y * query_scale`` rounded again."""
    dtype = qkvg.dtype
    heads = n_heads + n_kv_heads
    x = qkvg[..., : heads * head_dim].astype(F32).reshape(*qkvg.shape[:-1], heads, head_dim)
    y = _rounded(x * _rms_inverse(x, eps), dtype)
    return _rounded(y[..., :n_heads, :] * query_scale, dtype), y[..., n_heads:, :]


def qk_norm(
    qkvg: mx.array, *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, query_scale: float
) -> list[mx.array]:
    """The q and k heads of the fused ``qkvg`` rows, each RMS-normed (no weight), q then times
    ``query_scale`` (the kernel ``qk_norm``). ``qkvg`` is ``(..., 2 * (n_heads + n_kv_heads) *
    head_dim)``, q's heads then k's first. Returns q ``(..., n_heads, head_dim)`` and k
    ``(..., n_kv_heads, head_dim)`` in ``qkvg``'s dtype."""
    q, k = _normed_heads(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    return [q.astype(qkvg.dtype), k.astype(qkvg.dtype)]


def _positions(offset: int | mx.array, tokens: tuple[int, ...]) -> mx.array:
    """Each token's position, float32, shaped ``tokens + (1, 1)``: its index in its row (the last
    token axis) plus the offset (one for all rows, or one per row)."""
    offsets = offset.reshape(-1).astype(mx.int32) if isinstance(offset, mx.array) else mx.array([offset], mx.int32)
    length = tokens[-1]
    rows = tokens[:-1] if offsets.size > 1 else (1,) * (len(tokens) - 1)
    positions = mx.arange(length, dtype=mx.int32)[None, :] + offsets[:, None]
    return positions.reshape(*rows, length, 1, 1).astype(F32)


def _rotated(y: mx.array, positions: mx.array, rope_base: float) -> mx.array:
    """``y`` (float32, ``(..., heads, D)``) rotated as the kernel rotates: neighbour pairs
    ``(2i, 2i + 1)`` by ``position * 2 ** (-(i / (D / 2)) * log2(base))``, with the base's log2
    rounded to float32 (as ``mx.fast.rope(traditional=True)`` does)."""
    half = y.shape[-1] // 2
    log2_base = mx.array(math.log2(rope_base), dtype=F32)
    inv_freq = mx.power(mx.array(2.0, F32), -(mx.arange(half, dtype=F32) / half) * log2_base)
    theta = positions * inv_freq
    cos, sin = mx.cos(theta), mx.sin(theta)
    even, odd = y[..., 0::2], y[..., 1::2]
    return mx.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(y.shape)


def qk_norm_rope(
    qkvg: mx.array,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: float,
    query_scale: float,
    rope_base: float,
    offset: int | mx.array,
) -> list[mx.array]:
    """``qk_norm``, then q and k (as rounded) rotated at positions ``offset, offset + 1, ...`` along
    the last token axis, rounded again (the kernel ``qk_norm_rope``). ``offset`` is an int or an
    array of one offset per batch row."""
    q, k = _normed_heads(qkvg, n_heads, n_kv_heads, head_dim, eps, query_scale)
    positions = _positions(offset, qkvg.shape[:-1])
    return [_rotated(t, positions, rope_base).astype(qkvg.dtype) for t in (q, k)]


def rms_norm_sigmoid_gate(x: mx.array, gate: mx.array, *, eps: float) -> mx.array:
    """The attention output gated (the kernel ``rms_norm_sigmoid_gate``): each head's row of ``x``
    ``(B, H, L, D)`` times ``rms`` of it times ``1 / (1 + exp(-gate))``, in float32, rounded once to
    ``x``'s dtype. ``gate`` is ``(B, L, H * D)``; so is the result."""
    B, H, L, D = x.shape
    v = x.transpose(0, 2, 1, 3).astype(F32)
    sig = 1.0 / (1.0 + mx.exp(-gate.astype(F32).reshape(B, L, H, D)))
    return (v * _rms_inverse(v, eps) * sig).reshape(B, L, H * D).astype(x.dtype)


_TWINS = {
    "expert_routing": expert_routing,
    "norm_add_norm": norm_add_norm,
    "post_expert_norm_combine": post_expert_norm_combine,
    "pre_norm": pre_norm,
    "qk_norm": qk_norm,
    "qk_norm_rope": qk_norm_rope,
    "rms_norm_sigmoid_gate": rms_norm_sigmoid_gate,
}


def _kernels_to_twins() -> dict[int, tuple[object, object]]:
    """``id(kernel) -> (kernel, twin)`` for the kernel packages already imported (a model that calls
    them imported them; importing one here would only build its kernels for nothing)."""
    pairs = {}
    for package in filter(None, map(sys.modules.get, KERNEL_PACKAGES)):
        for kernel_name, twin in _TWINS.items():
            kernel = getattr(package, kernel_name, None)
            if callable(kernel):
                pairs[id(kernel)] = (kernel, twin)
    return pairs


def route_kernels(model) -> int:
    """Rebind, in each module that defines one of ``model``'s layers, every global that is one of
    the kernels above to its twin; the number of names rebound (0 where none is left). Call it only
    where MLX has no Metal: the rebinding is for the whole process, for every model of that module."""
    pairs = _kernels_to_twins()
    if not pairs:
        return 0
    modules = {sys.modules.get(type(layer).__module__) for _, layer in model.named_modules()}
    rebound = 0
    for module in modules - {None}:
        for name, value in list(vars(module).items()):
            pair = pairs.get(id(value))
            if pair is not None and pair[0] is value:  # the id alone could be a reused one
                setattr(module, name, pair[1])
                rebound += 1
    return rebound

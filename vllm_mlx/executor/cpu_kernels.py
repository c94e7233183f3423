"""Faster kernels for MLX's CPU backend, swapped into mlx-lm models during our engine's forwards:
exp-based attention and SwiGLU, rotary angles once per forward, and both cores for large calls.

MLX's CPU backend evaluates ``exp``, ``sigmoid`` and ``tanh`` one element at a time: ~60-85 M
elements/s on a 2-core x86_64 VM, 25x slower than a multiply. In a 512-token prefill chunk of the
default model that is half of every layer (measured op by op: SiLU of the MLP 15 ms and the
softmax inside attention ~30 ms, against 43 ms for all seven projections). Two facts make it
cheap to fix without touching model code:

* ``exp`` can be built from MLX operations that do vectorise: ``2**z = 2**n * 2**f`` with ``n``
  the nearest integer (an add-and-subtract of 1.5 * 2**23 rounds, exactly, in float32), ``2**f``
  a degree-6 polynomial on [-0.5, 0.5], and ``2**n`` the float whose exponent bits are ``n + 127``.
  ``mx.compile`` fuses the arithmetic into generated C++ loops: 6-8x faster than ``mx.exp`` on a
  cache-resident array, relative error < 3e-7 (float32 epsilon is 1.2e-7).
* Intermediates must stay in cache: a 512 x 1024 attention's scores are 19 MB per layer, and every
  elementwise pass over them then runs at memory speed. Attention here is computed in blocks of
  queries whose scores fit in ~256 KB (a core's L2; larger blocks measured slower).

mlx-lm's model files call ``scaled_dot_product_attention`` and ``swiglu`` through their own module
globals (``from .base import ...``). ``CPUKernels.for_model`` finds the modules of a model that
use mlx-lm's originals, and ``active()`` swaps ours in for the duration of one forward call on the
engine thread, then puts the originals back, so ``mlx_lm.generate`` in the same process runs
stock (the oracle tests compare against it). Another thread running the same architecture's
module *during* our forward would get our kernels too: the same math to ~1e-6.

Rotary embeddings (``nn.RoPE``) compute their sines and cosines on every call on the CPU; while
``active()``, the layers share a ``SharedRoPE`` that computes them once per forward call.

MLX computes each CPU stream on one thread (and MKL's sequential layer computes on the calling
thread), so one stream uses one core. A call of ``PARALLEL_MIN_ROWS`` tokens or more (prefill
chunks) computes half of each linear layer (``SplitLinear``) and every other attention block on
a second CPU stream.

Only on the CPU backend (Metal and CUDA have fast transcendental kernels), and only where ours
measured faster: attention with at least ``MIN_SCORES`` scores (a lone short decode row keeps
the stock kernel; a batch of decode rows is 1.6x faster with ours), no attention sinks, masks
that are boolean or additive arrays.
``VLLM_MLX_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

LOG2E = 1.4426950408889634
# Taylor coefficients of 2**f = exp(f ln 2): (ln 2)**k / k!, k = 0..6; on |f| <= 0.5 the
# truncation error (~2e-8) is below float32's rounding.
_EXP2_COEFFS = tuple(math.log(2) ** k / math.factorial(k) for k in range(7))
_ROUND = 12582912.0  # 1.5 * 2**23: (z + _ROUND) - _ROUND is z rounded to the nearest integer
# Attention in query blocks whose scores (heads x queries x keys, float32) stay in cache.
SCORE_BLOCK_ELEMENTS = 1 << 16
PARALLEL_MIN_ROWS = 64  # a call with fewer tokens runs on one stream (decode reads weights: no gain)
MIN_SCORES = 4096  # attention with fewer scores (one short decode row): the stock kernel is faster


def enabled() -> bool:
    """Whether our kernels replace the stock ones: the CPU backend, unless turned off."""
    return os.environ.get("VLLM_MLX_CPU_KERNELS", "1") != "0" and mx.default_device() == mx.cpu


def _exp2(z: mx.array) -> mx.array:
    # 2**-126 is the smallest normal float (below it: ~0 here, not denormals); above 2**127.49
    # the result saturates (~2.4e38) instead of reaching inf.
    z = mx.clip(z, -126.0, 127.49)
    n = (z + _ROUND) - _ROUND
    f = z - n
    # Estrin's scheme: a shallow expression fuses into fewer generated loops than Horner's
    # (MLX's compiler splits deep chains), 1.4x faster at the same error.
    c = _EXP2_COEFFS
    f2 = f * f
    poly = (c[0] + c[1] * f + f2 * (c[2] + c[3] * f)) + (f2 * f2) * (c[4] + c[5] * f + f2 * c[6])
    scale = mx.view(mx.left_shift(n.astype(mx.int32) + 127, 23), mx.float32)  # 2**n, exactly
    return poly * scale


@mx.compile
def _exp_f32(x: mx.array) -> mx.array:
    return _exp2(x * LOG2E)


def exp(x: mx.array) -> mx.array:
    """``mx.exp`` to within 3e-7 relative error, computed in float32 (returned in ``x.dtype``)."""
    return _exp_f32(x.astype(mx.float32)).astype(x.dtype)


@mx.compile
def _swiglu_f32(gate: mx.array, x: mx.array) -> mx.array:
    return gate * x / (1.0 + _exp2(gate * -LOG2E))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, as mlx-lm's ``activations.swiglu``."""
    return _swiglu_f32(gate.astype(mx.float32), x.astype(mx.float32)).astype(x.dtype)


@mx.compile
def _softmax_numerators(scores: mx.array, mask: mx.array, scale: mx.array) -> mx.array:
    """exp(scale * (s - max s)) over visible keys (a boolean mask, broadcast), 0 elsewhere."""
    scores = mx.where(mask, scores, -mx.inf)
    top = mx.max(scores, axis=-1, keepdims=True)
    return _exp2((scores - top) * (scale * LOG2E))


@mx.compile
def _softmax_numerators_additive(scores: mx.array, bias: mx.array, scale: mx.array) -> mx.array:
    """As ``_softmax_numerators`` with an additive mask (added after scaling, as MLX does)."""
    scores = scores * scale + bias
    top = mx.max(scores, axis=-1, keepdims=True)
    return _exp2((scores - top) * LOG2E)


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``start:stop`` and the keys ``key_start:key_stop`` that any of them can see."""

    start: int
    stop: int
    key_start: int
    key_stop: int


def query_blocks(num_queries: int, q_heads: int, num_keys: int, ranges=None) -> list[QueryBlock]:
    """Split the queries into blocks whose scores (``q_heads x rows x keys``) stay within
    ``SCORE_BLOCK_ELEMENTS``; with ``ranges`` (``attention.KeyRanges``: the keys each query
    index sees at all), a block spans only its queries' keys (the causal triangle of a prefill
    chunk and keys out of a sliding window are never computed)."""
    if ranges is None:
        rows = max(1, min(num_queries, SCORE_BLOCK_ELEMENTS // (q_heads * num_keys)))
        return [QueryBlock(s, min(s + rows, num_queries), 0, num_keys) for s in range(0, num_queries, rows)]
    blocks, start = [], 0
    first, stop = ranges.first.tolist(), ranges.stop.tolist()
    while start < num_queries:
        lo, hi, end = first[start], stop[start], start + 1
        while end < num_queries:
            new_lo, new_hi = min(lo, first[end]), max(hi, stop[end])
            if (end + 1 - start) * q_heads * (new_hi - new_lo) > SCORE_BLOCK_ELEMENTS:
                break
            lo, hi, end = new_lo, new_hi, end + 1
        blocks.append(QueryBlock(start, end, lo, hi))
        start = end
    return blocks


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | None,
    blocks: list[QueryBlock] | None = None, streams: tuple = (),
) -> mx.array:  # fmt: skip
    """Softmax attention as ``mx.fast.scaled_dot_product_attention`` computes it, in float32.

    ``queries`` ``[B, Hq, T, D]``; ``keys`` ``[B, Hkv, L, D]``; ``values`` ``[B, Hkv, L, Dv]``
    (``Hq`` a multiple of ``Hkv``: grouped queries share their key head in one matmul; latent
    attention's values are narrower than its keys); ``mask`` broadcastable to
    ``[B, Hq, T, L]``, boolean (True: visible) or additive, or None. Queries are taken in
    ``blocks`` (default: ``query_blocks`` without key ranges) so that each block's scores stay
    in cache; the softmax is normalised after the value matmul (``T x D`` divisions, not
    ``T x L``). With ``streams``, blocks take turns on them (each CPU stream is a thread).
    """
    _, q_heads, num_queries, _ = queries.shape
    dtype = queries.dtype
    queries, keys, values = (a.astype(mx.float32) for a in (queries, keys, values))
    scale_array = mx.array(scale, dtype=mx.float32)
    if mask is not None:
        mask = mask if mask.ndim == 4 else mx.broadcast_to(mask, (1,) * (4 - mask.ndim) + mask.shape)
        mask = mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)
    outputs = []
    for i, block in enumerate(blocks or query_blocks(num_queries, q_heads, keys.shape[2])):
        with mx.stream(streams[i % len(streams)]) if streams else nullcontext():
            outputs.append(_attend(queries, keys, values, mask, block, scale_array))
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)
    return out.astype(dtype)


def _attend(queries, keys, values, mask, block: QueryBlock, scale: mx.array) -> mx.array:
    """One block of queries' attention output (float32 inputs; ``mask`` 4-d or None)."""
    batch, q_heads, _, head_dim = queries.shape
    kv_heads = keys.shape[1]
    group, rows = q_heads // kv_heads, block.stop - block.start
    span = slice(block.key_start, block.key_stop)
    q = queries[:, :, block.start : block.stop].reshape(batch, kv_heads, group * rows, head_dim)
    scores = (q @ keys[:, :, span].swapaxes(-1, -2)).reshape(batch, kv_heads, group, rows, -1)
    if mask is None:
        probs = _softmax_numerators(scores, mx.array(True), scale)
    else:
        queries_of_mask = slice(block.start, block.stop) if mask.shape[2] > 1 else slice(None)
        block_mask = _group_heads(mask[:, :, queries_of_mask, span], kv_heads)
        kernel = _softmax_numerators if mask.dtype == mx.bool_ else _softmax_numerators_additive
        probs = kernel(scores, block_mask, scale)
    totals = probs.sum(axis=-1, keepdims=True)
    weighted = probs.reshape(batch, kv_heads, group * rows, -1) @ values[:, :, span]
    value_dim = values.shape[-1]  # latent attention (MLA) reads values narrower than its keys
    return (weighted.reshape(batch, kv_heads, group, rows, value_dim) / totals).reshape(batch, q_heads, rows, value_dim)


class SharedRoPE(nn.Module):
    """``nn.RoPE`` with its sines and cosines computed once per forward call, not per layer.

    MLX's CPU backend computes rotary embeddings by composing operations, cosines and sines
    included, on every call: ~64 us for one decode token's queries, 60 calls a step in a
    30-layer model. Every layer of a forward call rotates by the same positions (our caches
    hand each layer the same ``offset`` array), so the angles are computed for the first layer
    and reused. The operations are MLX's own, in its order: results are bit-identical to
    ``mx.fast.rope`` on the CPU.
    """

    def __init__(self, rope: nn.RoPE) -> None:
        super().__init__()
        self.dims, self.traditional, self.base, self.scale = rope.dims, rope.traditional, rope.base, rope.scale
        self._angles_key = None
        self._angles = None

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if x.ndim != 4 or not isinstance(offset, (int, mx.array)):
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        cos, sin = self._cos_sin(offset, x.shape[2], x.dtype)
        half = self.dims // 2
        if self.traditional:
            x1, x2 = x[..., 0 : self.dims : 2], x[..., 1 : self.dims : 2]
            pairs = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
            rotated = [pairs.reshape(*x.shape[:-1], self.dims)]
        else:
            x1, x2 = x[..., :half], x[..., half : self.dims]
            rotated = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
        if self.dims < x.shape[-1]:
            rotated.append(x[..., self.dims :])
        return mx.concatenate(rotated, axis=-1)

    def _cos_sin(self, offset, num_tokens: int, dtype) -> tuple[mx.array, mx.array]:
        """``(B or 1, 1, T, dims/2)`` cosines and sines, kept while the offset and length last
        (identity of the offset array: one forward call)."""
        key = (offset if isinstance(offset, int) else id(offset), num_tokens, dtype)
        if self._angles_key != key or (not isinstance(offset, int) and self._angles[0] is not offset):
            half = self.dims // 2
            start = mx.array(offset, dtype=mx.int32)
            if start.size > 1:
                start = start[:, None, None]
            positions = (mx.arange(num_tokens, dtype=mx.float32) + start) * mx.array(self.scale, dtype=mx.float32)
            step = np.float32(np.log(np.float32(self.base))) / np.float32(half)  # float math, as MLX
            inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, dtype=mx.float32))
            theta = positions[..., None] * inv_freqs
            self._angles = (offset, mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype))
            self._angles_key = key
        return self._angles[1], self._angles[2]

    def forget(self) -> None:
        self._angles_key = self._angles = None


def _group_heads(mask: mx.array, kv_heads: int) -> mx.array:
    """A ``[B, H, T, L]`` mask (H is 1 or the query heads) as ``[B, Hkv or 1, group or 1, T, L]``."""
    b, h, t, length = mask.shape
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, kv_heads, h // kv_heads, t, length)


def _uses_our_attention(queries, keys, cache, mask, sinks) -> bool:
    return (
        sinks is None
        and not hasattr(cache, "bits")  # mlx-lm's quantized KV cache has its own kernel
        and (mask is None or isinstance(mask, mx.array))  # not "causal": our caches give arrays
        and queries.shape[0] * queries.shape[1] * queries.shape[2] * keys.shape[2] >= MIN_SCORES
    )


class SplitLinear(nn.Module):
    """``nn.Linear`` whose output features are computed half on the default CPU stream, half on
    a second one: MLX runs each stream on its own thread, so a large call uses both cores
    (measured: a 1024 x 576 x 1536 product at ~99 GFLOP/s on one stream, ~197 on two). Each
    thread reads half the weights (views of the weights' buffer: no copy). A call of fewer than
    ``PARALLEL_MIN_ROWS`` rows stays on one stream: one decode row is bound by the memory
    bandwidth, which a second thread does not raise, and 32 rows measured no gain."""

    def __init__(self, linear: nn.Linear, second: mx.Stream) -> None:
        super().__init__()
        self.linear = linear
        self.second = second
        weight, bias = linear.weight, linear.get("bias")
        half = weight.shape[0] // 2
        self.halves = [(weight[:half], None if bias is None else bias[:half]),
                       (weight[half:], None if bias is None else bias[half:])]  # fmt: skip
        mx.eval(self.halves)  # views of the weights' buffer, made once

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < PARALLEL_MIN_ROWS:
            return self.linear(x)
        (w1, b1), (w2, b2) = self.halves
        first = x @ w1.T if b1 is None else mx.addmm(b1, x, w1.T)
        with mx.stream(self.second):
            rest = x @ w2.T if b2 is None else mx.addmm(b2, x, w2.T)
        return mx.concatenate([first, rest], axis=-1)


@dataclass
class ChildSwap:
    """A child module of the model that ours replaces during a forward call."""

    owner: nn.Module
    name: str
    stock: nn.Module
    ours: nn.Module


@dataclass
class CPUKernels:
    """Our kernels, bound to the model modules that use mlx-lm's originals, and our versions of
    the model's rotary embeddings and linear layers."""

    modules: list[ModuleType] = field(default_factory=list)
    ropes: list[ChildSwap] = field(default_factory=list)
    linears: list[ChildSwap] = field(default_factory=list)
    second: mx.Stream | None = None  # the second CPU stream (both cores for large calls)
    _originals: dict = field(default_factory=dict, repr=False)
    _key_ranges: Callable | None = field(default=None, repr=False)  # mask -> KeyRanges | None
    _streams: tuple = field(default=(), repr=False)  # attention's streams in this forward
    _blocks: dict = field(default_factory=dict, repr=False)  # per forward: (ranges id, heads) -> blocks

    @classmethod
    def for_model(cls, model) -> CPUKernels | None:
        """The kernels for ``model`` (an mlx-lm model), or None: not on the CPU backend,
        turned off, or nothing of the model that we replace. Call it on the engine thread."""
        if not enabled():
            return None
        from mlx_lm.models import activations, base

        originals = {"scaled_dot_product_attention": base.scaled_dot_product_attention, "swiglu": activations.swiglu}
        kernels = cls(second=_second_stream(), _originals=originals)
        submodules = _submodules(model)
        for name in sorted({type(m).__module__ for m in submodules}):
            module = sys.modules.get(name)
            if module is not None and any(getattr(module, k, None) is f for k, f in originals.items()):
                kernels.modules.append(module)
        shared: dict[tuple, SharedRoPE] = {}  # one per configuration: the angles are shared too
        for owner in submodules:
            for name, child in (owner.items() if isinstance(owner, dict) else ()):
                if type(child) is nn.RoPE:
                    config = (child.dims, child.traditional, child.base, child.scale)
                    kernels.ropes.append(ChildSwap(owner, name, child, shared.setdefault(config, SharedRoPE(child))))
                elif type(child) is nn.Linear:
                    kernels.linears.append(ChildSwap(owner, name, child, SplitLinear(child, kernels.second)))
        return kernels if kernels.modules or kernels.ropes or kernels.linears else None

    @contextmanager
    def active(self, key_ranges: Callable | None = None, num_tokens: int = 1):
        """Our kernels in the model's modules, and our rotary embeddings in its layers, while
        the block runs (one thread: the engine's). A call of at least ``PARALLEL_MIN_ROWS``
        tokens (``num_tokens``, padding included) also splits its linear layers and attention
        across both CPU streams. ``key_ranges(mask)``: the ``attention.KeyRanges`` of a mask
        the forward's caches built (None for others), so attention skips keys no query sees."""
        ours = {"scaled_dot_product_attention": self._attention, "swiglu": swiglu}
        parallel = num_tokens >= PARALLEL_MIN_ROWS
        children = self.ropes + (self.linears if parallel else [])
        swapped = []
        self._key_ranges = key_ranges
        self._streams = (mx.default_stream(mx.cpu), self.second) if parallel else ()
        try:
            for module in self.modules:
                for name, original in self._originals.items():
                    if getattr(module, name, None) is original:
                        setattr(module, name, ours[name])
                        swapped.append((module, name, original))
            for child in children:
                setattr(child.owner, child.name, child.ours)
            yield
        finally:
            for module, name, original in swapped:
                setattr(module, name, original)
            for child in children:
                setattr(child.owner, child.name, child.stock)
            for child in self.ropes:
                child.ours.forget()
            self._key_ranges = None
            self._streams = ()
            self._blocks.clear()

    def _attention(self, queries, keys, values, cache, scale, mask, sinks=None):
        """mlx-lm's ``base.scaled_dot_product_attention`` signature; ours where it is faster."""
        if _uses_our_attention(queries, keys, cache, mask, sinks):
            blocks = self._query_blocks(queries, keys, mask)
            return attention(queries, keys, values, scale, mask, blocks, self._streams)
        original = self._originals["scaled_dot_product_attention"]
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def _query_blocks(self, queries, keys, mask) -> list[QueryBlock] | None:
        ranges = self._key_ranges(mask) if self._key_ranges is not None and mask is not None else None
        if ranges is None:
            return None
        key = (id(ranges), queries.shape[1])  # the ranges live until the forward ends
        blocks = self._blocks.get(key)
        if blocks is None:
            blocks = self._blocks[key] = query_blocks(queries.shape[2], queries.shape[1], keys.shape[2], ranges)
        return blocks


_THREAD = threading.local()


def _second_stream() -> mx.Stream:
    """This thread's second CPU stream. One per thread, not per engine: MLX never stops a
    stream's worker thread, and engines made on one thread run there one at a time."""
    stream = getattr(_THREAD, "second_stream", None)
    if stream is None:
        stream = _THREAD.second_stream = mx.new_stream(mx.cpu)
    return stream


def _submodules(model):
    """``model`` and every ``nn.Module`` under it (adapters without ``.modules()``: just it)."""
    modules = getattr(model, "modules", None)
    return [model, *modules()] if callable(modules) else [model]


"""mlx-lm layers that compute with a Metal kernel of their own, made to run on any MLX backend.

mlx-lm's BitNet layer (``bitlinear_layers.BitLinear``) multiplies by its packed ternary weights in a
kernel written for Metal (``mx.fast.metal_kernel``); MLX's CPU and CUDA back-ends have no Metal,
so the model cannot run there at all, in mlx-lm or here. On such a backend ``make_portable`` gives
each of those layers the same product in MLX operations (``PortableBitLinear``); on Metal nothing
changes and the kernel runs.

What the kernel computes (its source in mlx-lm, and transformers' ``pack_weights``): the weight
matrix ``W`` of shape ``[out, in]`` holds values in {-1, 0, 1}, stored plus one in two bits each:
the packed ``uint8`` matrix has ``out / 4`` rows, and bits ``2i, 2i+1`` of packed row ``r`` hold
row ``i * out / 4 + r`` of ``W``. The output is ``x @ W.T``, times ``weight_scale`` (divided by
it where the layer inverts its scales), accumulated in float32.

Muse Spark's fused kernels (mlx-lm's and mlx-vlm's ``kernels`` packages) are functions, not layers:
``make_portable`` also routes a model's calls to them to their twins in MLX operations
(``portable_kernels.route_kernels``, which says how).
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["PortableBitLinear", "make_portable", "unpack_ternary"]

VALUES_PER_BYTE = 4  # two bits a value


def unpack_ternary(packed: mx.array, out_features: int) -> mx.array:
    """``W`` (``[out_features, in]``, values -1, 0, 1, float32) from its packed ``uint8`` rows."""
    rows = out_features // VALUES_PER_BYTE
    parts = [((packed[:rows] >> (2 * i)) & 3).astype(mx.float32) - 1 for i in range(VALUES_PER_BYTE)]
    return mx.concatenate(parts, axis=0)


@functools.cache
def _portable_class():
    from mlx_lm.models.bitlinear_layers import BitLinear

    class PortableBitLinear(BitLinear):
        """mlx-lm's ``BitLinear`` with its Metal kernel's product in MLX operations (module doc)."""

        def execute_matmul_kernel(self, x, packed_weights):
            weights = unpack_ternary(packed_weights, self.out_features)
            scale = self.weight_scale.astype(mx.float32)
            scale = 1 / scale if self.invert_weight_scales else scale
            return ((x.astype(mx.float32) @ weights.T) * scale).astype(x.dtype)

    return PortableBitLinear


def make_portable(model) -> int:
    """Give ``model``'s Metal-kernel layers and kernel functions their portable twins where MLX has
    no Metal; the number of layers changed plus kernel names rebound (0 on Metal, or where the
    model has none)."""
    if mx.metal.is_available():
        return 0
    from vllm_mlx.models.portable_kernels import route_kernels

    return _make_layers_portable(model) + route_kernels(model)


def _make_layers_portable(model) -> int:
    """BitNet's ``BitLinear`` layers of ``model`` made ``PortableBitLinear``; how many."""
    try:
        from mlx_lm.models.bitlinear_layers import BitLinear
    except ImportError:  # an mlx-lm without BitNet
        return 0
    portable = _portable_class()
    changed = 0
    for _, module in model.named_modules():
        if type(module) is BitLinear:
            module.__class__ = portable  # same attributes and parameters: only the product differs
            changed += 1
    return changed


def __getattr__(name: str):
    if name == "PortableBitLinear":  # built on first use: importing mlx-lm's layers costs time
        return _portable_class()
    raise AttributeError(name)

"""BitNet's ternary layer on a backend without Metal: the product of mlx-lm's Metal kernel, in MLX
operations (``vllm_mlx.models.portable_layers``). The engine against mlx-lm on a whole BitNet
model is the breadth sweep's (tests/models/test_architecture_sweep.py::...[bitnet])."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("mlx_lm.models.bitlinear_layers")

from mlx_lm.models.bitlinear_layers import BitLinear

from vllm_mlx.models.portable_layers import PortableBitLinear, make_portable, unpack_ternary

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="on Metal the kernel itself runs")


def pack(ternary: np.ndarray) -> np.ndarray:
    """``ternary`` ([out, in], values -1, 0, 1) packed as the kernel reads it: value plus one, two
    bits each, row ``i * out / 4 + r`` in bits ``2i`` of packed row ``r``."""
    quarter = ternary.shape[0] // 4
    codes = (ternary + 1).astype(np.uint8)
    return sum(codes[i * quarter : (i + 1) * quarter] << (2 * i) for i in range(4)).astype(np.uint8)


class TwoLayers(nn.Module):
    def __init__(self, invert: bool) -> None:
        super().__init__()
        self.layers = [BitLinear(16, 8, bias=False, invert_weight_scales=invert), nn.Linear(8, 8)]


@pytest.mark.parametrize("invert", [False, True])
def test_the_portable_layer_multiplies_by_the_unpacked_weights_and_scale(invert):
    rng = np.random.default_rng(0)
    ternary = rng.integers(-1, 2, (8, 16))
    model = TwoLayers(invert)
    layer = model.layers[0]
    layer.weight = mx.array(pack(ternary))
    layer.weight_scale = mx.array([0.5])
    assert make_portable(model) == 1 and isinstance(layer, PortableBitLinear)
    assert type(model.layers[1]) is nn.Linear  # other layers untouched
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    scale = 2.0 if invert else 0.5
    np.testing.assert_allclose(np.array(layer(mx.array(x))), x @ ternary.T * scale, rtol=1e-5, atol=1e-5)
    assert make_portable(model) == 0  # already portable


def test_unpacking_reads_the_rows_in_the_order_they_were_packed():
    ternary = np.arange(8 * 4).reshape(8, 4) % 3 - 1
    np.testing.assert_array_equal(np.array(unpack_ternary(mx.array(pack(ternary)), 8)), ternary)

"""GGUF tensor types as MLX arrays: affine-quantized where MLX holds the type exactly.

MLX's affine quantization stores ``value = scale * q + bias`` with unsigned ``q`` of 2-8 bits,
one scale and bias per group of 32 (or 64, 128) values along a row. Seven GGML types are exactly
that with groups of 32, so their blocks are re-packed bit for bit and, with float32 scales,
nothing is lost (MLX's values equal gguf-py's bit for bit). float16 scales (Metal's default) hold
the five legacy types' scales and biases exactly but round Q4_K/Q5_K's ``d*sc`` and ``dmin*m``
(relative 2**-11):

==========  ====  ================================================================
type        bits  per group of 32: scale, bias
==========  ====  ================================================================
Q4_0        4     d, -8d
Q4_1        4     d, m
Q5_0        5     d, -16d
Q5_1        5     d, m
Q8_0        8     d, -128d  (q is stored signed; +128 makes it unsigned)
Q4_K        4     d*sc, -dmin*m  (8 sub-blocks of 32 per super-block of 256)
Q5_K        5     d*sc, -dmin*m
==========  ====  ================================================================

Every other type (Q2_K, Q3_K and Q6_K use sub-blocks of 16, which MLX cannot group; the
i-quants, ternary and FP4 types are not affine) is dequantized exactly to float32 by gguf-py's
dequantizers and quantized again to 8 bits in groups of 32 (``REQUANTIZED_BITS``): the one lossy
step, an error of at most one 8-bit step of each group's range (not half: MLX keeps 0 exactly
representable, which can leave the far end of a group that spans 0 up to a step short). Against
the group-16 types' own step that is at most (levels - 1)/255 of it where a group's two
sub-blocks share a scale (63/255 of a Q6_K step, 7/255 of Q3_K's, 3/255 of Q2_K's); where they
differ, the small-scale sub-block gets the large one's 8-bit step: on gemma-3-270m's Q6_K
tensors the error was a median 0.12, 99th percentile 0.25 and at worst 1.5 Q6_K steps. What it
does to the model: gemma-3-270m Q4_K_M with its nine Q6_K tensors re-quantized vs. dequantized
exactly (float32 compute, a 28-token prompt) moved no top-1 token, the logits by at most 0.19
(of a ±29 range), KL 8e-5 nats on average (``bench/gguf_requantization.py``; ``docs/benchmarks.md``).
F32/F16/BF16 stay floating point. ``tests/models/test_gguf_tensors.py`` checks every type against
gguf-py's dequantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_mlx.platform.errors import ModelSourceError

GROUP_SIZE = 32
REQUANTIZED_BITS = 8
PACK_CHUNK_VALUES = 1 << 22
CONVERT_CHUNK_VALUES = 1 << 24  # ~64 MiB of float32 temporaries per chunk
FLOAT_TYPES = ("F32", "F16", "BF16")
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")
REQUANTIZED_TYPES = (
    "Q2_K", "Q3_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)  # fmt: skip
SUPPORTED_TYPES = FLOAT_TYPES + EXACT_TYPES + REQUANTIZED_TYPES


@dataclass
class Affine:
    """Blocks decoded to MLX's affine form: ``q`` (n_blocks, groups, 32) unsigned integers below
    ``2**bits``, ``scale`` and ``bias`` (n_blocks, groups) float32."""

    q: np.ndarray
    scale: np.ndarray
    bias: np.ndarray
    bits: int


def _f16(column: np.ndarray) -> np.ndarray:
    return column.copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, groups: int) -> np.ndarray:
    """Q4 layout: byte ``i`` of a 32-byte chunk holds value ``i`` (low nibble) of one group and
    value ``i`` (high nibble) of the next."""
    n = packed.shape[0]
    halves = packed.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & 0x0F).reshape(n, groups, 32)


def _legacy_nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 layout: low nibbles are values 0-15, high nibbles values 16-31."""
    n = packed.shape[0]
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, 1, 32)


def _high_bits(qh: np.ndarray, groups: int) -> np.ndarray:
    """The fifth bit: Q5_0/Q5_1 one 32-bit word per block (bit i for value i); Q5_K 32 bytes
    per super-block (bit g of byte i for value i of group g)."""
    n = qh.shape[0]
    if groups == 1:
        words = qh.copy().view("<u4").reshape(n, 1, 1)
        return ((words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    bits = qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return bits & 1


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes of 6-bit scales and mins for 8 sub-blocks."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(packed)
    return sc.astype(np.float32), m.astype(np.float32)


def _decode_q4_0(b):
    d = _f16(b[:, :2])
    return Affine(_legacy_nibbles(b[:, 2:]), d, -8 * d, 4)


def _decode_q4_1(b):
    return Affine(_legacy_nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 4)


def _decode_q5_0(b):
    d = _f16(b[:, :2])
    q = _legacy_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 1) << 4)
    return Affine(q, d, -16 * d, 5)


def _decode_q5_1(b):
    q = _legacy_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 1) << 4)
    return Affine(q, _f16(b[:, :2]), _f16(b[:, 2:4]), 5)


def _decode_q8_0(b):
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Affine(q.reshape(-1, 1, 32), d, -128 * d, 8)


def _decode_q4_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    return Affine(_nibbles(b[:, 16:], 8), d * sc, -(dmin * m), 4)


def _decode_q5_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:], 8) | (_high_bits(b[:, 16:48], 8) << 4)
    return Affine(q, d * sc, -(dmin * m), 5)


_DECODERS = {
    "Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q5_0": _decode_q5_0, "Q5_1": _decode_q5_1,
    "Q8_0": _decode_q8_0, "Q4_K": _decode_q4_k, "Q5_K": _decode_q5_k,
}  # fmt: skip


def type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(type_id).name


def decode_affine(raw: np.ndarray, type_id: int) -> Affine:
    """An exact type's blocks (``raw``: the tensor's bytes) in MLX's affine form."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(type_id)
    _, type_size = GGML_QUANT_SIZES[qtype]
    affine = _DECODERS[qtype.name](raw.reshape(-1, type_size))
    n = affine.q.shape[0]
    affine.scale, affine.bias = affine.scale.reshape(n, -1), affine.bias.reshape(n, -1)
    return affine


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``bits``-bit integers along the last axis as MLX does: one little-endian
    bit stream per row, 32 bits a word (8 values fill ``bits`` bytes exactly)."""
    *lead, cols = q.shape
    q = q.astype(np.uint8, copy=False)
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)).view(np.uint32)
    rows = q.reshape(-1, cols)
    out = np.empty((rows.shape[0], cols * bits // 8), dtype=np.uint8)
    shifts = np.arange(8, dtype=np.uint64) * bits
    step = max(1, PACK_CHUNK_VALUES // cols)  # bounds the uint64 temporaries (8x the values)
    for start in range(0, rows.shape[0], step):
        octets = rows[start : start + step].reshape(-1, cols // 8, 8).astype(np.uint64)
        words = np.bitwise_or.reduce(octets << shifts, axis=-1)
        out[start : start + step] = words[..., None].view(np.uint8)[..., :bits].reshape(len(octets), -1)
    return out.view(np.uint32).reshape(*lead, -1)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Any supported type as float32 (gguf-py's dequantizers), in numpy ``shape``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType(type_id)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block_size * type_size)
    try:
        values = gguf_dequantize(rows, qtype)
    except NotImplementedError:  # an older gguf-py knows the type but not its dequantizer
        from importlib.metadata import version

        raise ModelSourceError(
            f"gguf-py {version('gguf')} cannot dequantize {qtype.name} tensors: pip install -U gguf"
        ) from None
    return np.asarray(values, dtype=np.float32).reshape(shape)


def check_supported(name: str, type_id: int) -> str:
    """The type's name; ``ModelSourceError`` naming it and the supported ones otherwise."""
    try:
        kind = type_name(type_id)
    except ValueError:
        kind = f"#{type_id}"
    if kind not in SUPPORTED_TYPES:
        raise ModelSourceError(
            f"tensor {name!r} has GGML type {kind}, which vllm-mlx cannot convert "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    return kind


def convert_tensor(name: str, raw: np.ndarray, type_id: int, shape: tuple[int, ...], scale_dtype: str) -> dict:
    """One GGUF tensor as MLX arrays: ``{"weight": a}`` for float types, ``{"weight", "scales",
    "biases"}`` (MLX's affine triple, groups of 32) otherwise. ``shape`` is in numpy order.

    Quantized tensors are converted ``CONVERT_CHUNK_VALUES`` at a time (whole rows), so the
    temporaries (float32 values, unpacked integers) stay bounded whatever the tensor's size: a
    262k-token embedding is 1e9 values."""
    import mlx.core as mx

    kind = check_supported(name, type_id)
    if kind in FLOAT_TYPES:
        return {"weight": _float_tensor(raw, kind, shape)}
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    cols = shape[-1]
    rows = raw.reshape(-1, cols // block_size * type_size)
    step = max(1, CONVERT_CHUNK_VALUES // cols)
    convert_rows = _exact_rows if kind in EXACT_TYPES else _requantized_rows
    parts = [convert_rows(rows[start : start + step], type_id, cols) for start in range(0, len(rows), step)]
    scales_type = getattr(mx, scale_dtype)
    weight, scales, biases = (mx.concatenate([part[i] for part in parts]) if len(parts) > 1 else parts[0][i]
                              for i in range(3))  # fmt: skip
    lead = shape[:-1]
    return {
        "weight": weight.reshape(*lead, -1),
        "scales": scales.reshape(*lead, -1).astype(scales_type),
        "biases": biases.reshape(*lead, -1).astype(scales_type),
    }


def _exact_rows(rows: np.ndarray, type_id: int, cols: int) -> tuple:
    """Rows of an exact type, re-packed bit for bit: (packed weight, scales, biases), 2-D."""
    import mlx.core as mx

    affine = decode_affine(rows, type_id)
    q = affine.q.reshape(len(rows), cols)
    scales, biases = affine.scale.reshape(len(rows), -1), affine.bias.reshape(len(rows), -1)
    return mx.array(pack(q, affine.bits)), mx.array(scales), mx.array(biases)


def _requantized_rows(rows: np.ndarray, type_id: int, cols: int) -> tuple:
    """Rows of another type: dequantized exactly by gguf-py, then 8-bit affine in groups of 32."""
    import mlx.core as mx

    dense = mx.array(dequantize(rows, type_id, (len(rows), cols)))
    weight, scales, biases = mx.quantize(dense, group_size=GROUP_SIZE, bits=REQUANTIZED_BITS)
    mx.eval(weight, scales, biases)  # free the float32 chunk before the next one
    return weight, scales, biases


def _float_tensor(raw: np.ndarray, kind: str, shape: tuple[int, ...]):
    import mlx.core as mx

    if kind == "F32":
        return mx.array(raw.view(np.float32).reshape(shape))
    if kind == "F16":
        return mx.array(raw.view(np.float16).reshape(shape))
    bits = raw.view(np.uint16).astype(np.uint32) << 16  # bfloat16 is float32's high half
    return mx.array(bits.view(np.float32).reshape(shape)).astype(mx.bfloat16)


def quantized_bits(arrays: dict) -> int:
    """The bit width of a converted tensor (``convert_tensor``'s triple), from its packed
    weight and scales."""
    return arrays["weight"].shape[-1] * 32 // (arrays["scales"].shape[-1] * GROUP_SIZE)

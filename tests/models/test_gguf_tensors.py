"""GGUF tensor types as MLX arrays (``models/gguf/tensors.py``) and the GGUF header reader
(``models/gguf/header.py``), each against an oracle that does not share their code.

Oracles: MLX's own quantizer for the bit packing; gguf-py (llama.cpp's Python package) for
everything else: its quantizers make realistic legacy blocks, its dequantizers are the reference
values, its writer and reader the reference for the header. K-quant and i-quant blocks are random
bytes of llama.cpp's ``ggml-common.h`` block layouts, with their float16 super-block scales set to
small positive values (random bytes there give inf/NaN/1e4-sized weights no model has).
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from gguf_builder import random_blocks

from vllm_mlx.models.gguf import tensors
from vllm_mlx.models.gguf.header import open_gguf
from vllm_mlx.platform.errors import ModelSourceError

GROUP = 32
F16_UNIT_ROUNDOFF = 2.0**-11


def qtype(kind: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[kind]


def mlx_dequantize(arrays: dict, bits: int) -> np.ndarray:
    """The converted triple as MLX itself reads it, in float32."""
    out = mx.dequantize(arrays["weight"], arrays["scales"], arrays["biases"], group_size=GROUP, bits=bits)
    return np.array(out.astype(mx.float32))


def per_group(values: np.ndarray) -> np.ndarray:
    return values.reshape(-1, GROUP)


# ---------------------------------------------------------------------------
# pack(): MLX's bit layout, taken from MLX's own quantizer


def mlx_packing(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """MLX's packed words for ``w`` and the unsigned q values they hold (read back through
    ``mx.dequantize``: q = (value - bias) / scale, an integer up to float rounding)."""
    packed, scales, biases = mx.quantize(mx.array(w), group_size=GROUP, bits=bits)
    values = np.array(mx.dequantize(packed, scales, biases, group_size=GROUP, bits=bits))
    q = (values - np.repeat(np.array(biases), GROUP, -1)) / np.repeat(np.array(scales), GROUP, -1)
    q_int = np.rint(q)
    assert np.abs(q - q_int).max() < 1e-2
    assert q_int.min() == 0 and q_int.max() == 2**bits - 1  # every bit position is exercised
    return np.array(packed), q_int.astype(np.uint8)


PACK_SHAPES = [(3, 64), (2, 3, 96), (7, 160)]  # a matrix, experts (3-D), odd row count


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("shape", PACK_SHAPES, ids=["2d", "3d-experts", "7-rows"])
def test_pack_matches_mlx(bits, shape):
    w = np.random.default_rng(bits).standard_normal(shape).astype(np.float32)
    words, q = mlx_packing(w, bits)
    packed = tensors.pack(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == words.shape
    np.testing.assert_array_equal(packed, words)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])  # 4 and 8 bits do not go through the chunked loop
@pytest.mark.parametrize("chunk_values", [96, 200, 1000])  # 1 row, 2 rows, 10 rows a chunk
def test_pack_across_chunks_matches_mlx(bits, chunk_values, monkeypatch):
    monkeypatch.setattr(tensors, "PACK_CHUNK_VALUES", chunk_values)
    w = np.random.default_rng(bits).standard_normal((3, 7, 96)).astype(np.float32)  # 21 rows
    words, q = mlx_packing(w, bits)
    np.testing.assert_array_equal(tensors.pack(q, bits), words)


# ---------------------------------------------------------------------------
# Blocks: realistic bytes for every type

def tensor_bytes(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor of ``kind`` in numpy ``shape`` as GGUF stores it: (rows..., row bytes) uint8."""
    t = qtype(kind)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16"):  # gguf-py quantizes these
        return gguf_quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), t)
    block_size, _ = GGML_QUANT_SIZES[t]
    n_blocks = int(np.prod(shape)) // block_size
    return random_blocks(kind, n_blocks, rng).reshape(*shape[:-1], -1)


# ---------------------------------------------------------------------------
# Exact types: MLX's affine triple holds the GGUF blocks bit for bit

EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
LEGACY_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
EXACT_SHAPES = [(4, 512), (2, 3, 256)]  # two K super-blocks a row; experts


def convert(kind: str, raw: np.ndarray, shape: tuple[int, ...], scale_dtype: str = "float32") -> dict:
    return tensors.convert_tensor("blk.0.w", raw.reshape(-1), qtype(kind).value, shape, scale_dtype)


@pytest.mark.parametrize("kind", ["Q5_K", "Q8_0", "Q6_K", "IQ4_NL"])
def test_row_chunks_convert_like_the_whole_tensor(kind, monkeypatch):
    """Quantized tensors convert in whole-row chunks (bounded temporaries): same arrays."""
    shape = (2, 5, 256)  # 10 rows; experts
    raw = tensor_bytes(kind, shape, np.random.default_rng(3))
    whole = convert(kind, raw, shape)
    monkeypatch.setattr(tensors, "CONVERT_CHUNK_VALUES", 3 * 256)  # 3 rows a chunk: 4 chunks
    chunked = convert(kind, raw, shape)
    for key in ("weight", "scales", "biases"):
        assert chunked[key].shape == whole[key].shape
        assert mx.array_equal(chunked[key], whole[key]).item(), key


def test_exact_types_are_the_documented_ones():
    assert set(tensors.EXACT_TYPES) == set(EXACT_BITS)


@pytest.mark.parametrize("shape", EXACT_SHAPES, ids=["2d", "3d-experts"])
@pytest.mark.parametrize("kind", list(EXACT_BITS))
def test_exact_type_equals_gguf_dequantizer(kind, shape):
    raw = tensor_bytes(kind, shape, np.random.default_rng(0))
    reference = gguf_dequantize(raw, qtype(kind)).astype(np.float32)
    arrays = convert(kind, raw, shape)
    bits = EXACT_BITS[kind]
    assert arrays["scales"].dtype == mx.float32 and arrays["biases"].dtype == mx.float32
    assert arrays["scales"].shape == (*shape[:-1], shape[-1] // GROUP)
    assert tensors.quantized_bits(arrays) == bits
    # Bit-equal, not just within rtol 1e-6 (observed: 0 differences). Every product here is exact
    # in float32 (an f16 scale's 11-bit significand times q, and K's 6-bit sub-scales), so MLX's
    # scale*q + bias and gguf-py's formula round the same single sum the same way.
    np.testing.assert_array_equal(mlx_dequantize(arrays, bits), reference)


@pytest.mark.parametrize("kind", list(EXACT_BITS))
def test_exact_type_with_float16_scales(kind):
    """float16 scales (Metal's default) lose nothing for the legacy types (d, m, -8d, -16d,
    -128d are float16 values); Q4_K/Q5_K's d*sc and dmin*m round to float16. MLX then computes
    in float16. First-order bound per group, with u = 2**-11: scale and bias rounded once each,
    product and sum once each, so |error| <= 3u * (|scale| * (2**bits - 1) + |bias|).
    Observed: up to 0.94e-3 of that magnitude (Q5_K), 0.35e-3 for the legacy types; 3u = 1.46e-3."""
    shape = (4, 512)
    raw = tensor_bytes(kind, shape, np.random.default_rng(1))
    reference = gguf_dequantize(raw, qtype(kind)).astype(np.float32)
    exact, half = convert(kind, raw, shape, "float32"), convert(kind, raw, shape, "float16")
    assert half["scales"].dtype == mx.float16 and half["biases"].dtype == mx.float16
    if kind in LEGACY_TYPES:
        for key in ("scales", "biases"):
            np.testing.assert_array_equal(np.array(half[key].astype(mx.float32)), np.array(exact[key]))
    bits = EXACT_BITS[kind]
    error = per_group(np.abs(mlx_dequantize(half, bits) - reference)).max(-1)
    magnitude = np.abs(np.array(exact["scales"])) * (2**bits - 1) + np.abs(np.array(exact["biases"]))
    assert (error <= 3 * F16_UNIT_ROUNDOFF * magnitude.reshape(-1)).all(), (error / magnitude.reshape(-1)).max()


@pytest.mark.parametrize("kind", list(EXACT_BITS))
def test_decode_affine_q_fits_the_bit_width(kind):
    block_size, _ = GGML_QUANT_SIZES[qtype(kind)]
    raw = tensor_bytes(kind, (4, 512), np.random.default_rng(2))
    affine = tensors.decode_affine(raw.reshape(-1), qtype(kind).value)
    n_blocks, groups = 4 * 512 // block_size, block_size // GROUP
    assert affine.bits == EXACT_BITS[kind]
    assert affine.q.shape == (n_blocks, groups, GROUP) and affine.scale.shape == (n_blocks, groups)
    assert affine.bias.shape == affine.scale.shape
    assert affine.q.max() == 2**affine.bits - 1  # below 2**bits, and the top bit is read


# ---------------------------------------------------------------------------
# Re-quantized types: gguf-py's float32 values, quantized again to 8 bits in groups of 32

# Q2_K/Q3_K/Q6_K: sub-blocks of 16; the rest: i-quants, ternary, FP4 (not affine).
REQUANTIZED_SHAPE = (4, 512)


def test_requantized_types_are_the_documented_ones():
    assert tensors.REQUANTIZED_BITS == 8
    assert {"Q2_K", "Q3_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS"} <= set(tensors.REQUANTIZED_TYPES)


def one_step_bound(reference: np.ndarray) -> np.ndarray:
    """One 8-bit step of each group's range, plus float32 rounding of the group's magnitude.

    One step, not half: MLX's quantizer keeps 0 exactly representable (its bias is a whole
    number of steps from 0), which for a group spanning 0 can shorten the reach at the far end
    by up to a step (observed up to 0.996 of a step; half a step where a group has one sign)."""
    groups = per_group(reference)
    value_range = groups.max(-1) - groups.min(-1)
    return value_range / 255 * (1 + 1e-5) + 1e-6 * np.abs(groups).max(-1)


@pytest.mark.parametrize("kind", tensors.REQUANTIZED_TYPES)
def test_requantized_type_within_one_8bit_step(kind):
    raw = tensor_bytes(kind, REQUANTIZED_SHAPE, np.random.default_rng(3))
    reference = gguf_dequantize(raw, qtype(kind)).astype(np.float32)
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    arrays = convert(kind, raw, REQUANTIZED_SHAPE)
    assert arrays["scales"].dtype == mx.float32 and arrays["scales"].shape == (4, 512 // GROUP)
    error = per_group(np.abs(mlx_dequantize(arrays, 8) - reference)).max(-1)
    bound = one_step_bound(reference)
    assert (error <= bound).all(), (error / bound).max()


def test_requantized_one_signed_groups_within_half_a_step():
    """Groups that do not span 0 lose only rounding: half a step (Q2_K with dmin = 0: values
    d * sc * q >= 0). Observed up to 0.4999 of a step."""
    blocks = random_blocks("Q2_K", 8, np.random.default_rng(10))
    blocks[:, 82:84] = 0  # dmin = +0.0
    raw = blocks.reshape(4, -1)
    reference = gguf_dequantize(raw, qtype("Q2_K")).astype(np.float32)
    assert reference.min() >= 0
    error = per_group(np.abs(mlx_dequantize(convert("Q2_K", raw, (4, 512)), 8) - reference)).max(-1)
    bound = one_step_bound(reference)
    assert (error <= bound / 2).all(), (error / bound).max()
    assert (error > bound / 4).any()  # not vacuous


def pack_q3_k_scales(six_bit: np.ndarray) -> np.ndarray:
    """Q3_K's 16 six-bit scales (n, 16) into its 12 bytes: low nibbles in bytes 0-7 (scale j in
    byte j % 8, nibble j // 8), the top two bits in bytes 8-11 (byte 8 + j % 4, bits 2 * (j // 4))."""
    low = six_bit & 0xF
    packed = np.zeros((len(six_bit), 12), dtype=np.uint8)
    packed[:, :8] = low[:, :8] | (low[:, 8:] << 4)
    for j in range(16):
        packed[:, 8 + j % 4] |= (six_bit[:, j] >> 4) << (2 * (j // 4))
    return packed


def paired_sub_blocks(kind: str, n_blocks: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Blocks whose two sub-blocks of 16 in each group of 32 share their scale (and min), and
    each sub-block's step (the value of one q unit): the case where a group's range is the
    source's own range, so the 8-bit error is a fixed fraction of the source step."""
    blocks = random_blocks(kind, n_blocks, rng)
    if kind == "Q2_K":  # one byte per sub-block: scale (low nibble), min (high nibble)
        blocks[:, 1:16:2] = blocks[:, 0:16:2]
        d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
        return blocks, d * (blocks[:, :16] & 0xF)
    if kind == "Q3_K":
        six_bit = np.repeat(rng.integers(0, 64, (n_blocks, 8), dtype=np.uint8), 2, axis=1)
        blocks[:, 96:108] = pack_q3_k_scales(six_bit)
        d = blocks[:, 108:110].copy().view(np.float16).astype(np.float32)
        return blocks, np.abs(d * (six_bit.astype(np.float32) - 32))
    blocks[:, 193:208:2] = blocks[:, 192:208:2]  # Q6_K: int8 scales[16]
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return blocks, np.abs(d * blocks[:, 192:208].view(np.int8))


# Levels of q in a sub-block: the 8-bit error is at most (levels - 1) / 255 of one source step.
SOURCE_LEVELS = {"Q2_K": 4, "Q3_K": 8, "Q6_K": 64}


@pytest.mark.parametrize("kind", list(SOURCE_LEVELS))
def test_group16_k_quant_error_relative_to_source_step(kind):
    """Where both sub-blocks of a group share a scale, the error is at most (levels - 1) / 255 of
    the source type's own step: 3/255 (Q2_K), 7/255 (Q3_K), 63/255 (Q6_K, a quarter). Observed
    here 0.82 (Q2_K), 0.50 (Q3_K: its levels -4..3 put 0 on a level) and 0.98 (Q6_K) of that.
    Where the two sub-scales differ, a small-scale sub-block shares the 8-bit step of a
    large-scale one: on gemma-3-270m's Q6_K tensors (real weights) the error was a median 0.12,
    99th percentile 0.25, maximum 1.5 Q6_K steps; the one-step test above bounds it by the
    group's range in every case."""
    rows, cols = 4, 512
    blocks, steps = paired_sub_blocks(kind, rows * cols // 256, np.random.default_rng(4))
    raw = blocks.reshape(rows, -1)
    reference = gguf_dequantize(raw, qtype(kind)).astype(np.float32)
    error = np.abs(mlx_dequantize(convert(kind, raw, (rows, cols)), 8) - reference).reshape(-1, 16).max(-1)
    steps = steps.reshape(-1)
    limit = steps * (SOURCE_LEVELS[kind] - 1) / 255 * (1 + 1e-5) + 1e-6 * np.abs(reference).max()
    assert (error <= limit).all(), (error / np.maximum(steps, 1e-30)).max()
    assert (error[steps > 0] / steps[steps > 0]).max() > (SOURCE_LEVELS[kind] - 1) / 255 / 4  # not vacuous


# ---------------------------------------------------------------------------
# Float types: unchanged


def test_f32_round_trips_exactly():
    shape = (2, 3, 8)
    values = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    values.flat[:4] = [0.0, -0.0, 1e-40, np.finfo(np.float32).max]  # signed zero, subnormal, max
    out = tensors.convert_tensor("w", values.view(np.uint8).reshape(-1), 0, shape, "float32")
    assert set(out) == {"weight"} and out["weight"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(out["weight"]).view(np.uint32), values.view(np.uint32))


def test_f16_round_trips_exactly():
    shape = (5, 16)
    bits = np.random.default_rng(6).integers(0, 0x7C00, shape, dtype=np.uint16)  # finite, incl. subnormal
    bits |= np.random.default_rng(7).integers(0, 2, shape, dtype=np.uint16) << 15  # either sign
    out = tensors.convert_tensor("w", bits.view(np.uint8).reshape(-1), 1, shape, "float32")
    assert out["weight"].dtype == mx.float16
    np.testing.assert_array_equal(np.array(out["weight"]).view(np.uint16), bits)


def test_bf16_round_trips_exactly():
    shape = (3, 32)
    raw = tensor_bytes("BF16", shape, np.random.default_rng(8))
    out = tensors.convert_tensor("w", raw.reshape(-1), qtype("BF16").value, shape, "float32")
    assert out["weight"].dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(out["weight"].astype(mx.float32)), gguf_dequantize(raw, qtype("BF16")))
    np.testing.assert_array_equal(np.array(out["weight"].view(mx.uint16)), raw.view(np.uint16))


# ---------------------------------------------------------------------------
# Unsupported types: refused by name, with the supported list


@pytest.mark.parametrize("type_id, name", [(9, "Q8_1"), (15, "Q8_K"), (28, "F64"), (99, "#99")])
def test_unsupported_type_is_refused_with_the_supported_list(type_id, name):
    with pytest.raises(ModelSourceError) as info:
        tensors.check_supported("blk.3.attn_q.weight", type_id)
    message = str(info.value)
    assert "\n" not in message
    assert f"'blk.3.attn_q.weight' has GGML type {name}," in message
    assert f"(supported: {', '.join(tensors.SUPPORTED_TYPES)})" in message
    with pytest.raises(ModelSourceError, match=name):
        tensors.convert_tensor("w", np.zeros(64, dtype=np.uint8), type_id, (1, 32), "float32")


def test_supported_types_are_accepted_by_name():
    for kind in tensors.SUPPORTED_TYPES:
        assert tensors.check_supported("w", qtype(kind).value) == kind


# ---------------------------------------------------------------------------
# Header: what gguf-py writes, read back as gguf-py's reader reads it

METADATA = {  # key: (value, GGUF value type, array item type)
    "test.u8": (200, GGUFValueType.UINT8, None),
    "test.i8": (-100, GGUFValueType.INT8, None),
    "test.u16": (60000, GGUFValueType.UINT16, None),
    "test.i16": (-30000, GGUFValueType.INT16, None),
    "test.u32": (4_000_000_000, GGUFValueType.UINT32, None),
    "test.i32": (-2_000_000_000, GGUFValueType.INT32, None),
    "test.u64": (2**63 + 5, GGUFValueType.UINT64, None),
    "test.i64": (-(2**62), GGUFValueType.INT64, None),
    "test.f32": (-1.25, GGUFValueType.FLOAT32, None),
    "test.f64": (1 / 3, GGUFValueType.FLOAT64, None),
    "test.bool": (True, GGUFValueType.BOOL, None),
    "test.string": ("héllo ▁world", GGUFValueType.STRING, None),
    "test.empty_string": ("", GGUFValueType.STRING, None),
    "test.strings": (["<s>", "", "▁the", "日本"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    "test.i32s": ([1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "test.u8s": ([0, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    "test.u64s": ([2**64 - 1, 0], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    "test.f32s": ([0.5, -2.0], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "test.f64s": ([0.1, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    "test.bools": ([True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
}
HEADER_TENSORS = {  # name: (type, numpy shape)
    "f32.matrix": ("F32", (3, 5)),
    "f16.vector": ("F16", (7,)),
    "bf16.experts": ("BF16", (2, 3, 4)),
    "q4_0.matrix": ("Q4_0", (2, 64)),
    "q8_0.4d": ("Q8_0", (2, 1, 2, 32)),
    "q4_k.matrix": ("Q4_K", (2, 256)),
    "iq4_nl.matrix": ("IQ4_NL", (3, 32)),
}


@pytest.fixture(scope="module")
def written_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("header") / "mixed.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)  # not the default 32: the data section must follow the key
    for key, (value, vtype, sub_type) in METADATA.items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    rng = np.random.default_rng(9)
    for name, (kind, shape) in HEADER_TENSORS.items():
        if kind in ("F32", "F16"):
            writer.add_tensor(name, rng.standard_normal(shape).astype({"F32": np.float32, "F16": np.float16}[kind]))
        else:
            writer.add_tensor(name, tensor_bytes(kind, shape, rng), raw_dtype=qtype(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_metadata_matches_what_was_written(written_gguf):
    gguf = open_gguf(written_gguf)
    try:
        reader = GGUFReader(written_gguf)
        expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        assert gguf.metadata == expected
        for key, (value, vtype, _) in METADATA.items():
            got = gguf.metadata[key]
            if vtype == GGUFValueType.FLOAT32:
                assert got == value and isinstance(got, float)
            else:
                assert got == value and type(got) is type(value), key
        assert gguf.metadata["general.architecture"] == "llama" and gguf.metadata["general.alignment"] == 64
    finally:
        gguf.close()


def test_header_tensor_table_matches_gguf_reader(written_gguf):
    gguf = open_gguf(written_gguf)
    try:
        reader = {t.name: t for t in GGUFReader(written_gguf).tensors}
        assert list(gguf.tensors) == list(HEADER_TENSORS) == list(reader)
        for name, (kind, shape) in HEADER_TENSORS.items():
            info, theirs = gguf.tensors[name], reader[name]
            assert info.shape == shape == tuple(int(n) for n in reversed(theirs.shape)), name
            assert info.type_id == qtype(kind).value == theirs.tensor_type.value
            assert (info.offset, info.nbytes) == (theirs.data_offset, theirs.n_bytes)
            assert info.offset % 64 == 0
            theirs_bytes = np.asarray(theirs.data).view(np.uint8).reshape(-1)
            np.testing.assert_array_equal(gguf.tensor_bytes(info), theirs_bytes)
    finally:
        gguf.close()


# Hand-built files for the corruptions gguf-py's writer will not produce.


def gguf_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def tensor_entry(name: str, ne: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    """One tensor-table entry; ``ne`` in GGML order (contiguous dimension first)."""
    return gguf_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset)


def gguf_file(
    path: Path, *, kv: bytes = b"", n_kv: int = 0, entries: tuple[bytes, ...] = (), data: bytes = b"", version: int = 3
) -> Path:
    header = b"GGUF" + struct.pack("<IQQ", version, len(entries), n_kv) + kv + b"".join(entries)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + data)
    return path


def test_hand_built_file_reads(tmp_path):
    """The builder below is right: a good hand-built file reads, so the failures are the corruptions."""
    kv = gguf_string("general.name") + struct.pack("<I", 8) + gguf_string("x")
    kv += gguf_string("general.empty") + struct.pack("<IIQ", 9, 8, 0)  # gguf-py's writer refuses []
    path = gguf_file(tmp_path / "ok.gguf", kv=kv, n_kv=2, entries=(tensor_entry("w", (4, 2)),), data=bytes(32))
    gguf = open_gguf(path)
    assert gguf.metadata == {"general.name": "x", "general.empty": []} and gguf.tensors["w"].shape == (2, 4)
    assert gguf.tensors["w"].nbytes == 32
    gguf.close()


def _tensor_past_end(path: Path) -> Path:
    return gguf_file(path, entries=(tensor_entry("w", (4, 2)),), data=bytes(31))


def _element_count_wraps(path: Path) -> Path:
    # 2**32 * 2**32 elements: a uint64 product wraps to 0 bytes, which "fit" in any file
    return gguf_file(path, entries=(tensor_entry("w", (2**32, 2**32)),), data=bytes(32))


def _string_past_end(path: Path) -> Path:
    return gguf_file(path, kv=struct.pack("<Q", 2**40) + b"general", n_kv=1)


def _array_count_past_end(path: Path) -> Path:
    kv = gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**61)
    return gguf_file(path, kv=kv, n_kv=1)


def _five_dims(path: Path) -> Path:
    return gguf_file(path, entries=(tensor_entry("w", (32, 1, 1, 1, 1)),), data=bytes(128))


def _bad_magic(path: Path) -> Path:
    gguf_file(path)
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    return path


def _unknown_value_type(path: Path) -> Path:
    return gguf_file(path, kv=gguf_string("general.x") + struct.pack("<I", 13) + bytes(8), n_kv=1)


def _array_of_arrays(path: Path) -> Path:
    kv = gguf_string("general.x") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0)
    return gguf_file(path, kv=kv, n_kv=1)


def _not_utf8(path: Path) -> Path:
    return gguf_file(path, kv=gguf_string(b"general.\xff") + struct.pack("<I", 7) + b"\x01", n_kv=1)


def _unknown_tensor_type(path: Path) -> Path:
    return gguf_file(path, entries=(tensor_entry("w", (32,), type_id=99),), data=bytes(64))


def _partial_block(path: Path) -> Path:
    return gguf_file(path, entries=(tensor_entry("w", (48,), type_id=2),), data=bytes(64))  # Q4_0: 32


def _duplicate_tensor(path: Path) -> Path:
    return gguf_file(path, entries=(tensor_entry("w", (8,)), tensor_entry("w", (8,), offset=32)), data=bytes(64))


def _alignment_not_a_number(path: Path) -> Path:
    kv = gguf_string("general.alignment") + struct.pack("<I", 8) + gguf_string("32")
    return gguf_file(path, kv=kv, n_kv=1)


def _version_1(path: Path) -> Path:
    return gguf_file(path, version=1)


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "make, reason",
    [
        (_tensor_past_end, "tensor 'w' extends past the end of the file"),
        (_element_count_wraps, "tensor 'w' extends past the end of the file"),
        (_string_past_end, "the header runs past the end of the file"),
        (_array_count_past_end, "the header runs past the end of the file"),
        (_five_dims, "a tensor with 5 dimensions"),
        (_bad_magic, "is not a GGUF file (bad magic bytes)"),
        (_empty, "is not a GGUF file (bad magic bytes)"),
        (_unknown_value_type, "unknown metadata value type 13"),
        (_array_of_arrays, "unknown metadata value type 9"),
        (_not_utf8, "a string that is not UTF-8"),
        (_unknown_tensor_type, "tensor 'w' has an unknown GGML type 99"),
        (_partial_block, "rows of 48 are not whole blocks of 32"),
        (_duplicate_tensor, "tensor 'w' appears twice"),
        (_alignment_not_a_number, "general.alignment is '32'"),
        (_version_1, "unsupported GGUF version 1"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)
def test_corrupt_header_is_a_one_line_error(tmp_path, make, reason):
    path = make(tmp_path / "bad.gguf")
    with pytest.raises(ModelSourceError) as info:
        open_gguf(path)
    message = str(info.value)
    assert reason in message and str(path) in message and "\n" not in message


def test_a_type_gguf_py_cannot_dequantize_is_a_clear_error(monkeypatch):
    """An older gguf-py may know a type's id but not its dequantizer: a one-line error with the fix."""
    import gguf.quants

    def not_implemented(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", not_implemented)
    raw = tensor_bytes("Q6_K", (2, 256), np.random.default_rng(0))
    with pytest.raises(ModelSourceError, match=r"cannot dequantize Q6_K tensors: pip install -U gguf"):
        convert("Q6_K", raw, (2, 256))

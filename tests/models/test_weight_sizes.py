"""The size of a checkpoint's weights in each format, read from the safetensors headers before
loading (``vllm_mlx/models/weight_sizes.py``), against what the loaded and converted weights
really take."""

from __future__ import annotations

import json
import struct

import pytest

from vllm_mlx.models.weight_sizes import TensorInfo, WeightSizes, read_safetensors_header, weight_sizes


def _write_header(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _loaded_bytes(model_dir, weight_format: str) -> int:
    """Bytes of the model's parameters once loaded by mlx-lm and put in ``weight_format``."""
    import mlx_lm
    from mlx.utils import tree_flatten

    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    model, _ = mlx_lm.load(str(model_dir))
    prepare_model_weights(model, weight_format)
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def mixed_quantized_dir(tmp_path_factory, default_model_dir):
    """4-bit layers, an 8-bit embedding (a per-layer override in config.json)."""
    from tiny_model import build_tiny_quantized

    out = tmp_path_factory.mktemp("mixed") / "model"
    return build_tiny_quantized(out, default_model_dir, layer_bits={"model.embed_tokens": 8})


def test_header_is_read_without_the_data(tmp_path):
    path = tmp_path / "a.safetensors"
    header = {
        "__metadata__": {"format": "mlx"},
        "w": {"dtype": "U32", "shape": [8, 4], "data_offsets": [0, 128]},
        "w.scales": {"dtype": "BF16", "shape": [8, 1], "data_offsets": [128, 144]},
    }
    _write_header(path, header)  # no data at all: only the header is read
    tensors = read_safetensors_header(path)
    assert tensors == {"w": TensorInfo("U32", (8, 4)), "w.scales": TensorInfo("BF16", (8, 1))}
    assert tensors["w"].nbytes == 128 and tensors["w.scales"].numel == 8


@pytest.mark.parametrize("content", [b"", b"\x01\x02", struct.pack("<Q", 1 << 40), struct.pack("<Q", 4) + b"{no"])
def test_a_file_that_is_not_safetensors_is_refused(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.safetensors"):
        read_safetensors_header(path)


def test_quantized_arithmetic(tmp_path):
    """A 4-bit weight of packed shape (o, p) holds o * p * 8 values; its scales and biases go."""
    config = {"quantization": {"group_size": 64, "bits": 4, "lm_head": {"group_size": 64, "bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _write_header(tmp_path / "model.safetensors", {
        "proj.weight": {"dtype": "U32", "shape": [128, 32], "data_offsets": [0, 0]},  # 128 x 256 at 4 bits
        "proj.scales": {"dtype": "BF16", "shape": [128, 4], "data_offsets": [0, 0]},
        "proj.biases": {"dtype": "BF16", "shape": [128, 4], "data_offsets": [0, 0]},
        "lm_head.weight": {"dtype": "U32", "shape": [16, 64], "data_offsets": [0, 0]},  # 16 x 256 at 8 bits
        "lm_head.scales": {"dtype": "BF16", "shape": [16, 4], "data_offsets": [0, 0]},
        "lm_head.biases": {"dtype": "BF16", "shape": [16, 4], "data_offsets": [0, 0]},
        "norm.weight": {"dtype": "BF16", "shape": [256], "data_offsets": [0, 0]},
        "positions": {"dtype": "I32", "shape": [10], "data_offsets": [0, 0]},
    })  # fmt: skip
    sizes = weight_sizes(tmp_path)
    stored = 128 * 32 * 4 + 2 * 128 * 4 * 2 + 16 * 64 * 4 + 2 * 16 * 4 * 2 + 256 * 2 + 10 * 4
    values = 128 * 256 + 16 * 256 + 256
    assert sizes == WeightSizes(stored, values * 4 + 40, values * 2 + 40, True, "bfloat16")
    assert sizes.activation_bytes("float32") == 4 and sizes.activation_bytes("quantized") == 2


def test_a_float_checkpoint_is_the_same_size_in_every_format(tiny_model_dir):
    sizes = weight_sizes(tiny_model_dir)
    assert not sizes.is_quantized
    assert sizes.quantized == sizes.float32 == sizes.bfloat16 == _loaded_bytes(tiny_model_dir, "float32")
    assert sizes.activation_bytes("bfloat16") == 4  # float32 weights stay float32: nothing is converted


@pytest.mark.parametrize("weight_format", ["quantized", "bfloat16", "float32"])
def test_estimate_is_what_the_loaded_weights_take(mixed_quantized_dir, weight_format):
    """Exact for mlx-lm's own layout: every stored tensor is loaded, converted as counted."""
    sizes = weight_sizes(mixed_quantized_dir)
    assert sizes.is_quantized and sizes.float_dtype == "bfloat16"
    assert sizes.bytes_of(weight_format) == _loaded_bytes(mixed_quantized_dir, weight_format)


def test_the_override_counts(mixed_quantized_dir, tmp_path):
    """Without its per-layer 8 bits, the embedding would count twice the values it holds."""
    sizes = weight_sizes(mixed_quantized_dir)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").symlink_to(mixed_quantized_dir / "model.safetensors")
    config = json.loads((mixed_quantized_dir / "config.json").read_text())
    config["quantization"].pop("model.embed_tokens")
    (copy / "config.json").write_text(json.dumps(config))
    wrong = weight_sizes(copy)
    embedding = read_safetensors_header(mixed_quantized_dir / "model.safetensors")["model.embed_tokens.weight"]
    assert wrong.float32 - sizes.float32 == embedding.numel * 4 * 4  # 8 values a word, not 4


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        weight_sizes(tmp_path)

"""The ranks' start-up check (vllm_mlx/models/digest.py): what changes a model's digest, and what
it does not read (the middle of a large weight file)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from vllm_mlx.models import digest as md


def _safetensors(path: Path, data: bytes, dtype: str = "F32") -> None:
    header = json.dumps({"w": {"dtype": dtype, "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.fixture
def model(tmp_path) -> Path:
    """A model directory with a weight file larger than the whole-file limit (3 samples apart)."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    _safetensors(root / "model.safetensors", bytes(md.WHOLE_FILE_BYTES + 4 * md.SAMPLE_BYTES))
    return root


def _changed(model: Path, tmp_path: Path, change) -> bool:
    other = tmp_path / f"copy{len(list(tmp_path.glob('copy*')))}"
    shutil.copytree(model, other)
    change(other)
    return md.model_digest(other) != md.model_digest(model)


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def test_an_identical_copy_has_the_same_digest(model, tmp_path):
    assert not _changed(model, tmp_path, lambda m: (m / "vllm_mlx_model.json").write_text("{}"))  # our manifest
    assert not _changed(model, tmp_path, lambda m: (m / ".cache").mkdir())  # hidden files


@pytest.mark.parametrize(
    "change",
    [
        lambda m: (m / "config.json").write_text('{"model_type": "qwen2"}'),
        lambda m: (m / "tokenizer.json").write_text('{"vocab": {"a": 1}}'),
        lambda m: (m / "tokenizer_config.json").write_text("{}"),  # a file added
        lambda m: (m / "model.safetensors").rename(m / "model-00001.safetensors"),
        lambda m: _safetensors(m / "model.safetensors", bytes(md.WHOLE_FILE_BYTES + 4 * md.SAMPLE_BYTES), "I32"),
        lambda m: _flip(m / "model.safetensors", 200),  # first sampled MiB of the data
        lambda m: _flip(m / "model.safetensors", (m / "model.safetensors").stat().st_size - 1),  # the last byte
        lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-4]),  # truncated
    ],
    ids=["config", "tokenizer", "added-file", "renamed-weights", "dtype-in-header", "first-mib", "last-byte",
         "truncated"],
)  # fmt: skip
def test_what_changes_the_digest(model, tmp_path, change):
    assert _changed(model, tmp_path, change)


def test_the_middle_of_a_large_weight_file_is_not_read(model, tmp_path):
    """The documented limit: an equal-size change between the two samples goes unnoticed."""
    middle = (model / "model.safetensors").stat().st_size // 2
    assert not _changed(model, tmp_path, lambda m: _flip(m / "model.safetensors", middle))

"""A model's fingerprint, cheap enough to take at every start-up of a 100+ GB model: the ranks of
a tensor-parallel engine compare theirs before sharding (``distributed.check_same_model``).

``model_digest(path)`` is a SHA-256 over, for every regular file of the model directory (sorted
by relative path, recursively; hidden files and our own ``vllm_mlx_model.json`` manifest, which
records when and from where a copy was made, left out):

- its relative path and size;
- a small file (<= ``WHOLE_FILE_BYTES``: config.json, tokenizer files, chat templates, model code)
  whole;
- a ``.safetensors`` file: its header whole (every tensor's name, dtype, shape and byte offsets),
  then the first and the last ``SAMPLE_BYTES`` of its tensor data;
- any other large file (a ``.gguf``, ``.npz``, ``.bin``): its first and last ``SAMPLE_BYTES``.

It reads at most a few MiB per file, so it takes milliseconds where a full hash would read the
whole model: SHA-256 ran at 1.7 GiB/s on one core of our build machine, so hashing a 70B model
in bfloat16 (141 GB) would take about 80 s on every rank at every start, before any disk reads.

What it catches: a different model, a different revision or conversion (config, tokenizer,
tensor layout, dtype or quantization all change the headers or sizes), a truncated or partly
written copy, and a change in the sampled bytes. What it does not: a change of equal size inside
a weight file's unsampled middle (bit rot, a hand-edited tensor). Verify a copy's content once
with the hub's own hashes (or ``sha256sum``) when that matters.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

WHOLE_FILE_BYTES = 16 << 20  # files up to this size are hashed whole
SAMPLE_BYTES = 1 << 20  # of a larger file: this much of its start and of its end
SKIPPED = {"vllm_mlx_model.json"}  # models.store.MANIFEST: differs between copies of one model


def model_digest(path: Path) -> str:
    """The fingerprint of the model directory (or single model file) at ``path``, hex."""
    path = Path(path)
    digest = hashlib.sha256()
    root = path if path.is_dir() else path.parent
    for file in model_files(path):
        digest.update(f"{file.relative_to(root).as_posix()}\0".encode())
        digest.update(file_fingerprint(file))
    return digest.hexdigest()


def model_files(path: Path) -> list[Path]:
    """The files ``model_digest`` covers, sorted."""
    if not path.is_dir():
        return [path]
    return sorted(
        file for file in path.rglob("*")
        if file.is_file() and file.name not in SKIPPED
        and not any(part.startswith(".") for part in file.relative_to(path).parts)
    )  # fmt: skip


def file_fingerprint(file: Path) -> bytes:
    """One file's share of the digest (see the module docstring), as a SHA-256 digest."""
    size = file.stat().st_size
    digest = hashlib.sha256(f"{size}\0".encode())
    with file.open("rb") as f:
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
            return digest.digest()
        start = 0
        if file.suffix == ".safetensors":
            header = _safetensors_header(f, size)
            digest.update(header)
            start = 8 + len(header)
        f.seek(start)
        digest.update(f.read(SAMPLE_BYTES))
        f.seek(max(start, size - SAMPLE_BYTES))
        digest.update(f.read(SAMPLE_BYTES))
    return digest.digest()


def _safetensors_header(f, size: int) -> bytes:
    """The JSON header (a little-endian u64 length, then the JSON): every tensor's name, dtype,
    shape and offsets. A length that does not fit the file is hashed as found (the sizes already
    differ from a sound copy's)."""
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(min(length, size - 8))

"""A bounds-checked walk over a GGUF header, run before MLX's C reader sees the file.

MLX's GGUF reader trusts the lengths and dimension counts in the header: a corrupt file can
crash the process (a segfault on a string length past the end, an abort on > 4 dimensions).
Walking the header here first turns every such file into a one-line ``ModelSourceError``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from vllm_mlx.platform.errors import ModelSourceError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
# GGUF metadata value types: fixed sizes of the scalar ones; 8 = string, 9 = array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    def __init__(self, path: Path, file) -> None:
        self.path = path
        self.file = file
        self.size = os.fstat(file.fileno()).st_size
        self.pos = 0

    def corrupt(self, what: str) -> ModelSourceError:
        return ModelSourceError(f"{self.path} is truncated or corrupt ({what})")

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.corrupt("the header runs past the end of the file")
        self.pos += n
        self.file.seek(self.pos)

    def read(self, n: int) -> bytes:
        start = self.pos
        self.skip(n)
        self.file.seek(start)
        data = self.file.read(n)
        self.file.seek(self.pos)
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def value(self, value_type: int, nested: bool = False) -> None:
        if value_type in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[value_type])
        elif value_type == _STRING:
            self.skip(self.u64())
        elif value_type == _ARRAY and not nested:
            item_type, count = self.u32(), self.u64()
            if item_type in _SCALAR_SIZES:
                self.skip(_SCALAR_SIZES[item_type] * count)
            else:
                for _ in range(count):
                    self.value(item_type, nested=True)
        else:
            raise self.corrupt(f"unknown metadata value type {value_type}")


def check_gguf_header(path: Path) -> None:
    """Raise ``ModelSourceError`` unless ``path`` has a well-formed GGUF v2/v3 header."""
    try:
        with open(path, "rb") as f:
            reader = _HeaderReader(path, f)
            if f.read(4) != GGUF_MAGIC:
                raise ModelSourceError(f"{path} is not a GGUF file (bad magic bytes)")
            reader.pos = 4
            version = reader.u32()
            if version not in SUPPORTED_VERSIONS:
                raise ModelSourceError(f"{path}: unsupported GGUF version {version}")
            num_tensors, num_metadata = reader.u64(), reader.u64()
            for _ in range(num_metadata):
                reader.skip(reader.u64())  # key
                reader.value(reader.u32())
            for _ in range(num_tensors):
                reader.skip(reader.u64())  # name
                num_dims = reader.u32()
                if not 1 <= num_dims <= MAX_DIMS:
                    raise reader.corrupt(f"a tensor with {num_dims} dimensions")
                reader.skip(8 * num_dims + 4 + 8)  # dims, type, data offset
    except OSError as exc:
        raise ModelSourceError(f"cannot read {path}: {exc.strerror or exc}") from exc

"""Read a GGUF file's header (metadata and tensor table) with every length checked.

Nothing here trusts the file: a string length, an array count, a dimension count or a tensor's
extent that runs past the end is a one-line ``ModelSourceError`` naming the file, never a crash
or a huge allocation. The tensor data is not read: ``tensor_bytes`` maps it on demand (the file
is memory-mapped, so a 5 GB model costs no memory until a tensor is converted).

We read the header ourselves rather than with gguf-py's ``GGUFReader``: that one builds a numpy
view per metadata item and took ~12 s on a 262k-token vocabulary (Gemma 3), where this takes
~0.3 s. gguf-py stays the source of the type table (``GGML_QUANT_SIZES``) and the dequantizers.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_mlx.platform.errors import ModelSourceError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: the scalar ones as struct formats; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``shape`` is in numpy order (rows last-but-one, the
    contiguous dimension last), the reverse of GGML's ``ne``; ``offset`` is from the file's start."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int


@dataclass
class GGUFFile:
    """A GGUF file's metadata (plain Python values: arrays as lists) and tensor table, with the
    file mapped read-only for ``tensor_bytes``."""

    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor (a read-only view of the mapped file)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        self._map.close()


class _Cursor:
    """Bounds-checked reads from the mapped file."""

    def __init__(self, path: Path, data: mmap.mmap) -> None:
        self.path, self.data, self.pos = path, data, 0

    def corrupt(self, what: str) -> ModelSourceError:
        return ModelSourceError(f"{self.path} is truncated or corrupt ({what})")

    def take(self, n: int) -> int:
        """Advance past ``n`` bytes; return where they start."""
        if n < 0 or self.pos + n > len(self.data):
            raise self.corrupt("the header runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str):
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from("<" + fmt, self.data, start)[0]

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.take(length)
        try:
            return self.data[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt("a string that is not UTF-8") from None

    def value(self, value_type: int, nested: bool = False):
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY and not nested:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:  # one numpy read, not a Python loop
                dtype = np.dtype("<" + _SCALARS[item_type])
                start = self.take(dtype.itemsize * count)
                return np.frombuffer(self.data, dtype=dtype, count=count, offset=start).tolist()
            return [self.value(item_type, nested=True) for _ in range(count)]
        raise self.corrupt(f"unknown metadata value type {value_type}")


def _tensor_nbytes(cursor: _Cursor, name: str, shape: tuple[int, ...], type_id: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except ValueError:
        raise ModelSourceError(f"{cursor.path}: tensor {name!r} has an unknown GGML type {type_id}") from None
    elements = math.prod(shape)  # Python ints: a uint64 product of huge dimensions would wrap to 0
    if shape and shape[-1] % block_size:
        raise cursor.corrupt(f"tensor {name!r}: rows of {shape[-1]} are not whole blocks of {block_size}")
    return elements // block_size * type_size


def _tensor_table(cursor: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    entries = []
    for _ in range(count):
        name = cursor.string()
        num_dims = cursor.scalar("I")
        if not 1 <= num_dims <= MAX_DIMS:
            raise cursor.corrupt(f"a tensor with {num_dims} dimensions")
        dims = [cursor.scalar("Q") for _ in range(num_dims)]
        type_id, offset = cursor.scalar("I"), cursor.scalar("Q")
        entries.append((name, tuple(reversed(dims)), type_id, offset))
    return entries


def _parse(path: Path, data: mmap.mmap) -> GGUFFile:
    cursor = _Cursor(path, data)
    if data[:4] != GGUF_MAGIC:
        raise ModelSourceError(f"{path} is not a GGUF file (bad magic bytes)")
    cursor.take(4)
    version = cursor.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelSourceError(f"{path}: unsupported GGUF version {version}")
    num_tensors, num_metadata = cursor.scalar("Q"), cursor.scalar("Q")
    metadata = {}
    for _ in range(num_metadata):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
    entries = _tensor_table(cursor, num_tensors)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 0:  # a uint32 in the spec; a string crashed int()
        raise cursor.corrupt(f"general.alignment is {alignment!r}")
    alignment = alignment or DEFAULT_ALIGNMENT
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, offset in entries:
        if name in tensors:
            raise cursor.corrupt(f"tensor {name!r} appears twice")
        nbytes = _tensor_nbytes(cursor, name, shape, type_id)
        start = data_start + offset
        if start + nbytes > len(data):
            raise cursor.corrupt(f"tensor {name!r} extends past the end of the file")
        tensors[name] = TensorInfo(name, shape, type_id, start, nbytes)
    return GGUFFile(path, metadata, tensors, data)


def open_gguf(path: Path) -> GGUFFile:
    """Read ``path``'s header; ``ModelSourceError`` for anything but a well-formed GGUF v2/v3."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelSourceError(f"{path} is not a GGUF file (bad magic bytes)")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ModelSourceError(f"GGUF file {path} not found") from None
    except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise ModelSourceError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        return _parse(path, data)
    except BaseException:
        data.close()
        raise

"""Files from outside the process (adapters, KV disk blocks, prefix files, local images), read
whole and checked before use.

The rule (docs/architecture.md, "Files from outside"): a regular file only (a FIFO, a device or a
directory planted under the name is refused at once, never waited on), its size checked against
what the caller may accept before any byte is read, read fully into memory (what is checked is
what is used: a file rewritten in place later changes nothing), then its header checked against
its length before any parser sees it. No MLX here: callers read on their own threads, off the
engine's.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # as the safetensors library's own limit


class OutsideFileError(ValueError):
    """A file that is not what its reader may accept: not a regular file, too large, truncated,
    or a header that disagrees with its length. The message names the file."""


class FileTooLarge(OutsideFileError):
    """A regular file larger than its reader accepts (``size`` bytes, at most ``limit``)."""

    def __init__(self, path, size: int, limit: int) -> None:
        super().__init__(f"{path} holds {size} bytes; at most {limit} are accepted here")
        self.size, self.limit = size, limit


def read_regular_file(path: str | Path, max_bytes: int, follow_links: bool = True) -> bytes:
    """The whole content of the regular file at ``path``, if it holds at most ``max_bytes``.
    Opened without blocking, so a FIFO is refused, not waited on; ``follow_links=False``: a
    symlink at ``path`` (swapped in after the caller resolved it) is refused too.

    Raises:
        FileNotFoundError: Nothing is there (an ``OSError``, as any other failure to open).
        FileTooLarge: Larger than ``max_bytes``, before a byte is read.
        OutsideFileError: Not a regular file, or it changed size while it was read.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise OutsideFileError(f"{path} is a directory, not a file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OutsideFileError(f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise FileTooLarge(path, info.st_size, max_bytes)
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 16 << 20))
            if not chunk:
                raise OutsideFileError(f"{path} was truncated while it was read")
            chunks.append(chunk)
            left -= len(chunk)
        if os.read(fd, 1):
            raise OutsideFileError(f"{path} grew while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header declares it (offsets from the file's start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def safetensors_header(data: bytes, name: str) -> SafetensorsHeader:
    """The header of the safetensors file ``data`` (``name`` for messages), checked against its
    length: every tensor's extent is its shape times its dtype's size, inside the data, and the
    extents tile the data exactly. Nothing is allocated from a declared size.

    Raises:
        OutsideFileError: Truncated, not safetensors, or a header that disagrees with the data.
    """
    if len(data) < 8:
        raise OutsideFileError(f"{name} is truncated (no safetensors header)")
    (length,) = struct.unpack_from("<Q", data)
    if length > min(MAX_HEADER_BYTES, len(data) - 8):
        raise OutsideFileError(f"{name}: its header declares {length} bytes; the file holds {len(data)}")
    try:
        header = json.loads(data[8 : 8 + length])
    except (ValueError, RecursionError):
        raise OutsideFileError(f"{name}: its header is not JSON") from None
    if not isinstance(header, dict):
        raise OutsideFileError(f"{name}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise OutsideFileError(f"{name}: its metadata is not a map of strings")
    base = 8 + length
    tensors = {key: _tensor_entry(name, key, value, base) for key, value in header.items()}
    covered = base
    for entry in sorted(tensors.values(), key=lambda t: t.start):
        if entry.start != covered:
            raise OutsideFileError(f"{name}: tensor {entry.name!r} does not start where the one before it ends")
        covered = entry.end
    if covered != len(data):
        raise OutsideFileError(f"{name}: its tensors declare {covered} bytes; the file holds {len(data)}")
    return SafetensorsHeader(metadata, tensors)


def _tensor_entry(name: str, key: str, value, base: int) -> TensorEntry:
    def bad(what: str) -> OutsideFileError:
        return OutsideFileError(f"{name}: tensor {key!r} {what}")

    if not isinstance(value, dict):
        raise bad("is not described by an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad("has a shape that is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise bad("has no valid data_offsets")
    begin, end = offsets
    if end - begin != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
        raise bad(f"declares {end - begin} bytes for shape {shape} of {dtype}")
    return TensorEntry(key, dtype, tuple(shape), base + begin, base + end)

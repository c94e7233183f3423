"""Prefix files: a prompt's KV blocks, saved by one engine and loaded by another (issue #29).

A prefix file lets a later process (a restarted notebook kernel, a resumed agent) start from a
long prompt's KV instead of computing it again. ``EngineCore.save_prefix`` writes the cached
full blocks of a prompt; ``EngineCore.load_prefix`` reads them into free blocks of the pool and
publishes them under the hashes this engine computes for their tokens, so the next request
with that prompt hits them like any cached prefix.

Format, version 1: one safetensors file (the format the field uses for tensors; no code, and its
header is read before any data). Tensors ``keys.{i}`` and ``values.{i}``, one pair per KV pool
array (a layer), each ``[n_kv_heads, num_blocks * block_size, head_dim]`` in the pool's dtype.
Metadata, all strings:

- ``format``: ``"vllm-mlx-prefix"``; ``version``: ``"1"``;
- ``model_digest``: ``models.digest.model_digest`` of the model that computed the KV;
- ``weight_format``: the engine's (float32 weights give other KV than bfloat16 ones);
- ``block_size``, ``num_blocks``; ``token_ids``: the blocks' tokens, a JSON list;
- ``checksum``: SHA-256 over every tensor's name, dtype, shape and bytes, in name order.

Version 2 (written only for models that need it; version 1 files still load) adds what a model
with sliding-window block groups or recurrent layers needs to resume at the end of the blocks:

- ``groups``: a JSON list of ``[group, first_block]`` for each block group after the first, and
  tensors ``group{g}.keys.{i}``/``group{g}.values.{i}`` holding that group's blocks
  ``first_block .. num_blocks - 1`` (what its window reaches at the end);
- ``state``: ``"1"`` when tensors ``state.{layer}.{i}`` (``[1, ...]``) hold the recurrent state
  after the last block, else ``"0"``.

Read as files from outside are (``platform/outside_files.py``): a regular file no larger than the
loading engine's pool could hold, read whole (``read_prefix_bytes``, no MLX: callers do it off the
engine thread), its safetensors header checked against its length, then its metadata checked (token
ids are ints inside the vocabulary, no more blocks than the pool has) before any array is made;
arrays must be finite.

Never wrong: a file whose format, version, model, weight format, block size, shapes, dtype or
checksum differ is refused as a whole with a ``PrefixFileError`` that says which, and nothing of
it enters the cache. Hashes are not stored: the loading engine hashes the tokens itself (its
model, the caller's ``cache_salt``), so a file cannot make an engine serve blocks under a hash
of its choosing. Writes go to a temporary file beside the target, flushed to disk, then renamed
over it: a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_mlx.platform.atomic_file import write_atomically
from vllm_mlx.platform.outside_files import OutsideFileError, read_regular_file, safetensors_header

FORMAT = "vllm-mlx-prefix"
VERSION = 2
"""The newest version written; every version up to it is read."""
DEFAULT_MAX_BYTES = 16 << 30
"""Without an engine to size it by (``PrefixTransfer.max_file_bytes``): a generous cap."""


class PrefixFileError(ValueError):
    """A prefix file that cannot be used here (unreadable, damaged, or for another model)."""


@dataclass(frozen=True)
class PrefixHeader:
    """What a prefix file says about its blocks (its metadata, parsed)."""

    model_digest: str
    weight_format: str
    block_size: int
    token_ids: list[int]
    checksum: str
    groups: tuple[tuple[int, int], ...] = ()
    """(block group, first block) of each group after the first (version 2)."""
    has_state: bool = False
    """Whether the recurrent state after the last block is in the file (version 2)."""

    @property
    def num_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    @property
    def version(self) -> int:
        """1 unless the file holds block groups or a state (then 2): the oldest that reads it."""
        return 2 if self.groups or self.has_state else 1

    def metadata(self) -> dict[str, str]:
        metadata = {
            "format": FORMAT, "version": str(self.version), "model_digest": self.model_digest,
            "weight_format": self.weight_format, "block_size": str(self.block_size),
            "num_blocks": str(self.num_blocks), "token_ids": json.dumps(self.token_ids), "checksum": self.checksum,
        }  # fmt: skip
        if self.version > 1:
            metadata.update(groups=json.dumps([list(g) for g in self.groups]), state=str(int(self.has_state)))
        return metadata

    @classmethod
    def parse(cls, metadata: dict[str, str]) -> PrefixHeader:
        if metadata.get("format") != FORMAT:
            raise PrefixFileError(f"not a prefix file (format {metadata.get('format')!r}, expected {FORMAT!r})")
        if metadata.get("version") not in [str(v) for v in range(1, VERSION + 1)]:
            raise PrefixFileError(f"prefix file version {metadata.get('version')!r}; this vllm-mlx reads 1 to {VERSION}")
        try:
            header = cls(
                metadata["model_digest"], metadata["weight_format"], int(metadata["block_size"]),
                _token_ids(json.loads(metadata["token_ids"])), metadata["checksum"],
                tuple((int(g), int(first)) for g, first in json.loads(metadata.get("groups", "[]"))),
                metadata.get("state", "0") == "1",
            )  # fmt: skip
            num_blocks = int(metadata["num_blocks"])
        except (KeyError, ValueError, TypeError, RecursionError) as exc:
            raise PrefixFileError(f"damaged prefix file header: {str(exc)[:200]!r}") from None
        if header.block_size < 1 or len(header.token_ids) != num_blocks * header.block_size:
            raise PrefixFileError(f"damaged prefix file header: {len(header.token_ids)} tokens for {num_blocks} blocks")
        if any(not 0 <= first < num_blocks for _, first in header.groups):
            raise PrefixFileError(f"damaged prefix file header: block groups {header.groups} for {num_blocks} blocks")
        return header

    def slots_of(self, name: str) -> int | None:
        """How many token slots tensor ``name`` holds (None: a state tensor, any shape)."""
        if name.startswith("state."):
            return None
        if name.startswith("group"):
            group = int(name[len("group") : name.index(".")])
            first = dict(self.groups).get(group)
            return -1 if first is None else (self.num_blocks - first) * self.block_size
        return len(self.token_ids)


def checksum(arrays: dict[str, mx.array]) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}\0{array.dtype}\0{tuple(array.shape)}\0".encode())
        digest.update(np.array(array.view(mx.uint8)).tobytes())  # bytes of any dtype, bfloat16 too
    return digest.hexdigest()


def write_prefix_file(path: Path, header: PrefixHeader, arrays: dict[str, mx.array]) -> None:
    """Write ``arrays`` and ``header`` to ``path`` atomically (a temporary file beside it, flushed,
    then renamed over it). On any failure the temporary file is removed and ``path`` untouched.

    Raises:
        OSError: the folder is missing or not writable, the disk is full, or ``path`` is a folder.
    """

    def save(temporary: Path) -> None:
        try:
            mx.save_safetensors(str(temporary), arrays, metadata=header.metadata())
        except RuntimeError as exc:  # MLX's way of saying it could not open or write the file
            raise OSError(f"cannot write prefix file {path}: {exc}") from None

    write_atomically(Path(path), save, suffix=".safetensors")


def _token_ids(value) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError("token_ids is not a list of non-negative integers")
    return value


def read_prefix_bytes(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The prefix file at ``path``, read whole (no MLX: any thread).

    Raises:
        PrefixFileError: Missing, not a regular file, or larger than ``max_bytes``.
    """
    try:
        return read_regular_file(path, max_bytes)
    except (OSError, ValueError) as exc:  # OutsideFileError is a ValueError
        raise PrefixFileError(f"cannot read prefix file {path}: {exc}") from None


def read_prefix_file(
    path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, check: Callable[[PrefixHeader], None] | None = None
) -> tuple[PrefixHeader, dict[str, mx.array]]:
    """``parse_prefix_file`` of the file at ``path`` (read whole first)."""
    return parse_prefix_file(read_prefix_bytes(path, max_bytes), str(path), check)


def parse_prefix_file(
    data: bytes, name: str, check: Callable[[PrefixHeader], None] | None = None
) -> tuple[PrefixHeader, dict[str, mx.array]]:
    """The header and arrays of a prefix file's bytes, checked in order: the safetensors header
    against the length, the metadata, ``check(header)`` (the loading engine's: its model, its
    vocabulary, its pool), the tensors it declares against the header, and only then the arrays
    (made from the bytes in hand), against the checksum and for finite values.

    Raises:
        PrefixFileError: Truncated, not a prefix file, of another version, a header that
            disagrees with its arrays, arrays that differ from its checksum or are not finite.
    """
    try:
        layout = safetensors_header(data, f"prefix file {name}")
    except OutsideFileError as exc:
        raise PrefixFileError(str(exc)) from None
    header = PrefixHeader.parse(layout.metadata)
    if check is not None:
        check(header)
    try:
        shapes_ok = all(_fits(header.slots_of(t.name), t.shape) for t in layout.tensors.values())
    except ValueError:  # a tensor name that is not ours
        shapes_ok = False
    has_state = any(t.startswith("state.") for t in layout.tensors)
    if not layout.tensors or not shapes_ok or has_state != header.has_state:
        raise PrefixFileError(f"prefix file {name} is damaged: its arrays do not hold the token slots its header says")
    try:
        arrays = mx.load(io.BytesIO(data), format="safetensors")
        mx.eval(arrays)
    except (RuntimeError, ValueError) as exc:
        raise PrefixFileError(f"cannot read prefix file {name}: {exc}") from None
    if checksum(arrays) != header.checksum:
        raise PrefixFileError(f"prefix file {name} is damaged: its arrays do not match its checksum")
    if not all(mx.all(mx.isfinite(a)).item() for a in arrays.values() if mx.issubdtype(a.dtype, mx.floating)):
        raise PrefixFileError(f"prefix file {name} holds values that are not finite (NaN or infinity)")
    return header, arrays


def _fits(slots: int | None, shape: tuple[int, ...]) -> bool:
    """A KV tensor holds ``slots`` token slots (``[heads, slots, head_dim]``); a state any shape."""
    return len(shape) >= 1 if slots is None else len(shape) == 3 and shape[1] == slots

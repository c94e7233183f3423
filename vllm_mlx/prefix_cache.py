"""Automatic prefix caching: content hashes of full KV blocks.

A block's hash names the KV it holds. The KV of token ``i`` depends on every token before it,
so a block's hash chains its parent block's hash (the whole prefix), then its own token ids, then
*extra keys*: whatever else changes the KV or must keep caches apart (model identity / cache
namespace, the request's cache salt, later the content hashes of images inside the block).

Hence **equal hash ⇒ equal KV**: the same tokens after a different prefix, under a different
model or salt, hash differently and never share a block. Hashes use sha256 over a fixed byte
encoding — never Python's ``hash()``, which is salted per process and collides easily.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "compute_block_hashes", "hash_block"]

ROOT_HASH = bytes(32)
"""Parent of a request's first block (sha256-sized, all zeros)."""


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """sha256 of (parent hash or ``ROOT_HASH``, token ids as little-endian int64, extra keys).

    ``extra_keys`` is a tuple of None / bool / int / str / bytes / nested tuples, encoded
    canonically (type-tagged, length-prefixed), so ``("a", 1)`` and ``("a1",)`` differ.
    """
    tokens = array("q", token_ids)  # OverflowError/TypeError on non-int64 ids
    if sys.byteorder != "little":
        tokens.byteswap()
    digest = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens.tobytes())
    digest.update(_encode_key(tuple(extra_keys)))
    return digest.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    existing: list[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block has none).

    With ``existing`` (hashes of this same token sequence's first blocks, same ``extra_keys``),
    only the blocks after them are hashed: ``existing`` is extended in place and returned, so a
    growing request pays for each block once.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = [] if existing is None else existing
    num_full = len(token_ids) // block_size
    if len(hashes) > num_full:
        raise ValueError(f"{len(hashes)} existing hashes but only {num_full} full blocks")
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes


def _encode_key(key: object) -> bytes:
    """Canonical, unambiguous bytes for an extra key (tag + length + payload)."""
    if key is None:
        return b"N"
    if isinstance(key, bool):  # before int: bool is an int subclass
        return b"T" if key else b"F"
    if isinstance(key, int):
        return b"I" + str(key).encode() + b";"
    if isinstance(key, str):
        key = key.encode("utf-8")
        return b"S" + str(len(key)).encode() + b":" + key
    if isinstance(key, (bytes, bytearray)):
        return b"B" + str(len(key)).encode() + b":" + bytes(key)
    if isinstance(key, tuple):
        return b"(" + b"".join(_encode_key(k) for k in key) + b")"
    raise TypeError(f"extra keys must be None/bool/int/str/bytes/tuple, got {type(key).__name__}")

"""Canonical bytes for plain data, the input of every content hash we compute.

Type-tagged and length-prefixed, so different values never share an encoding: ``("a", 1)`` and
``("a1",)`` differ, ``1`` and ``"1"`` and ``True`` differ. Block-hash extra keys use the strict
form (None, bool, int, str, bytes, tuples: identities, never measurements); image processor
settings also need floats, lists and dicts with string keys (``extended=True``).
"""

from __future__ import annotations


def canonical_bytes(key: object, *, extended: bool = False) -> bytes:
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
    if isinstance(key, tuple) or (extended and isinstance(key, list)):
        return b"(" + b"".join(canonical_bytes(k, extended=extended) for k in key) + b")"
    if extended and isinstance(key, float):
        return b"D" + key.hex().encode() + b";"
    if extended and isinstance(key, dict) and all(isinstance(k, str) for k in key):
        return b"{" + b"".join(canonical_bytes(k) + canonical_bytes(key[k], extended=True) for k in sorted(key)) + b"}"
    allowed = "plain data" if extended else "None/bool/int/str/bytes/tuple"
    raise TypeError(f"keys must be {allowed}, got {type(key).__name__}")

"""Block hashing for prefix caching: equal hash must mean equal KV."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.prefix_cache import ROOT_HASH, compute_block_hashes, hash_block


def test_hash_is_deterministic_sha256_of_a_fixed_encoding():
    tokens = [1, 2, 3, -4]
    expected = hashlib.sha256(
        ROOT_HASH + struct.pack("<q", 4) + struct.pack("<4q", *tokens) + b"()"
    ).digest()
    assert hash_block(None, tokens) == expected
    assert hash_block(None, tuple(tokens)) == expected  # any sequence of ints
    assert len(expected) == 32


def test_root_parent_is_the_zero_hash():
    assert hash_block(None, [5, 6]) == hash_block(bytes(32), [5, 6])


def test_chaining_same_tokens_after_different_parent_differ():
    a = hash_block(None, [1, 2])
    c = hash_block(None, [3, 4])
    assert hash_block(a, [7, 8]) != hash_block(c, [7, 8])
    assert hash_block(a, [7, 8]) != hash_block(None, [7, 8])


def test_token_order_and_boundaries_matter():
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])
    assert hash_block(None, [256]) != hash_block(None, [1, 0])


def test_extra_keys_separate_and_are_canonical():
    base = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2], ("model-a", None)) != base
    assert hash_block(None, [1, 2], ("model-a", None)) != hash_block(None, [1, 2], ("model-b", None))
    assert hash_block(None, [1, 2], ("", "salt")) != hash_block(None, [1, 2], ("", None))
    assert hash_block(None, [1, 2], ("", "")) != hash_block(None, [1, 2], ("", None))
    assert hash_block(None, [1, 2], ("a", 1)) != hash_block(None, [1, 2], ("a1",))
    assert hash_block(None, [1, 2], ("1",)) != hash_block(None, [1, 2], (1,))
    assert hash_block(None, [1, 2], (b"x",)) != hash_block(None, [1, 2], ("x",))
    assert hash_block(None, [1, 2], (("a", "b"),)) != hash_block(None, [1, 2], ("a", "b"))
    assert hash_block(None, [1, 2], ("m", "s")) == hash_block(None, [1, 2], ("m", "s"))


def test_extra_keys_reject_unhashable_kinds():
    with pytest.raises(TypeError):
        hash_block(None, [1], (1.5,))
    with pytest.raises(TypeError):
        hash_block(None, [1], ({"a": 1},))


def test_only_full_blocks_are_hashed():
    assert compute_block_hashes([1, 2, 3], 4) == []
    assert len(compute_block_hashes(list(range(4)), 4)) == 1
    assert len(compute_block_hashes(list(range(11)), 4)) == 2
    assert len(compute_block_hashes(list(range(12)), 4)) == 3


def test_block_hashes_chain_their_parents():
    tokens = list(range(8))
    h0, h1 = compute_block_hashes(tokens, 4, ("ns", None))
    assert h0 == hash_block(None, tokens[:4], ("ns", None))
    assert h1 == hash_block(h0, tokens[4:], ("ns", None))


def test_incremental_extension_reuses_existing_and_matches_full():
    tokens = list(range(30))
    existing = compute_block_hashes(tokens[:9], 4, ("m",))
    first_two = list(existing)
    result = compute_block_hashes(tokens, 4, ("m",), existing)
    assert result is existing  # extended in place
    assert result[:2] == first_two
    assert result == compute_block_hashes(tokens, 4, ("m",))


def test_incremental_extension_does_not_recompute_old_blocks():
    # A sentinel "old" hash proves the old entries are taken as given, not recomputed.
    fake = [b"\x01" * 32]
    result = compute_block_hashes([9, 9, 9, 9, 5, 5, 5, 5], 4, (), fake)
    assert result == [b"\x01" * 32, hash_block(b"\x01" * 32, [5, 5, 5, 5])]


def test_existing_longer_than_full_blocks_is_an_error():
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2, 3, 4], 4, (), [b"a" * 32, b"b" * 32])
    with pytest.raises(ValueError):
        compute_block_hashes([1], 0)


@given(
    tokens=st.lists(st.integers(0, 5), max_size=40),
    split=st.integers(0, 40),
    block_size=st.integers(1, 6),
)
def test_incremental_equals_full_property(tokens, split, block_size):
    prefix = compute_block_hashes(tokens[:split], block_size)
    assert compute_block_hashes(tokens, block_size, (), prefix) == compute_block_hashes(
        tokens, block_size
    )


def test_cache_contamination_case_hits_a_but_not_d():
    """[A,B] and [C,D] cached, then [A,D]: block A is reused, block D (after C) is not."""
    bs = 4
    A, B, C, D = [1] * bs, [2] * bs, [3] * bs, [4] * bs
    mgr = PagedCacheManager(16, bs)
    for rid, tokens in (("ab", A + B), ("cd", C + D)):
        hashes = compute_block_hashes(tokens, bs)
        assert mgr.allocate_slots(rid, len(tokens)) is not None
        mgr.cache_full_blocks(rid, hashes, tokens, 2)
    ad = compute_block_hashes(A + D, bs)
    hits = mgr.get_computed_blocks("ad", ad)
    assert [b.block_id for b in hits] == mgr.get_block_ids("ab")[:1]
    assert ad[1] != compute_block_hashes(C + D, bs)[1]

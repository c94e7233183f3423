"""Blocks entering the pool from a prefix file (``KVCacheCoordinator.reserve_import`` and
``finish_import``), as a data structure: exact block ids, no model."""

from __future__ import annotations

import pytest

from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.prefix_cache import compute_block_hashes

TOKENS = list(range(100, 116))  # 4 blocks of 4
HASHES = compute_block_hashes(TOKENS, 4, ("model", None))


def test_new_blocks_are_published_cached_free_and_cached_ones_are_only_held():
    kv = PagedCacheManager(8, block_size=4)
    first = kv.reserve_import(HASHES[:2])
    assert first.block_ids == [1, 2] and first.held == []
    assert kv.finish_import(first, HASHES[:2], TOKENS[:8], succeeded=True) == 2
    reserved = kv.reserve_import(HASHES)
    assert [b.block_id for b in reserved.held] == [1, 2] and reserved.block_ids == [3, 4]
    assert all(b.ref_cnt == 1 for b in reserved.held)  # held: a take cannot evict them meanwhile
    assert kv.finish_import(reserved, HASHES, TOKENS, succeeded=True) == 2
    assert [b.block_id for b in kv.get_computed_blocks("", HASHES)] == [1, 2, 3, 4]
    assert kv.pool.cached[0][HASHES[3]].token_ids == tuple(TOKENS[12:16])
    assert kv.stats().num_used_blocks == 0  # every imported block is cached-free
    kv.check_invariants()


def test_a_failed_import_gives_its_blocks_back_blank():
    kv = PagedCacheManager(8, block_size=4)
    reserved = kv.reserve_import(HASHES)
    assert kv.finish_import(reserved, HASHES, TOKENS, succeeded=False) == 0
    assert kv.pool.num_cached_blocks() == 0 and kv.stats().num_used_blocks == 0
    kv.check_invariants()


def test_a_full_pool_imports_the_head_of_the_chain_only():
    kv = PagedCacheManager(4, block_size=4)  # 3 usable blocks for a chain of 4
    reserved = kv.reserve_import(HASHES)
    assert reserved.block_ids == [1, 2, 3]
    kv.finish_import(reserved, HASHES, TOKENS, succeeded=True)
    assert len(kv.get_computed_blocks("", HASHES)) == 3
    kv.check_invariants()


def test_refused_without_caching_or_for_recurrent_state():
    with pytest.raises(ValueError, match="prefix caching is off"):
        PagedCacheManager(8, block_size=4, enable_caching=False).reserve_import(HASHES)
    with pytest.raises(ValueError, match="recurrent layers"):
        PagedCacheManager(8, block_size=4, num_state_slots=2).reserve_import(HASHES)


def test_a_hybrid_import_brings_the_state_checkpoint_of_its_last_block():
    kv = PagedCacheManager(8, block_size=4, num_state_slots=2, num_state_checkpoints=2)
    with pytest.raises(ValueError, match="as a checkpoint"):
        kv.reserve_import(HASHES)  # blocks alone resume nothing
    failed = kv.reserve_import(HASHES, checkpoint=True)
    assert failed.checkpoint_slot == 2  # after the running slots (the null one and one request's)
    kv.finish_import(failed, HASHES, TOKENS, succeeded=False)
    assert kv.get_computed_blocks("", HASHES) == [] and len(kv.state.checkpoints) == 0
    reserved = kv.reserve_import(HASHES, checkpoint=True)
    kv.finish_import(reserved, HASHES, TOKENS, succeeded=True)
    assert [b.block_id for b in kv.get_computed_blocks("", HASHES)] == reserved.block_ids
    assert kv.state.checkpoints.slot_of(HASHES[-1]) == reserved.checkpoint_slot
    kv.check_invariants()


def test_block_groups_import_the_positions_asked_for():
    kv = PagedCacheManager(16, block_size=4, group_windows=(None, 4))  # a hit's window: its last block
    positions = [(i, 0) for i in range(4)] + [(3, 1)]
    reserved = kv.reserve_import(HASHES, positions)
    assert [(t.index, t.group) for t in reserved.taken] == positions
    kv.finish_import(reserved, HASHES, TOKENS, succeeded=True)
    assert kv.pool.cached[1][HASHES[3]].group == 1
    assert len(kv.get_computed_blocks("", HASHES)) == 4  # group 1 has what its window reaches
    assert kv.get_computed_blocks("", HASHES[:3]) == []  # group 1 has none of blocks 0-2
    kv.check_invariants()

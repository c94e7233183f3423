"""Block groups: which layers share a block table and KV arrays, and the KV manager keeping one
table per group over one pool, a sliding-window group holding only what its window reaches.
(Engine-level oracles, engine == mlx-lm while window blocks go back to the pool, are in
test_sliding_window.py.)"""

from __future__ import annotations

import pytest

from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.spec import BlockGroup, BlockGroups, FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, plan_block_groups

FULL, SWA, STATE = FullAttentionSpec(), SlidingWindowSpec(8), RecurrentStateSpec(2, pads=True)


def test_groups_are_equal_chunks_of_each_kind_full_attention_first():
    specs = [SWA, SWA, FULL, SWA, SWA, FULL, SWA]  # 5 sliding : 2 full -> groups of 2
    plan = plan_block_groups(specs, uniform_layers=True)
    assert plan.groups == (
        BlockGroup(None, (2, 5)), BlockGroup(8, (0, 1)), BlockGroup(8, (3, 4)), BlockGroup(8, (6,))
    )  # fmt: skip
    assert plan.num_arrays == 2 and plan.array_of_layer == {2: 0, 5: 1, 0: 0, 1: 1, 3: 0, 4: 1, 6: 0}
    assert plan.group_of_layer(4) == 2


@pytest.mark.parametrize(
    "specs,uniform",
    [([SWA, FULL], False), ([FULL, FULL], True), ([SWA, SWA], True), ([STATE, FULL, STATE, FULL], True)],
    ids=["shapes-differ", "all-full", "all-sliding", "hybrid-recurrent"],
)
def test_one_group_keeping_every_block_when_groups_save_nothing(specs, uniform):
    plan = plan_block_groups(specs, uniform)
    attention = tuple(i for i, s in enumerate(specs) if s != STATE)
    assert plan == BlockGroups.single(specs) and plan.groups == (BlockGroup(None, attention),)
    assert plan.array_of_layer == {i: i for i in attention}  # one array per layer, as before


def two_groups(num_blocks: int = 20) -> PagedCacheManager:
    return PagedCacheManager(num_blocks=num_blocks, block_size=4, group_windows=(None, 8))


def test_a_sliding_table_drops_the_blocks_its_window_no_longer_reaches():
    kv = two_groups()
    kv.allocate_slots("a", 16)
    full, sliding = kv.get_block_tables("a")
    assert len(full) == len(sliding) == 4 and not set(full) & set(sliding)
    free_before = kv.get_num_free_blocks()
    # A query at position 16 sees keys 9..16: blocks 0 and 1 (positions 0..7) are out of reach.
    assert kv.free_out_of_window("a", 16) == 2 and kv.get_num_free_blocks() == free_before + 2
    assert kv.get_block_tables("a") == [full, [0, 0, *sliding[2:]]]
    kv.allocate_slots("a", 20)  # grows both tables by one block
    assert [len(t) for t in kv.get_block_tables("a")] == [5, 5]
    kv.check_invariants()
    kv.free("a")
    assert kv.stats().num_used_blocks == 0
    kv.check_invariants()


def test_a_hit_needs_only_the_window_blocks_of_a_sliding_group():
    kv = two_groups(num_blocks=21)  # 20 usable
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    kv.allocate_slots("a", 16)
    kv.cache_full_blocks("a", hashes, list(range(16)), num_full_blocks=4)
    kv.free_out_of_window("a", 16)  # its sliding blocks of h0 and h1 are free (still cached)
    kv.free("a")
    # The free queue: 12 never used, sliding h0, h1, then a's other blocks, tails first.
    kv.allocate_slots("big", 7 * 4)  # 7 blocks in each group: evicts sliding h0 and h1
    hits = kv.get_computed_blocks("b", hashes)
    assert [b.block_hash for b in hits] == hashes  # the window at 16 reaches sliding h2, h3 only
    kv.allocate_slots("b", 16, hits)
    assert kv.get_block_tables("b")[1][:2] == [0, 0]
    kv.check_invariants()
    kv.free("b")
    kv.allocate_slots("c", 4)  # evicts the blocks of h3 (b's tail) in both groups
    # 3 blocks would need sliding h1 and h2, 2 or 1 would need h0: no hit at all.
    assert kv.get_computed_blocks("d", hashes) == []
    kv.check_invariants()


def test_capacity_counts_every_block_of_full_groups_and_a_window_of_sliding_ones():
    kv = two_groups(num_blocks=41)  # 40 usable
    # With 16-token steps a sliding table reaches ceil((8 - 1 + 16) / 4) + 1 = 7 blocks.
    assert kv.token_capacity(max_step_tokens=16) == (40 - 7) * 4
    assert kv.token_capacity(max_step_tokens=4096) == 20 * 4  # steps as long as the sequence
    assert PagedCacheManager(num_blocks=41, block_size=4).token_capacity(16) == 160
    with pytest.raises(ValueError, match="first block group must keep every block"):
        PagedCacheManager(num_blocks=8, block_size=4, group_windows=(8, None))

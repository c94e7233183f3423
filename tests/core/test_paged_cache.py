"""Block accounting of the paged KV cache: exact ids, exact free-queue order, and property tests."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_mlx.core.kv.paged_cache import (
    BlockTable,
    CacheBlock,
    CacheStats,
    FreeBlockQueue,
    PagedCacheManager,
)


def chain_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hash of each full block, chaining the parent hash like the real prefix cache does."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + repr(block).encode()).digest()
        hashes.append(parent)
    return hashes


def run_and_cache(mgr: PagedCacheManager, rid: str, tokens: list[int]) -> list[int] | None:
    """Admit a request the way the scheduler does: look up hits, allocate, register full blocks."""
    hashes = chain_hashes(tokens, mgr.block_size)
    computed = mgr.get_computed_blocks(rid, hashes)
    new = mgr.allocate_slots(rid, len(tokens), computed)
    if new is not None:
        mgr.cache_full_blocks(rid, hashes, tokens, len(tokens) // mgr.block_size)
    mgr.check_invariants()
    return new


def queue_ids(mgr: PagedCacheManager) -> list[int]:
    return mgr.snapshot()["free_queue"]


# ---- construction -------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks,block_size", [(1, 16), (0, 16), (8, 0)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        PagedCacheManager(num_blocks, block_size)


def test_fresh_manager_reserves_null_block():
    mgr = PagedCacheManager(8, block_size=4)
    assert mgr.get_num_free_blocks() == 7
    assert queue_ids(mgr) == [1, 2, 3, 4, 5, 6, 7]
    assert mgr.null_block.block_id == 0 and mgr.null_block.is_null
    stats = mgr.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.usage) == (7, 0, 0.0)
    assert mgr.snapshot()["blocks"][0]["state"] == "null"
    mgr.check_invariants()


# ---- allocation and free order -------------------------------------------------------------


def test_allocates_in_ascending_order_and_frees_in_reverse():
    mgr = PagedCacheManager(8, block_size=4)
    assert mgr.allocate_slots("a", 10) == [1, 2, 3]
    assert mgr.allocate_slots("b", 5) == [4, 5]
    assert queue_ids(mgr) == [6, 7]
    mgr.check_invariants()

    mgr.free("a")
    # Tail block 3 first: it is evicted before the head block 1.
    assert queue_ids(mgr) == [6, 7, 3, 2, 1]
    mgr.free("b")
    assert queue_ids(mgr) == [6, 7, 3, 2, 1, 5, 4]
    assert mgr.allocate_slots("c", 9) == [6, 7, 3]
    stats = mgr.stats()
    assert (stats.allocations, stats.frees, stats.evictions) == (8, 5, 0)
    mgr.check_invariants()


def test_grow_appends_only_missing_blocks():
    mgr = PagedCacheManager(8, block_size=4)
    assert mgr.allocate_slots("a", 3) == [1]
    assert mgr.allocate_slots("a", 4) == []
    assert mgr.allocate_slots("a", 5) == [2]
    assert mgr.allocate_slots("a", 2) == []  # never shrinks
    assert mgr.get_block_ids("a") == [1, 2]
    blocks = {b["id"]: b for b in mgr.snapshot()["blocks"]}
    assert (blocks[1]["num_tokens"], blocks[2]["num_tokens"]) == (4, 1)
    mgr.check_invariants()


def test_block_table_slots():
    mgr = PagedCacheManager(8, block_size=4)
    mgr.allocate_slots("x", 4)
    mgr.allocate_slots("a", 6)  # blocks 2, 3
    table = mgr.get_block_table("a")
    assert table == BlockTable([2, 3], 4)
    assert table.num_blocks == 2
    assert table.slot(0) == 8 and table.slot(3) == 11 and table.slot(4) == 12
    assert table.slots(2, 6) == [10, 11, 12, 13]
    with pytest.raises(IndexError):
        table.slot(8)
    assert mgr.get_block_table("missing") == BlockTable([], 4)


def test_allocate_returns_none_and_changes_nothing_when_short():
    mgr = PagedCacheManager(4, block_size=2)
    assert mgr.allocate_slots("a", 4) == [1, 2]
    before = mgr.snapshot()
    assert mgr.allocate_slots("a", 7) is None  # needs 2 more, only 1 free
    assert mgr.allocate_slots("b", 5) is None
    assert mgr.snapshot() == before
    assert "b" not in mgr.snapshot()["requests"]
    mgr.check_invariants()


def test_free_unknown_request_is_noop():
    mgr = PagedCacheManager(4, block_size=2)
    mgr.allocate_slots("a", 3)
    before = mgr.snapshot()
    mgr.free("nope")
    mgr.free("a")
    after_first = mgr.snapshot()
    mgr.free("a")  # double free is a no-op too
    assert mgr.snapshot() == after_first
    assert before != after_first
    mgr.check_invariants()


# ---- prefix caching ------------------------------------------------------------------------


def test_cached_free_block_is_revived_from_the_middle_of_the_queue():
    mgr = PagedCacheManager(8, block_size=2)
    prompt = [10, 11, 12, 13, 14, 15]
    assert run_and_cache(mgr, "a", prompt) == [1, 2, 3]
    mgr.free("a")
    assert queue_ids(mgr) == [4, 5, 6, 7, 3, 2, 1]
    stats = mgr.stats()
    assert (stats.num_cached_free_blocks, stats.num_free_blocks, stats.num_used_blocks) == (3, 7, 0)

    # Same first two blocks, different third: hits on blocks 1 and 2, new block from the head.
    hashes = chain_hashes([10, 11, 12, 13, 99, 98], 2)
    computed = mgr.get_computed_blocks("b", hashes)
    assert [b.block_id for b in computed] == [1, 2]
    assert all(b.ref_cnt == 0 for b in computed)  # lookup does not touch ref counts
    assert mgr.allocate_slots("b", 6, computed) == [4]
    assert mgr.get_block_ids("b") == [1, 2, 4]
    assert queue_ids(mgr) == [5, 6, 7, 3]
    assert mgr.get_num_cached_tokens("b") == 4
    assert [mgr.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    mgr.check_invariants()


def test_shared_block_needs_every_owner_to_free_it():
    mgr = PagedCacheManager(8, block_size=2)
    run_and_cache(mgr, "a", [1, 2, 3, 4])
    assert run_and_cache(mgr, "b", [1, 2, 3, 4, 5]) == [3]
    assert mgr.get_block_ids("b") == [1, 2, 3]
    assert mgr.blocks[1].ref_cnt == 2
    snap = {b["id"]: b for b in mgr.snapshot()["blocks"]}
    assert snap[1]["owners"] == ["a", "b"] and snap[3]["owners"] == ["b"]
    mgr.free("a")
    assert queue_ids(mgr) == [4, 5, 6, 7]  # blocks 1, 2 still used by b
    mgr.free("b")
    assert queue_ids(mgr) == [4, 5, 6, 7, 3, 2, 1]
    mgr.check_invariants()


def test_eviction_pops_lru_head_and_clears_its_hash():
    mgr = PagedCacheManager(4, block_size=2)
    run_and_cache(mgr, "a", [1, 2, 3, 4])
    mgr.free("a")
    assert queue_ids(mgr) == [3, 2, 1]
    h0, h1 = chain_hashes([1, 2, 3, 4], 2)
    assert mgr.allocate_slots("b", 4) == [3, 2]  # 3 is plain free, 2 held h1
    assert mgr.blocks[2].block_hash is None and mgr.blocks[2].token_ids is None
    assert h1 not in mgr.cached_blocks and mgr.cached_blocks[h0] is mgr.blocks[1]
    assert mgr.stats().evictions == 1
    # The surviving head block still hits; the evicted tail does not.
    assert [b.block_id for b in mgr.get_computed_blocks("c", [h0, h1])] == [1]
    mgr.check_invariants()


def test_all_or_nothing_counts_revived_blocks():
    mgr = PagedCacheManager(4, block_size=2)
    run_and_cache(mgr, "a", [1, 2, 3, 4])
    mgr.free("a")
    computed = mgr.get_computed_blocks("b", chain_hashes([1, 2, 3, 4], 2))
    before = mgr.snapshot()
    # 2 revived + 2 new = 4 > 3 free blocks.
    assert mgr.allocate_slots("b", 8, computed) is None
    assert mgr.snapshot() == before
    assert mgr.allocate_slots("b", 6, computed) == [3]
    assert mgr.get_block_ids("b") == [1, 2, 3] and mgr.get_num_free_blocks() == 0
    mgr.check_invariants()


def test_duplicate_content_keeps_first_mapping():
    mgr = PagedCacheManager(8, block_size=2)
    tokens = [7, 8, 9]
    hashes = chain_hashes(tokens, 2)
    assert mgr.allocate_slots("a", 3) == [1, 2]
    assert mgr.allocate_slots("b", 3) == [3, 4]  # admitted before a's blocks were registered
    mgr.cache_full_blocks("a", hashes, tokens, 1)
    mgr.cache_full_blocks("b", hashes, tokens, 1)
    assert mgr.cached_blocks[hashes[0]] is mgr.blocks[1]
    assert mgr.blocks[3].block_hash is None
    assert mgr.blocks[1].token_ids == (7, 8)
    mgr.free("b")
    assert queue_ids(mgr) == [5, 6, 7, 4, 3]
    assert mgr.stats().num_cached_free_blocks == 0
    mgr.check_invariants()


def test_cache_full_blocks_validates_arguments():
    mgr = PagedCacheManager(8, block_size=2)
    mgr.allocate_slots("a", 4)
    with pytest.raises(KeyError):
        mgr.cache_full_blocks("zz", [b"x"], [1, 2], 1)
    with pytest.raises(ValueError):
        mgr.cache_full_blocks("a", [b"x"], [1, 2, 3, 4], 2)
    with pytest.raises(ValueError):
        mgr.cache_full_blocks("a", [b"x", b"y"], [1, 2, 3], 2)


def test_computed_blocks_only_on_first_allocation():
    mgr = PagedCacheManager(8, block_size=2)
    run_and_cache(mgr, "a", [1, 2])
    computed = mgr.get_computed_blocks("b", chain_hashes([1, 2], 2))
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", 6, computed)  # a already has a table
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", 4, computed + computed)
    mgr.check_invariants()


def test_reset_prefix_cache_keeps_hashes_of_used_blocks():
    mgr = PagedCacheManager(8, block_size=2)
    run_and_cache(mgr, "a", [1, 2, 3, 4])  # blocks 1, 2
    run_and_cache(mgr, "b", [5, 6, 7, 8])  # blocks 3, 4
    mgr.free("b")
    order = queue_ids(mgr)
    assert order == [5, 6, 7, 4, 3]
    assert mgr.reset_prefix_cache() is True
    assert queue_ids(mgr) == order
    assert mgr.blocks[3].block_hash is None and mgr.blocks[4].block_hash is None
    assert mgr.blocks[1].block_hash is not None and mgr.blocks[2].block_hash is not None
    assert set(mgr.cached_blocks.values()) == {mgr.blocks[1], mgr.blocks[2]}
    assert mgr.get_computed_blocks("c", chain_hashes([5, 6, 7, 8], 2)) == []
    assert len(mgr.get_computed_blocks("c", chain_hashes([1, 2, 3, 4], 2))) == 2
    mgr.check_invariants()


def test_caching_disabled_never_hits():
    mgr = PagedCacheManager(8, block_size=2, enable_caching=False)
    tokens = [1, 2, 3, 4]
    run_and_cache(mgr, "a", tokens)
    assert mgr.cached_blocks == {}
    mgr.free("a")
    assert mgr.get_computed_blocks("b", chain_hashes(tokens, 2)) == []
    assert mgr.stats().num_cached_free_blocks == 0


# ---- observation ---------------------------------------------------------------------------


def test_snapshot_is_plain_data():
    mgr = PagedCacheManager(6, block_size=2)
    run_and_cache(mgr, "a", [1, 2, 3])  # blocks 1 (hashed, full), 2 (partial)
    run_and_cache(mgr, "b", [4, 5])  # block 3
    mgr.free("b")
    mgr.record_prefix_query(5, 2)
    snap = mgr.snapshot()
    states = [(b["id"], b["state"], b["ref_cnt"]) for b in snap["blocks"]]
    assert states == [
        (0, "null", 0), (1, "used", 1), (2, "used", 1), (3, "cached", 0), (4, "free", 0),
        (5, "free", 0),
    ]
    b1, b2 = snap["blocks"][1], snap["blocks"][2]
    assert b1["owners"] == ["a"] and b1["token_ids"] == [1, 2] and b1["num_tokens"] == 2
    assert b1["hash"] == chain_hashes([1, 2], 2)[0].hex()[:12]
    assert b2["hash"] is None and b2["token_ids"] is None and b2["num_tokens"] == 1
    assert snap["requests"] == {"a": [1, 2]}
    assert snap["free_queue"] == [4, 5, 3]
    stats = snap["stats"]
    assert stats["num_used_blocks"] == 2 and stats["num_cached_free_blocks"] == 1
    assert stats["num_free_blocks"] == 3 and stats["usage"] == pytest.approx(0.4)
    assert (stats["prefix_queries"], stats["prefix_hits"]) == (5, 2)
    assert isinstance(mgr.stats(), CacheStats)


def test_check_invariants_catches_corruption():
    mgr = PagedCacheManager(4, block_size=2)
    mgr.allocate_slots("a", 2)
    mgr.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError):
        mgr.check_invariants()
    mgr.blocks[1].ref_cnt = 1
    mgr.blocks[2].block_hash = b"orphan"
    with pytest.raises(AssertionError):
        mgr.check_invariants()
    mgr.blocks[2].block_hash = None
    mgr.check_invariants()
    mgr.free_queue.remove(mgr.blocks[3])  # a free block that no table owns
    with pytest.raises(AssertionError):
        mgr.check_invariants()


def test_free_block_queue_operations():
    blocks = [CacheBlock(block_id=i) for i in range(5)]
    q = FreeBlockQueue(blocks[1:4])
    assert q.block_ids() == [1, 2, 3]
    q.remove(blocks[2])
    assert q.block_ids() == [1, 3] and not blocks[2].in_free_queue
    q.appendleft(blocks[2])
    q.append(blocks[4])
    assert q.block_ids() == [2, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[2]
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.append(blocks[1])
    for _ in range(3):
        q.popleft()
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


# ---- property test -------------------------------------------------------------------------

BLOCK_SIZE = 2
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=9)  # tiny alphabet: hits are common


class PagedCacheMachine(RuleBasedStateMachine):
    """Random admit / grow / free / reset sequences against a small pool."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = PagedCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0

    def _try_allocate(self, rid: str, tokens: list[int], computed) -> bool:
        before = self.mgr.snapshot()
        new = self.mgr.allocate_slots(rid, len(tokens), computed)
        if new is None:
            assert self.mgr.snapshot() == before, "failed allocation changed state"
            return False
        self.mgr.cache_full_blocks(
            rid, chain_hashes(tokens, BLOCK_SIZE), tokens, len(tokens) // BLOCK_SIZE
        )
        return True

    @rule(tokens=TOKENS)
    def admit(self, tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = chain_hashes(tokens, BLOCK_SIZE)
        computed = self.mgr.get_computed_blocks(rid, hashes)
        assert [b.block_hash for b in computed] == hashes[: len(computed)]
        if self._try_allocate(rid, tokens, computed):
            self.tokens[rid] = list(tokens)
            assert self.mgr.get_block_ids(rid)[: len(computed)] == [b.block_id for b in computed]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=TOKENS)
    def grow(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid] + extra
        if self._try_allocate(rid, tokens, None):
            self.tokens[rid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(rid)
        del self.tokens[rid]

    @rule()
    def free_unknown(self):
        before = self.mgr.snapshot()
        self.mgr.free("never-admitted")
        assert self.mgr.snapshot() == before

    @rule()
    def reset(self):
        assert self.mgr.reset_prefix_cache()

    @rule()
    def free_all(self):
        for rid in list(self.tokens):
            self.mgr.free(rid)
        self.tokens.clear()
        self._assert_no_leaks()

    @invariant()
    def consistent(self):
        self.mgr.check_invariants()
        for rid, tokens in self.tokens.items():
            hashes = chain_hashes(tokens, BLOCK_SIZE)
            table = self.mgr.req_to_blocks[rid]
            assert len(table) == self.mgr.num_blocks_needed(len(tokens))
            for i, block in enumerate(table):
                assert block.ref_cnt >= 1
                if block.block_hash is not None:
                    # A shared block must hold exactly this request's content at this position.
                    assert block.block_hash == hashes[i]
                    assert block.token_ids == tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                else:
                    assert block.ref_cnt == 1, "unhashed blocks are never shared"

    def _assert_no_leaks(self):
        stats = self.mgr.stats()
        assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks
        assert all(b.ref_cnt == 0 for b in self.mgr.blocks)
        assert self.mgr.snapshot()["requests"] == {}
        self.mgr.check_invariants()

    def teardown(self):
        self.free_all()


PagedCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_paged_cache_state_machine = PagedCacheMachine.TestCase

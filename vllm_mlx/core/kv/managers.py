"""One manager per kind of cache state (vLLM v1's ``SingleTypeKVCacheManager``).

Each block group (``kv_spec.plan_block_groups``) is driven by a ``FullAttentionManager`` (keeps
every block) or a ``SlidingWindowManager`` (gives back the blocks its window left); recurrent
layers by a ``RecurrentStateManager`` (one state slot per request, and state checkpoints).
The coordinator (``core/kv/coordinator.py``) drives them all over one ``BlockPool``.

None of them keeps anything per request: the block managers work on the table of their group
that the request's one record (``records.RequestCache``) carries, and the recurrent-state
structures on the state slot and checkpoints that the same record carries.
"""

from __future__ import annotations

from vllm_mlx.core.kv.block_pool import BlockPool, CacheBlock
from vllm_mlx.core.kv.checkpoints import StateCheckpoints
from vllm_mlx.core.kv.records import RequestRecords
from vllm_mlx.core.kv.state_slots import NULL_STATE_SLOT, StateSlots


class FullAttentionManager:
    """A block group whose layers attend to every earlier token: its tables keep every block."""

    window: int | None = None

    def __init__(self, pool: BlockPool, group: int) -> None:
        self.pool = pool
        self.group = group
        self.block_size = pool.block_size

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a query at ``num_computed_tokens`` or later still sees."""
        return 0

    def blocks_held(self, num_blocks: int, max_step_tokens: int) -> int:
        """Blocks a table of ``num_blocks`` blocks holds at most while computing steps of at
        most ``max_step_tokens`` tokens."""
        return num_blocks

    def hit_table(self, block_hashes: list[bytes]) -> list[CacheBlock] | None:
        """The head of a request's table for a prefix hit on ``block_hashes`` (the null block
        where the group needs none), or None when the group does not hold the blocks it needs."""
        first = self.first_needed_block(len(block_hashes) * self.block_size)
        cached = self.pool.cached[self.group]
        blocks = [cached.get(h) for h in block_hashes[first:]]
        if any(b is None for b in blocks):
            return None
        return [self.pool.null_block] * first + blocks

    def remove_skipped_blocks(self, table: list[CacheBlock], num_computed_tokens: int) -> int:
        """Give back the blocks no query from ``num_computed_tokens`` on can see (they become
        the null block in ``table``); how many."""
        return 0

    def cache_blocks(
        self, table: list[CacheBlock], block_hashes: list[bytes], token_ids: list[int], num_full: int
    ) -> None:
        """Register the first ``num_full`` blocks of ``table``. Already hashed ones (hits, or
        registered before) are skipped; a block whose hash another block carries already stays
        unhashed (a duplicate costs memory, never correctness)."""
        bs, cached = self.block_size, self.pool.cached[self.group]
        for i in range(num_full):
            block, block_hash = table[i], block_hashes[i]
            if block.is_null or block.block_hash is not None or block_hash in cached:
                continue
            self.pool.cache_block(block, self.group, block_hash, tuple(token_ids[i * bs : (i + 1) * bs]))

    def check_table(self, request_id: str, table: list[CacheBlock]) -> None:
        """Own blocks only; null entries only where the window left, and only at the head."""
        for block in table:
            _require(block is self.pool.blocks[block.block_id], f"request {request_id!r} holds a foreign block")
        num_null = sum(b.is_null for b in table)
        full = self.window is None
        _require(num_null == 0 or not full, f"request {request_id!r} has a null block in full group {self.group}")
        _require(all(b.is_null for b in table[:num_null]), f"request {request_id!r}: null block after a live one")


class SlidingWindowManager(FullAttentionManager):
    """A block group whose layers see only the last ``window`` tokens: a table's blocks that
    fell wholly out of the window go back to the pool (a hashed one stays cached-free)."""

    def __init__(self, pool: BlockPool, group: int, window: int) -> None:
        super().__init__(pool, group)
        self.window = window

    def first_needed_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def blocks_held(self, num_blocks: int, max_step_tokens: int) -> int:
        reach = -(-(self.window - 1 + max_step_tokens) // self.block_size) + 1
        return min(num_blocks, reach)

    def remove_skipped_blocks(self, table: list[CacheBlock], num_computed_tokens: int) -> int:
        # Null entries are a prefix: walk back from the first needed block to the last freed
        # one, so each step costs the blocks it frees, not the whole sequence.
        freed = 0
        i = min(self.first_needed_block(num_computed_tokens), len(table)) - 1
        while i >= 0 and not table[i].is_null:
            self.pool.release(table[i])
            table[i] = self.pool.null_block
            freed += 1
            i -= 1
        return freed


def block_group_manager(pool: BlockPool, group: int, window: int | None) -> FullAttentionManager:
    """The manager of block group ``group`` (``window``: None keeps every block)."""
    return FullAttentionManager(pool, group) if window is None else SlidingWindowManager(pool, group, window)


class RecurrentStateManager:
    """Recurrent layers: one state slot per request holding blocks (``state_slots.py``), and,
    with prefix caching, state checkpoints at block boundaries (``core/kv/checkpoints.py``): a
    hybrid model resumes a prefix only where one is kept (none: no prefix hits). Each request's
    slot and checkpoints are on its record; the structures keep the free slots and the keyed
    checkpoints."""

    def __init__(
        self,
        num_state_slots: int,
        num_state_checkpoints: int,
        enable_caching: bool,
        records: RequestRecords | None = None,
    ) -> None:
        """``records``: the requests' records (the coordinator's), where each request's slot and
        checkpoints live; on its own, a fresh set."""
        records = RequestRecords() if records is None else records
        self.slots = StateSlots(num_state_slots, records)
        keeps = enable_caching and num_state_checkpoints > 0
        self.checkpoints = StateCheckpoints(num_state_slots, num_state_checkpoints, records) if keeps else None

    def has_free_slot(self) -> bool:
        return self.slots.num_free > 0

    def take_slot(self, request_id: str, resume_from: bytes | None) -> None:
        """The request's first allocation: a slot, and the checkpoint its first step reads
        (the hash of its hit's last block), pinned until that step is done."""
        self.slots.take(request_id)
        if resume_from is not None and self.checkpoints is not None:
            self.checkpoints.pin(request_id, resume_from)

    def slot(self, request_id: str) -> int:
        """The request's slot (the null slot when it holds none)."""
        slot = self.slots.slot_of(request_id)
        return NULL_STATE_SLOT if slot is None else slot

    def read_slot(self, request_id: str) -> int:
        """Where the request's next step reads its state: the checkpoint it resumes from until
        its first step is done, then its own slot."""
        pinned = self.checkpoints.pinned_slot(request_id) if self.checkpoints is not None else None
        return self.slot(request_id) if pinned is None else pinned

    def has_checkpoint(self, block_hash: bytes) -> bool:
        return self.checkpoints is not None and block_hash in self.checkpoints

    def reserve_checkpoint(self, request_id: str) -> int | None:
        return None if self.checkpoints is None else self.checkpoints.reserve(request_id)

    def publish_checkpoint(self, request_id: str, block_hash: bytes, moving: bool) -> None:
        self.checkpoints.publish(request_id, block_hash, moving)

    def finish_step(self, request_id: str, succeeded: bool) -> None:
        """The checkpoint the request resumed from is no longer read; a checkpoint slot its
        failed step wrote is free again."""
        if self.checkpoints is not None:
            self.checkpoints.unpin(request_id)
            if not succeeded:
                self.checkpoints.cancel(request_id)

    def release(self, request_id: str) -> None:
        """The request holds no blocks any more: its slot goes back (its checkpoints stay)."""
        self.slots.release(request_id)
        if self.checkpoints is not None:
            self.checkpoints.release(request_id)

    def drop_checkpoint(self, block_hash: bytes) -> None:
        """The block carrying ``block_hash`` was evicted: no hit can reach its checkpoint."""
        if self.checkpoints is not None:
            self.checkpoints.drop(block_hash)

    def reset(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.reset()

    def check_invariants(self, holders: set[str]) -> None:
        self.slots.check_invariants(holders)
        if self.checkpoints is not None:
            self.checkpoints.check_invariants(holders)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

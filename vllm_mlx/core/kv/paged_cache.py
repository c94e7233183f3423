"""Paged KV cache accounting, under the name it has always had (a face).

The bookkeeping lives in ``core/kv/coordinator.py`` (one ``BlockPool``, one manager per kind:
``core/kv/managers.py``; its invariants are in that module's docstring) and what observers read in
``core/kv/observation.py``. ``PagedCacheManager`` is that coordinator with the reads and per-request
calls it offered before, for the API page, the guides and tests; the engine's own code reaches
the cache through ``KVCacheManager`` (``core/kv/manager.py``).
"""

from __future__ import annotations

from vllm_mlx.core.kv.block_pool import BlockTable, CacheBlock, FreeBlockQueue
from vllm_mlx.core.kv.checkpoints import StateCheckpoints
from vllm_mlx.core.kv.coordinator import KVCacheCoordinator
from vllm_mlx.core.kv.observation import (
    BlockGroupUsage,
    CacheStats,
    KVSnapshot,
    block_group_usage,
    cache_snapshot,
    cache_stats,
    check_invariants,
    kv_snapshot,
)
from vllm_mlx.core.kv.state_slots import NULL_STATE_SLOT, StateSlots

__all__ = ["BlockTable", "CacheBlock", "CacheStats", "FreeBlockQueue", "PagedCacheManager"]


class PagedCacheManager(KVCacheCoordinator):
    """Owns every block, the free queue and the hash→block maps; hands blocks to requests.

    The ``KVCacheCoordinator`` (allocation, hits, freeing), plus the per-request reads and the
    state-checkpoint calls by request id that this class offered before the coordinator was
    split out. Not thread-safe: the engine thread owns it; other threads read ``snapshot()``.
    """

    # ---- the pool's parts, as attributes -----------------------------------------------------

    @property
    def blocks(self) -> list[CacheBlock]:
        return self.pool.blocks

    @property
    def null_block(self) -> CacheBlock:
        return self.pool.null_block

    @property
    def free_queue(self) -> FreeBlockQueue:
        return self.pool.free_queue

    @property
    def cached_blocks(self) -> dict[bytes, CacheBlock]:
        """Group 0's hash map."""
        return self.pool.cached[0]

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def state_slots(self) -> StateSlots | None:
        return self.state.slots if self.state else None

    @property
    def checkpoints(self) -> StateCheckpoints | None:
        return self.state.checkpoints if self.state else None

    @property
    def req_to_blocks(self) -> dict[str, list[CacheBlock]]:
        """Each request holding blocks → its group-0 table (a fresh dict, live tables)."""
        return {rid: r.tables[0] for rid, r in self.requests.items() if r.holds_blocks}

    # ---- per-request reads ---------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.get_block_tables(request_id)
        return tables[0] if tables else []

    def get_block_table(self, request_id: str) -> BlockTable:
        return BlockTable(self.get_block_ids(request_id), self.block_size)

    def get_num_cached_tokens(self, request_id: str) -> int:
        record = self.requests.get(request_id)
        return record.num_cached_tokens if record else 0

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent-state slot (the null slot when the model has no recurrent
        layers or the request holds no blocks)."""
        return self.state.slot(request_id) if self.state else NULL_STATE_SLOT

    def get_state_read_slot(self, request_id: str) -> int:
        """Where the request's next step reads its recurrent state: the checkpoint it resumes
        from until its first step is done (``finish_step``), then its own slot."""
        return self.state.read_slot(request_id) if self.state else NULL_STATE_SLOT

    # ---- recurrent-state checkpoints -----------------------------------------------------------

    def reserve_state_checkpoint(self, request_id: str) -> int | None:
        """A checkpoint slot that the request's next step writes its final state into (it must
        end on a block boundary), or None when no checkpoint can be kept."""
        held = request_id in self.requests and self.requests[request_id].holds_blocks
        return self.state.reserve_checkpoint(request_id) if self.state and held else None

    def publish_state_checkpoint(self, request_id: str, block_hash: bytes, moving: bool) -> None:
        """The reserved slot now holds the state after the block hashed ``block_hash``; see
        ``StateCheckpoints.publish`` for ``moving``."""
        self.state.publish_checkpoint(request_id, block_hash, moving)

    def finish_step(self, request_id: str, succeeded: bool) -> None:
        """The request's step is applied: the checkpoint it resumed from is no longer read,
        and a reserved checkpoint slot its failed step wrote is free again."""
        if self.state is not None:
            self.state.finish_step(request_id, succeeded)

    # ---- observation ---------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self) -> CacheStats:
        return cache_stats(self)

    def snapshot(self) -> dict:
        """Plain-data view for stats endpoints and the inspector (``kv_observation``)."""
        return cache_snapshot(self)

    def view(self, include_blocks: bool = True) -> KVSnapshot:
        """The typed view ``snapshot()`` serialises (``kv_observation.kv_snapshot``)."""
        return kv_snapshot(self, include_blocks)

    def block_group_usage(self) -> list[BlockGroupUsage]:
        """Per block group: its window and how many blocks its tables hold now."""
        return block_group_usage(self)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (``kv_coordinator``'s
        module docstring)."""
        check_invariants(self)

"""What observers read of the KV coordinator: counts, a plain-data snapshot, and its invariants.

Reads only: nothing here changes the cache. The KV manager (``core/kv/manager.py``) serves these
to the scheduler's observers (engine stats, cache snapshots, the inspector).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_mlx.core.kv.block_pool import CacheBlock
from vllm_mlx.core.kv.coordinator import KVCacheCoordinator


@dataclass
class CacheStats:
    """Counts of the block pool; ``num_blocks`` excludes the null block."""

    num_blocks: int
    block_size: int
    num_used_blocks: int = 0
    num_cached_free_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0  # all hashed blocks, used or free
    usage: float = 0.0
    allocations: int = 0  # blocks taken from the free queue for new content
    frees: int = 0  # blocks returned to the free queue
    evictions: int = 0  # hashed blocks reclaimed for new content
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    num_state_slots: int = 0  # recurrent-state slots (excluding the null slot); 0: no recurrent layers
    num_used_state_slots: int = 0
    num_state_checkpoints: int = 0  # checkpoint slots for recurrent prefix hits
    num_cached_state_checkpoints: int = 0  # of those, holding a state
    state_checkpoint_evictions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["prefix_hit_rate"] = self.prefix_hit_rate
        return data


def cache_stats(kv: KVCacheCoordinator) -> CacheStats:
    pool, state = kv.pool, kv.state
    checkpoints = state.checkpoints if state else None
    num_free = pool.get_num_free_blocks()
    return CacheStats(
        num_blocks=pool.num_usable_blocks,
        block_size=kv.block_size,
        num_used_blocks=pool.num_usable_blocks - num_free,
        num_cached_free_blocks=pool.num_cached_blocks(free_only=True),
        num_free_blocks=num_free,
        num_cached_blocks=pool.num_cached_blocks(),
        usage=pool.usage,
        allocations=pool.allocations,
        frees=pool.frees,
        evictions=pool.evictions,
        prefix_queries=kv.prefix_queries,
        prefix_hits=kv.prefix_hits,
        num_state_slots=state.slots.num_slots - 1 if state else 0,
        num_used_state_slots=state.slots.num_used if state else 0,
        num_state_checkpoints=checkpoints.num_slots if checkpoints is not None else 0,
        num_cached_state_checkpoints=len(checkpoints) if checkpoints is not None else 0,
        state_checkpoint_evictions=checkpoints.evictions if checkpoints is not None else 0,
    )


def cache_snapshot(kv: KVCacheCoordinator) -> dict:
    """Plain-data view for stats endpoints and the inspector (one pass over the blocks)."""
    owners: dict[int, list[str]] = {}
    held: dict[str, list[int]] = {}  # per request, the blocks of all its tables
    for request_id, record in _holders(kv):
        held[request_id] = [b.block_id for t in record.tables for b in t if not b.is_null]
        for block_id in held[request_id]:
            owners.setdefault(block_id, []).append(request_id)
    state = kv.state
    return {
        "block_size": kv.block_size,
        "blocks": [_block_view(b, owners.get(b.block_id, [])) for b in kv.pool.blocks],
        "requests": held,
        "tables": {rid: kv.get_block_tables(rid) for rid, _ in _holders(kv)},  # per group
        "block_groups": block_group_usage(kv),
        "free_queue": kv.pool.free_queue.block_ids(),  # eviction order, head first
        "state_slots": state.slots.owners() if state else {},
        "state_checkpoints": state.checkpoints.snapshot() if state and state.checkpoints else None,  # None: none kept
        "stats": cache_stats(kv).to_dict(),
    }


def block_group_usage(kv: KVCacheCoordinator) -> list[dict]:
    """Per block group: its window and how many distinct blocks its tables hold now."""
    usage = []
    for g, window in enumerate(kv.group_windows):
        held = {b.block_id for _, record in _holders(kv) for b in record.tables[g] if not b.is_null}
        usage.append({"window": window, "num_used_blocks": len(held)})
    return usage


def _holders(kv: KVCacheCoordinator):
    return ((rid, record) for rid, record in kv.requests.items() if record.holds_blocks)


def _block_view(block: CacheBlock, owners: list[str]) -> dict:
    if block.is_null:
        state = "null"
    elif block.ref_cnt > 0:
        state = "used"
    elif block.block_hash is not None:
        state = "cached"
    else:
        state = "free"
    return {
        "id": block.block_id,
        "state": state,
        "ref_cnt": block.ref_cnt,
        "owners": owners,
        "hash": _short_hash(block.block_hash),
        "num_tokens": block.num_tokens,
        "token_ids": list(block.token_ids) if block.token_ids is not None else None,
    }


def _short_hash(block_hash: bytes | None) -> str | None:
    if block_hash is None:
        return None
    text = block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else str(block_hash)
    return text[:12]


# ---- invariants (``kv_coordinator``'s module docstring) --------------------------------------


def check_invariants(kv: KVCacheCoordinator) -> None:
    """Raise AssertionError if the bookkeeping is inconsistent."""
    pool = kv.pool
    null = pool.null_block
    _require(null.is_null and null.ref_cnt == 0, "null block was allocated")
    _require(null.block_hash is None and not null.in_free_queue, "null block hashed or queued")
    refs = _count_table_refs(kv)
    queued = {b.block_id for b in pool.free_queue.check_links()}
    for block in pool.free_queue:
        _require(block is pool.blocks[block.block_id], f"foreign block {block.block_id} queued")
    _require(0 not in queued, "null block is in the free queue")
    for block in pool.blocks[1:]:
        _check_block(block, refs.get(block.block_id, 0), block.block_id in queued, kv.block_size)
    for group, cached in enumerate(pool.cached):
        for block_hash, block in cached.items():
            _require(block.block_hash == block_hash and block.group == group, f"stale map entry: {block.block_id}")
    hashed = {id(b) for b in pool.blocks if b.block_hash is not None}
    _require(hashed == {id(b) for c in pool.cached for b in c.values()}, "hashed block not in map")
    if kv.state is not None:
        kv.state.check_invariants({rid for rid, _ in _holders(kv)})


def _count_table_refs(kv: KVCacheCoordinator) -> dict[int, int]:
    refs: dict[int, int] = {}
    for request_id, record in _holders(kv):
        tables = record.tables
        _require(record.request_id == request_id, f"record of {record.request_id!r} filed under {request_id!r}")
        _require(len(tables) == len(kv.groups), f"request {request_id!r} lacks a group's table")
        _require(len({len(t) for t in tables}) == 1, f"request {request_id!r}'s tables differ in length")
        ids = [b.block_id for t in tables for b in t if not b.is_null]
        _require(len(set(ids)) == len(ids), f"request {request_id!r} repeats a block: {ids}")
        for group, table in zip(kv.groups, tables):
            group.check_table(request_id, table)
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + (not block.is_null)
    return refs


def _check_block(block: CacheBlock, num_refs: int, queued: bool, block_size: int) -> None:
    bid, ref_cnt = block.block_id, block.ref_cnt
    _require(ref_cnt >= 0, f"block {bid} has negative ref_cnt {ref_cnt}")
    _require(ref_cnt == num_refs, f"block {bid} ref_cnt {ref_cnt} != {num_refs} tables")
    _require((ref_cnt == 0) == queued, f"block {bid} ref_cnt {ref_cnt} but queued={queued}")
    _require(0 <= block.num_tokens <= block_size, f"block {bid} num_tokens out of range")
    full = block.num_tokens == block_size
    _require(block.block_hash is None or full, f"hashed block {bid} is not full")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

"""What observers read of the KV coordinator: counts, a typed snapshot, and its invariants.

Reads only: nothing here changes the cache. The KV manager (``core/kv/manager.py``) serves these
to the scheduler's observers (engine stats, cache snapshots, the inspector). Each observation is
a dataclass with one ``to_dict()`` (the plain-data form, made only where it leaves the process or
a test reads it) and, where a remote side rebuilds it from JSON, one ``from_dict()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllm_mlx.core.fields import known_fields
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
        """The fields, then ``prefix_hit_rate`` (derived)."""
        data = {f.name: getattr(self, f.name) for f in fields(CacheStats)}
        data["prefix_hit_rate"] = self.prefix_hit_rate
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CacheStats:
        """The inverse of ``to_dict`` (derived keys and keys of no field are ignored; a count
        the data leaves out, as a server's public stats do, is 0)."""
        return cls(**{"num_blocks": 0, "block_size": 0, **known_fields(CacheStats, data)})


@dataclass(slots=True)  # a snapshot holds one per block of the pool: kept small and cheap
class BlockView:
    """One physical block as observers see it."""

    id: int
    state: str
    """``"null"`` (block 0), ``"used"`` (held by a request), ``"cached"`` (free, hashed:
    a prefix hit revives it) or ``"free"``."""
    ref_cnt: int
    owners: list[str]
    """Ids of the requests whose tables hold it."""
    hash: str | None
    """The first 12 hex digits of its block hash; None until the block is full."""
    num_tokens: int
    token_ids: list[int] | None
    """Its tokens (a block being filled: the tokens of an owner's table); None if unknown."""
    text: str | None = None
    """The tokens decoded (at most ``MAX_BLOCK_TEXT`` characters); None where not decoded (the
    KV manager's own snapshot). Left out of ``to_dict`` when None."""
    from_disk: bool = False
    """Its KV was read back from disk (the KV disk tier or a prefix file) rather than computed
    in this process; until the block is evicted. Left out of ``to_dict`` when False."""

    def to_dict(self) -> dict:
        # Spelled out, not ``fields()``: a large pool's snapshot calls this for every block.
        data = {
            "id": self.id, "state": self.state, "ref_cnt": self.ref_cnt, "owners": list(self.owners),
            "hash": self.hash, "num_tokens": self.num_tokens, "token_ids": self.token_ids,
        }  # fmt: skip
        if self.text is not None:
            data["text"] = self.text
        if self.from_disk:
            data["from_disk"] = True
        return data

    @classmethod
    def from_dict(cls, data: dict) -> BlockView:
        """The inverse of ``to_dict``; ``owners``, ``hash`` and ``token_ids`` may be missing (a
        server's block view has none)."""
        return cls(**{"owners": [], "hash": None, "token_ids": None, **known_fields(cls, data)})


@dataclass
class BlockGroupUsage:
    """A block group (``kv_spec.BlockGroups``): its sliding window (None: full attention) and how
    many distinct blocks its tables hold now."""

    window: int | None
    num_used_blocks: int

    def to_dict(self) -> dict:
        return {"window": self.window, "num_used_blocks": self.num_used_blocks}

    @classmethod
    def from_dict(cls, data: dict) -> BlockGroupUsage:
        return cls(**known_fields(cls, data))


@dataclass
class KVSnapshot:
    """The KV coordinator's whole view, one pass over the blocks (``kv_snapshot``)."""

    block_size: int
    stats: CacheStats
    block_groups: list[BlockGroupUsage]
    blocks: list[BlockView] = field(default_factory=list)
    """Every block, by id (block 0 is the null block); empty without ``include_blocks``."""
    requests: dict[str, list[int]] = field(default_factory=dict)
    """Per request holding blocks, the blocks of all its tables."""
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    """Per request holding blocks, its block table in each block group."""
    free_queue: list[int] = field(default_factory=list)
    """Free block ids in eviction order, head first."""
    state_slots: dict[str, int] = field(default_factory=dict)
    """Per request, its recurrent-state slot."""
    state_checkpoints: dict | None = None
    """``StateCheckpoints.snapshot()``; None where no checkpoints are kept."""

    def to_dict(self) -> dict:
        """The full form (``blocks`` first); the KV manager's short form is ``to_short_dict``."""
        return {
            "block_size": self.block_size,
            "blocks": [block.to_dict() for block in self.blocks],
            "requests": {rid: list(ids) for rid, ids in self.requests.items()},
            "tables": {rid: [list(t) for t in tables] for rid, tables in self.tables.items()},
            "block_groups": [group.to_dict() for group in self.block_groups],
            "free_queue": list(self.free_queue),
            "state_slots": dict(self.state_slots),
            "state_checkpoints": self.state_checkpoints,
            "stats": self.stats.to_dict(),
        }

    def to_short_dict(self) -> dict:
        """Without blocks: ``block_size``, ``blocks`` and ``free_queue`` (empty), ``stats``,
        ``block_groups``."""
        return {"block_size": self.block_size, "blocks": [], "free_queue": [], "stats": self.stats.to_dict(),
                "block_groups": [group.to_dict() for group in self.block_groups]}  # fmt: skip


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


def kv_snapshot(kv: KVCacheCoordinator, include_blocks: bool = True) -> KVSnapshot:
    """The typed view for stats endpoints and the inspector (one pass over the blocks); without
    ``include_blocks`` only ``block_size``, ``stats`` and ``block_groups``."""
    if not include_blocks:
        return KVSnapshot(kv.block_size, cache_stats(kv), block_group_usage(kv))
    owners: dict[int, list[str]] = {}
    held: dict[str, list[int]] = {}  # per request, the blocks of all its tables
    for request_id, record in _holders(kv):
        held[request_id] = [b.block_id for t in record.tables for b in t if not b.is_null]
        for block_id in held[request_id]:
            owners.setdefault(block_id, []).append(request_id)
    state = kv.state
    return KVSnapshot(
        block_size=kv.block_size,
        stats=cache_stats(kv),
        block_groups=block_group_usage(kv),
        blocks=[_block_view(b, owners.get(b.block_id, [])) for b in kv.pool.blocks],
        requests=held,
        tables={rid: kv.get_block_tables(rid) for rid, _ in _holders(kv)},  # per group
        free_queue=kv.pool.free_queue.block_ids(),  # eviction order, head first
        state_slots=state.slots.owners() if state else {},
        state_checkpoints=state.checkpoints.snapshot() if state and state.checkpoints else None,  # None: none kept
    )


def cache_snapshot(kv: KVCacheCoordinator) -> dict:
    """``kv_snapshot(kv).to_dict()``: plain data (what the coordinator's ``snapshot()`` returns)."""
    return kv_snapshot(kv).to_dict()


def block_group_usage(kv: KVCacheCoordinator) -> list[BlockGroupUsage]:
    """Per block group: its window and how many distinct blocks its tables hold now."""
    usage = []
    for g, window in enumerate(kv.group_windows):
        held = {b.block_id for _, record in _holders(kv) for b in record.tables[g] if not b.is_null}
        usage.append(BlockGroupUsage(window, len(held)))
    return usage


def _holders(kv: KVCacheCoordinator):
    return ((rid, record) for rid, record in kv.requests.items() if record.holds_blocks)


def _block_view(block: CacheBlock, owners: list[str]) -> BlockView:
    if block.is_null:
        state = "null"
    elif block.ref_cnt > 0:
        state = "used"
    elif block.block_hash is not None:
        state = "cached"
    else:
        state = "free"
    token_ids = list(block.token_ids) if block.token_ids is not None else None
    block_hash = _short_hash(block.block_hash)
    return BlockView(block.block_id, state, block.ref_cnt, owners, block_hash, block.num_tokens, token_ids,
                     from_disk=block.from_disk)  # fmt: skip


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

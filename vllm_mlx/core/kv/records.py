"""One record per request: everything the KV cache keeps for it, from its first lookup to its end.

Pure bookkeeping (no MLX). The coordinator (``core/kv/coordinator.py``) files the records by
request id (``RequestRecords``); the block managers work on a record's tables, and the recurrent
state's structures (``state_slots.py``, ``checkpoints.py``) on its state fields, through the same
records. Nothing else keeps anything per request: ending a request is its record going away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mlx.core.kv.block_pool import CacheBlock


@dataclass
class RequestCache:
    """Everything the KV cache keeps for one request, from its first lookup to its end."""

    request_id: str
    tables: list[list[CacheBlock]] | None = None
    """Its table of every block group (group 0's first); None while it holds no blocks."""
    num_cached_tokens: int = 0
    """Tokens its admission found cached (its prefix hit)."""
    num_tokens: int = 0
    """Token slots handed out to it (a high-water mark; hashed blocks are full)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of its full blocks, computed once each (kept over preemption, for readmission)."""
    branch_point: int | None = None
    """Where the blocks cached at its admission ended, past its hit (hybrid models)."""
    state_slot: int | None = None
    """Its recurrent-state slot (``state_slots.py``): set exactly while it holds blocks (taken
    with its first allocation, given back with its blocks), no other request's; None for a model
    without recurrent layers."""
    pending_checkpoint_slot: int | None = None
    """The state checkpoint slot its running step also writes its final state into
    (``checkpoints.py``: *pending*): reserved before a step that ends on a block boundary, None
    again once that step is published or cancelled. Only while it holds blocks."""
    resumes_from: bytes | None = None
    """The hash of the checkpoint its first step reads (admitted on a prefix hit): pinned, so never
    evicted, until that step is done. Only while it holds blocks."""
    latest_checkpoint: bytes | None = None
    """The hash of its newest *moving* checkpoint (a boundary its computation happened to end
    on): a newer one demotes it to the head of the eviction order. Forgotten with its blocks."""

    @property
    def holds_blocks(self) -> bool:
        return self.tables is not None

    @property
    def is_empty(self) -> bool:
        """Nothing worth keeping: no blocks, no hashes, no state slot or checkpoint."""
        state = (self.state_slot, self.pending_checkpoint_slot, self.resumes_from, self.latest_checkpoint)
        blocks = self.tables is None and not self.block_hashes and self.branch_point is None
        return blocks and state == (None, None, None, None)


class RequestRecords(dict[str, RequestCache]):
    """The records by request id. The coordinator keeps the requests holding blocks in the order
    they took their first blocks (``owners()`` of the state slots follow it)."""

    def record(self, request_id: str) -> RequestCache:
        """The request's record, made on first use."""
        record = self.get(request_id)
        if record is None:
            record = self[request_id] = RequestCache(request_id)
        return record

    def discard_if_empty(self, request_id: str) -> None:
        """Forget the request's record when nothing is left on it (unknown ids are ignored)."""
        record = self.get(request_id)
        if record is not None and record.is_empty:
            del self[request_id]

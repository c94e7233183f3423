"""Recurrent-state slots: which row of the state pool belongs to which running request.

Pure bookkeeping (no MLX), owned by ``kv_managers.RecurrentStateManager``: a request takes a
slot with its first block allocation and gives it back when its blocks are freed (finish, abort,
preemption). The state arrays themselves live in the runner's ``StatePool`` (``state_pool.py``), indexed by slot.

Invariants:

* Slot 0 is the *null* slot, never handed out (the runner's probe and padding-free scratch).
* Every other slot is either free or owned by exactly one request holding blocks: the slot is
  on that request's record (``records.RequestCache.state_slot``), the free list here.
* A slot's content is meaningless when it is handed out: the runner reads zeros for a request
  that has computed no token yet, so a slot never needs clearing.
"""

from __future__ import annotations

from collections import deque

from vllm_mlx.core.kv.records import RequestRecords

NULL_STATE_SLOT = 0


class StateSlots:
    """A free list of ``num_slots - 1`` slots (slot 0 is reserved); each owner's slot is on its
    record (``RequestCache.state_slot``), so nothing here is kept per request."""

    def __init__(self, num_slots: int, records: RequestRecords | None = None) -> None:
        """``records``: the requests' records (the coordinator's); on its own, a fresh set."""
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))
        self._records = RequestRecords() if records is None else records

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - 1 - len(self._free)  # every slot but the null one is free or owned

    def slot_of(self, request_id: str) -> int | None:
        record = self._records.get(request_id)
        return None if record is None else record.state_slot

    def owners(self) -> dict[str, int]:
        """Request id -> slot, in the order the records are filed (the order slots were taken)."""
        return {rid: r.state_slot for rid, r in self._records.items() if r.state_slot is not None}

    def take(self, request_id: str) -> int:
        """The request's slot, taking a free one on first use. Raises IndexError when none is
        free (callers check ``num_free`` first, to stay all-or-nothing)."""
        record = self._records.record(request_id)
        if record.state_slot is None:
            record.state_slot = self._free.popleft()
        return record.state_slot

    def release(self, request_id: str) -> None:
        """Return the request's slot (unknown ids are ignored)."""
        record = self._records.get(request_id)
        if record is not None and record.state_slot is not None:
            self._free.append(record.state_slot)
            record.state_slot = None
            self._records.discard_if_empty(request_id)

    def check_invariants(self, holders: set[str]) -> None:
        """Raise AssertionError unless exactly ``holders`` own slots, each its own."""
        owners = self.owners()
        if set(owners) != holders:
            raise AssertionError(f"state slot owners {sorted(owners)} != {sorted(holders)}")
        everything = sorted(list(owners.values()) + list(self._free))
        if everything != list(range(1, self.num_slots)):
            raise AssertionError(f"state slots lost or doubled: {everything}")

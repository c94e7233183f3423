"""Recurrent-state slots: which row of the state pool belongs to which running request.

Pure bookkeeping (no MLX), owned by ``kv_managers.RecurrentStateManager``: a request takes a
slot with its first block allocation and gives it back when its blocks are freed (finish, abort,
preemption). The state arrays themselves live in the runner's ``StatePool`` (``state_pool.py``), indexed by slot.

Invariants:

* Slot 0 is the *null* slot, never handed out (the runner's probe and padding-free scratch).
* Every other slot is either free or owned by exactly one request.
* A slot's content is meaningless when it is handed out: the runner reads zeros for a request
  that has computed no token yet, so a slot never needs clearing.
"""

from __future__ import annotations

from collections import deque

NULL_STATE_SLOT = 0


class StateSlots:
    """A free list of ``num_slots - 1`` slots (slot 0 is reserved) and their owners."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is reserved), got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(1, num_slots))
        self._owner_slot: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner_slot)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner_slot.get(request_id)

    def owners(self) -> dict[str, int]:
        return dict(self._owner_slot)

    def take(self, request_id: str) -> int:
        """The request's slot, taking a free one on first use. Raises IndexError when none is
        free (callers check ``num_free`` first, to stay all-or-nothing)."""
        slot = self._owner_slot.get(request_id)
        if slot is None:
            slot = self._owner_slot[request_id] = self._free.popleft()
        return slot

    def release(self, request_id: str) -> None:
        """Return the request's slot (unknown ids are ignored)."""
        slot = self._owner_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_invariants(self, holders: set[str]) -> None:
        """Raise AssertionError unless exactly ``holders`` own slots, each its own."""
        used = list(self._owner_slot.values())
        if set(self._owner_slot) != holders:
            raise AssertionError(f"state slot owners {sorted(self._owner_slot)} != {sorted(holders)}")
        everything = sorted(used + list(self._free))
        if everything != list(range(1, self.num_slots)):
            raise AssertionError(f"state slots lost or doubled: {everything}")

"""Recurrent-state checkpoints: the state of a sequence at a block boundary, kept for prefix reuse.

Attention layers resume a cached prefix from its KV blocks; a recurrent layer keeps only the state
after the last token it saw. So a hybrid model can resume a prefix only where the state *at that
point* was kept: a checkpoint, keyed by the hash of the block that ends there (its hash chains
the whole prefix, the namespace and the cache salt: ``prefix_cache.py``).

Pure bookkeeping (no MLX), owned by ``kv_managers.RecurrentStateManager``. Checkpoint slots are
rows of the runner's ``StatePool`` after the running requests' rows; the runner writes a step's
state into a request's checkpoint slot together with its running slot (``StateBatch``), and a
request admitted on a hit reads its first step's state from the checkpoint.

Which boundaries (the scheduler cuts prefill chunks there; ``KVCacheManager.cut_at_checkpoint``):

* the last block boundary before a prompt's last token, which the same prompt resumes from;
* a *branch point*: where the cached blocks a new prompt shares with earlier ones end, when no
  checkpoint was kept there (a shared system prompt followed by different questions: the second
  prompt leaves a checkpoint at the end of the shared part, and the third one resumes there);
* every boundary a request's computation happens to end on (decode crosses one every
  ``block_size`` tokens): *moving* checkpoints, of which only a request's latest matters (the
  next turn of a conversation resumes there), so a newer one demotes the previous one to the
  head of the eviction order.

Life of a checkpoint slot:

* free → *pending*: ``reserve`` before a step whose computation ends on a boundary (a free slot,
  else the least recently used unpinned checkpoint is evicted);
* pending → *keyed*: ``publish`` once the step succeeded (or back to free: ``cancel``);
* keyed → pinned while a request admitted on it has not run its first step (``pin``/``unpin``),
  so eviction never takes a checkpoint that a scheduled read depends on;
* keyed → free: evicted (LRU, unpinned only), dropped with the block carrying its hash, or reset.

What is per request lives on the request's record (``records.RequestCache``): its pending slot
(``pending_checkpoint_slot``), the checkpoint it resumes from (``resumes_from``) and its latest
moving one (``latest_checkpoint``). Here: the free slots and the keyed checkpoints by hash, each
with its slot and pin count, in eviction order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from vllm_mlx.core.kv.records import RequestRecords


@dataclass(slots=True)
class Checkpoint:
    slot: int
    pins: int = 0


class StateCheckpoints:
    """``num_slots`` checkpoint slots, numbered from ``first_slot``; keyed ones in LRU order.

    Kept here: the free slots and the keyed checkpoints (their slot, pins and eviction order).
    What each request pends, pins and last published is on its record (``RequestCache``'s
    ``pending_checkpoint_slot``, ``resumes_from``, ``latest_checkpoint``), so a request that ends
    leaves nothing here.
    """

    def __init__(self, first_slot: int, num_slots: int, records: RequestRecords | None = None) -> None:
        """``records``: the requests' records (the coordinator's); on its own, a fresh set."""
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(first_slot, first_slot + num_slots))
        self._keyed: OrderedDict[bytes, Checkpoint] = OrderedDict()  # oldest (evicted first) first
        self._records = RequestRecords() if records is None else records
        self.evictions = 0

    # ---- queries -------------------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._keyed

    def __len__(self) -> int:
        """Keyed checkpoints."""
        return len(self._keyed)

    def keys(self) -> list[bytes]:
        """The keyed checkpoints' hashes, next to be evicted first."""
        return list(self._keyed)

    def slot_of(self, key: bytes) -> int | None:
        checkpoint = self._keyed.get(key)
        return None if checkpoint is None else checkpoint.slot

    def pending_slot(self, request_id: str) -> int | None:
        record = self._records.get(request_id)
        return None if record is None else record.pending_checkpoint_slot

    def pinned_slot(self, request_id: str) -> int | None:
        record = self._records.get(request_id)
        key = None if record is None else record.resumes_from
        return None if key is None else self._keyed[key].slot

    # ---- a request's checkpoints -----------------------------------------------------------

    def pin(self, request_id: str, key: bytes) -> int:
        """The request resumes from checkpoint ``key``: keep it until ``unpin``; its slot."""
        known = self._records.get(request_id)
        if known is not None and known.resumes_from is not None:
            raise ValueError(f"request {request_id!r} already resumes from a checkpoint")
        checkpoint = self._keyed[key]
        checkpoint.pins += 1
        self._keyed.move_to_end(key)  # used: most recently
        self._records.record(request_id).resumes_from = key
        return checkpoint.slot

    def unpin(self, request_id: str) -> None:
        record = self._records.get(request_id)
        if record is not None and record.resumes_from is not None:
            self._keyed[record.resumes_from].pins -= 1
            record.resumes_from = None

    def reserve(self, request_id: str) -> int | None:
        """A slot for the state the request's next step ends with, or None when every slot is
        pinned or pending (the step then simply keeps no checkpoint)."""
        record = self._records.record(request_id)
        if record.pending_checkpoint_slot is not None:
            return record.pending_checkpoint_slot
        previous = record.latest_checkpoint
        if previous in self._keyed:  # superseded by this one: evicted first
            self._keyed.move_to_end(previous, last=False)
        if not self._free and not self._evict_one():
            return None
        record.pending_checkpoint_slot = self._free.popleft()
        return record.pending_checkpoint_slot

    def publish(self, request_id: str, key: bytes, moving: bool) -> None:
        """The pending slot now holds the state after the block hashed ``key``. ``moving``: a
        boundary that a newer one of the same request supersedes (demoting this one then).
        Raises KeyError when the request has no pending slot."""
        record = self._records.get(request_id)
        slot = None if record is None else record.pending_checkpoint_slot
        if slot is None:
            raise KeyError(request_id)
        record.pending_checkpoint_slot = None
        if key in self._keyed:  # the same state is kept already
            self._free.append(slot)
            self._keyed.move_to_end(key)
        else:
            self._keyed[key] = Checkpoint(slot)
        if moving:
            previous = record.latest_checkpoint
            if previous is not None and previous != key and previous in self._keyed:
                self._keyed.move_to_end(previous, last=False)
            record.latest_checkpoint = key

    def cancel(self, request_id: str) -> None:
        """The step failed or the request ended before it: its pending slot is free again."""
        record = self._records.get(request_id)
        if record is not None and record.pending_checkpoint_slot is not None:
            self._free.append(record.pending_checkpoint_slot)
            record.pending_checkpoint_slot = None

    def release(self, request_id: str) -> None:
        """The request is gone (finished, aborted, preempted); its published checkpoints stay."""
        self.cancel(request_id)
        self.unpin(request_id)
        record = self._records.get(request_id)
        if record is not None:
            record.latest_checkpoint = None
            self._records.discard_if_empty(request_id)

    # ---- checkpoints from elsewhere (the KV disk tier) -----------------------------------------

    def take_for_import(self) -> int | None:
        """A slot to receive a checkpoint read from disk (a free one, else the least recently
        used unpinned checkpoint's), or None; then ``publish_import`` or ``give_back``."""
        if not self._free and not self._evict_one():
            return None
        return self._free.popleft()

    def publish_import(self, key: bytes, slot: int) -> None:
        """Slot ``slot`` now holds the state after the block hashed ``key``."""
        if key in self._keyed:  # kept already (never the case on the engine thread, but cheap)
            self._free.append(slot)
        else:
            self._keyed[key] = Checkpoint(slot)

    def give_back(self, slot: int) -> None:
        """The import failed: ``slot`` is free again."""
        self._free.append(slot)

    # ---- eviction ------------------------------------------------------------------------------

    def drop(self, key: bytes) -> None:
        """Forget checkpoint ``key`` (the block carrying its hash was evicted: no hit can reach
        it any more). Pinned ones stay: their request holds that block."""
        checkpoint = self._keyed.get(key)
        if checkpoint is not None and checkpoint.pins == 0:
            self._free.append(self._keyed.pop(key).slot)

    def reset(self) -> None:
        """Forget every unpinned checkpoint."""
        for key in [k for k, c in self._keyed.items() if c.pins == 0]:
            self.drop(key)

    def _evict_one(self) -> bool:
        unpinned = next((key for key, c in self._keyed.items() if c.pins == 0), None)
        if unpinned is None:
            return False
        self.drop(unpinned)
        self.evictions += 1
        return True

    # ---- observation ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "num_slots": self.num_slots,
            "keyed": [{"hash": key.hex()[:12], "slot": c.slot, "pins": c.pins} for key, c in self._keyed.items()],
            "pending": self._pending(),
        }

    def check_invariants(self, holders: set[str]) -> None:
        """Every slot is free, pending or keyed exactly once; pins match the requests pinning;
        only ``holders`` (requests holding blocks) pend or pin."""
        pending = self._pending()
        slots = list(self._free) + list(pending.values()) + [c.slot for c in self._keyed.values()]
        expected = list(range(self.first_slot, self.first_slot + self.num_slots))
        if sorted(slots) != expected:
            raise AssertionError(f"checkpoint slots lost or doubled: {sorted(slots)}")
        pinners = {rid: r.resumes_from for rid, r in self._records.items() if r.resumes_from is not None}
        pins: dict[bytes, int] = {}
        for key in pinners.values():
            pins[key] = pins.get(key, 0) + 1
        for key, checkpoint in self._keyed.items():
            if checkpoint.pins != pins.get(key, 0):
                raise AssertionError(f"checkpoint {key.hex()[:12]} has {checkpoint.pins} pins, {pins.get(key, 0)} pinners")
        strangers = (set(pending) | set(pinners)) - holders
        if strangers:
            raise AssertionError(f"requests without blocks pend or pin checkpoints: {sorted(strangers)}")

    def _pending(self) -> dict[str, int]:
        """Request id -> the checkpoint slot its running step also writes, from the records."""
        records = self._records.items()
        return {rid: r.pending_checkpoint_slot for rid, r in records if r.pending_checkpoint_slot is not None}

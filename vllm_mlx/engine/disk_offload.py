"""What moves between the block pool and the KV disk tier (``kv_disk.py``), and when.

Both directions run on the engine thread, between steps; the disk I/O itself runs on the tier's
threads.

- **Out, after a step.** When a request's prefill completes, the full blocks of its prompt that
  the disk lacks are copied out of the pool (one read of the pool for all of them) and queued
  for the writer: prompt blocks are what a later request can hit (a system prompt, a document,
  the earlier turns of a chat), and blocks already on disk, or over the write budget, are not
  copied at all. Output blocks are written once they are part of a later prompt (the next turn).
- **In, before a step.** A waiting request is probed once per admission: after its longest
  prefix cached in memory, the blocks that follow it on disk are read on a reader thread (read
  ahead: queued requests are probed while the batch ahead of them runs). Before the scheduler
  admits it, the blocks read go into free blocks of the pool and are published under the hashes
  the engine computed for the request's tokens (``KVCacheCoordinator.reserve_import``), so the
  admission finds them cached like any prefix. The engine thread waits only for the reads of
  the requests that the batch has seats for (the ones the scheduler may admit in this step);
  the others' reads go on beside the step.

The hashes are the prefix cache's own (namespace, ``cache_salt``, the images' content hashes,
chained), so a block on disk is only ever found by a request with the same tokens and images
before it and the same salt.

**Block groups** (sliding-window layers beside full ones, ``kv_spec.plan_block_groups``): a
position of the prompt has a block in every group, each holding that group's layers' KV in the
pool's shared arrays, so every group's block is written as a file of its own, under its
``group_key`` (group 0's: the block hash itself). A hit needs group 0's blocks up to the hit
point and, in each sliding-window group, the blocks its window reaches there
(``first_needed_block``): the probe picks the furthest point whose blocks are all in memory or
on disk, and reads what memory lacks.

**Recurrent layers** (hybrid models): a hit point needs the state after its last block, a state
checkpoint (``core/kv/checkpoints.py``). Each checkpoint kept at a prompt's block boundary is
written too (a file of kind ``"state"`` under ``group_key(hash, STATE)``), and a hit point that
memory has no checkpoint for is read with its checkpoint into a checkpoint slot
(``reserve_import(..., checkpoint=True)``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_mlx.core.outputs import ScheduledRequest
from vllm_mlx.core.request import Request
from vllm_mlx.engine.kv_disk import BlockBytes, DiskTier

logger = logging.getLogger(__name__)


STATE = -1
"""The "group" of a recurrent-state checkpoint in (index, group) positions: the state after
block ``index``."""


def group_key(block_hash: bytes, group: int) -> bytes:
    """The disk key of block group ``group``'s block for ``block_hash`` (``STATE``: of the
    recurrent state after it): group 0's is the hash itself (so a model of one group keeps its
    files), the others' a hash of both (the same tokens, other layers or the state)."""
    if group == 0:
        return block_hash
    tag = b"recurrent state:" if group == STATE else b"block group %d:" % group
    return hashlib.sha256(tag + block_hash).digest()


@dataclass
class _PendingRead:
    """A waiting request's disk blocks being read."""

    hashes: list[bytes]
    """The request's block hashes up to the furthest hit point the disk may give."""
    num_in_memory: int
    """How many of them were cached in memory (group 0) when it was probed."""
    positions: list[tuple[int, int]]
    """(index, block group or ``STATE``) of the blocks being read, in the order read."""
    future: Future
    """The blocks read: the first ``len(result)`` of ``positions``."""


class DiskOffload:
    """Moves prompt blocks between ``pool`` (the runner's ``KVPool``) and ``tier``, and state
    checkpoints between ``state_pool`` (the runner's ``StatePool``; None without recurrent
    layers) and ``tier``.

    ``prefix_cache``: the scheduler's (its hashing); ``coordinator``: the engine's block pool and
    import calls; ``lookahead``: how many waiting requests are probed ahead (the scheduler admits
    at most ``max_num_seqs`` at once)."""

    def __init__(
        self, tier: DiskTier, prefix_cache, coordinator, pool, lookahead: int, state_pool=None, kv_bytes_per_token: int = 0
    ) -> None:
        self.tier = tier
        self.prefix_cache = prefix_cache
        self.coordinator = coordinator
        self.pool = pool
        self.state_pool = state_pool
        self.checkpoints = coordinator.state.checkpoints if coordinator.state is not None else None
        self.block_size = coordinator.block_size
        self.num_groups = len(coordinator.groups)
        self.lookahead = lookahead
        self._pending: dict[str, _PendingRead] = {}
        self._probed: set[tuple[str, int]] = set()  # (request id, preemptions): probed once each
        tier.max_file_bytes = self._max_file_bytes(kv_bytes_per_token)

    # ---- in --------------------------------------------------------------------------------

    def before_schedule(self, waiting, num_running: int) -> None:
        """Probe the next waiting requests and import what their reads brought; wait only for
        the reads of those the scheduler may admit now (one per free seat of the batch)."""
        if self.tier.enabled:
            with self._failing_turns_the_tier_off("reading"):
                self._bring_in(waiting, max(self.lookahead - num_running, 0))

    def _bring_in(self, waiting, seats: int) -> None:
        ahead = [request for _, request in zip(range(self.lookahead), waiting)]
        for request in ahead:
            self._probe(request)
        for position, request in enumerate(ahead):
            pending = self._pending.get(request.request_id)
            if pending is not None and (position < seats or pending.future.done()):
                del self._pending[request.request_id]
                self._import(request, pending)
        # Forget what is no longer ahead in the queue (admitted, aborted): both sets stay small.
        self._probed &= {(r.request_id, r.num_preemptions) for r in ahead}
        waiting_ids = {r.request_id for r in ahead}
        for request_id in [rid for rid in self._pending if rid not in waiting_ids]:
            if self._pending[request_id].future.done():
                del self._pending[request_id]

    def _probe(self, request: Request) -> None:
        key = (request.request_id, request.num_preemptions)
        if key in self._probed or request.is_finished:
            return
        self._probed.add(key)
        tokens = request.all_token_ids
        hashes = self.prefix_cache.hashes_of(request, len(tokens) - 1)
        cached = self.coordinator.pool.cached
        in_memory = next((i for i, h in enumerate(hashes) if h not in cached[0]), len(hashes))
        reach = in_memory
        while reach < len(hashes) and self.tier.has(hashes[reach]):
            reach += 1
        on_disk: dict[tuple[int, int], bool] = {}  # (index, group): asked of the tier once each

        def is_on_disk(i: int, group: int) -> bool:
            if (i, group) not in on_disk:
                on_disk[i, group] = self.tier.has(group_key(hashes[i], group))
            return on_disk[i, group]

        end = self._hit_point(hashes, reach, is_on_disk)
        positions = [(i, 0) for i in range(in_memory, end)] + self._needed(hashes, end)
        if positions:
            size = self.block_size
            keys = [group_key(hashes[i], g) for i, g in positions]
            chunks = [tuple(tokens[i * size : (i + 1) * size]) for i, _ in positions]
            kinds = ["state" if g == STATE else "kv" for _, g in positions]
            future = self.tier.read(keys, chunks, kinds)
            self._pending[request.request_id] = _PendingRead(hashes[:end], in_memory, positions, future)

    def _hit_point(self, hashes: list[bytes], reach: int, elsewhere) -> int:
        """The furthest hit point up to ``reach`` blocks (group 0 holds them, in memory or
        elsewhere) where what else a hit needs (``_needed``) is in memory or
        ``elsewhere(index, group)``; 0 if none."""
        for end in range(reach, 0, -1):
            if all(elsewhere(i, g) for i, g in self._needed(hashes, end)):
                return end
        return 0

    def _needed(self, hashes: list[bytes], end: int) -> list[tuple[int, int]]:
        """(index, group) of what a hit of ``end`` blocks needs besides group 0's chain and
        memory lacks: the blocks the other groups' windows reach, the state after the last block
        (``STATE``) for recurrent layers."""
        cached = self.coordinator.pool.cached
        needed = [
            (i, g)
            for g in range(1, self.num_groups)
            for i in range(self.coordinator.groups[g].first_needed_block(end * self.block_size), end)
            if hashes[i] not in cached[g]
        ]
        if self.checkpoints is not None and hashes[end - 1] not in self.checkpoints:
            needed.append((end - 1, STATE))
        return needed

    def _import(self, request: Request, pending: _PendingRead) -> None:
        """Put the blocks read into the pool, published under their hashes, up to the furthest
        hit point they (and memory) now allow (nothing if the blocks in memory before them were
        evicted meanwhile: the chain would be broken)."""
        read: dict[tuple[int, int], BlockBytes] = dict(zip(pending.positions, pending.future.result()))
        cached = self.coordinator.pool.cached[0]
        if not read or any(h not in cached for h in pending.hashes[: pending.num_in_memory]):
            return
        reach = min(pending.num_in_memory, len(pending.hashes))
        while (reach, 0) in read:
            reach += 1
        end = self._hit_point(pending.hashes, reach, lambda i, g: (i, g) in read)
        if end == 0:
            return
        chain = pending.hashes[:end]
        needed = self._needed(chain, end)
        state = read.get((end - 1, STATE)) if (end - 1, STATE) in needed else None
        positions = [(i, 0) for i in range(end)] + [(i, g) for i, g in needed if g != STATE]
        reserved = self.coordinator.reserve_import(chain, positions, checkpoint=state is not None)
        written = False
        try:
            if state is not None and reserved.checkpoint_slot is None:
                return  # every checkpoint slot is pinned: the blocks alone would resume nothing
            if reserved.taken:
                chosen = [read[t.index, t.group] for t in reserved.taken]
                self.pool.write_blocks(reserved.block_ids, to_arrays(chosen))
            if state is not None:
                self.state_pool.write_slot(reserved.checkpoint_slot, to_state(state))
            written = True
            request.num_disk_tokens = sum(t.group == 0 for t in reserved.taken) * self.block_size
        except ValueError as exc:  # another layout than this pool's: a bug or a foreign folder
            logger.warning("KV disk tier: blocks for %s do not fit the pool (%s); computing them", request.request_id, exc)
        finally:
            self.coordinator.finish_import(reserved, chain, request.all_token_ids, written)

    # ---- out -------------------------------------------------------------------------------

    def after_update(self, scheduled: list[ScheduledRequest]) -> None:
        """Queue the prompt blocks of the requests whose prefill completed in this step."""
        if not self.tier.enabled:
            return
        with self._failing_turns_the_tier_off("writing"):
            for item in scheduled:
                request = item.request
                done = item.num_computed_tokens + item.num_known_tokens
                if item.num_computed_tokens < request.num_prompt_tokens <= done:
                    self._offer(request)

    @contextmanager
    def _failing_turns_the_tier_off(self, what: str) -> Iterator[None]:
        """The tier is an optimisation: a fault of its own never fails a step."""
        try:
            yield
        except Exception as exc:
            logger.exception("KV disk tier: %s failed", what)
            self.tier.disable(f"{what} failed: {exc}")

    def _offer(self, request: Request) -> None:
        tokens = request.prompt_token_ids
        hashes = self.prefix_cache.hashes_of(request, len(tokens))
        cached = self.coordinator.pool.cached
        found = []  # (index, disk key, block id) of the cached prompt blocks the disk lacks
        for i, block_hash in enumerate(hashes):
            if block_hash not in cached[0]:
                break  # its KV is gone (or never published): nothing after it either
            for group in range(self.num_groups):  # a window group's early blocks may be gone: fine
                block = cached[group].get(block_hash)
                if block is not None and self.tier.wants(key := group_key(block_hash, group)):
                    found.append((i, key, block.block_id))
        self._offer_states(hashes, tokens)
        if not found:
            return
        per_block = self._bytes_per_block()
        found = [item for item in found if self.tier.admit_write(per_block)]
        if not found:
            return
        arrays = self.pool.read_blocks([block_id for *_, block_id in found])
        as_bytes, dtypes = to_bytes(arrays)
        size = self.block_size
        for n, (i, key, _) in enumerate(found):
            chunk = {name: a[:, n * size : (n + 1) * size] for name, a in as_bytes.items()}
            self.tier.write(BlockBytes(key, tuple(tokens[i * size : (i + 1) * size]), chunk, dtypes))

    def _offer_states(self, hashes: list[bytes], tokens: list[int]) -> None:
        """Queue the state checkpoints kept at the prompt's block boundaries that the disk lacks
        (each with the tokens of the block it follows)."""
        if self.checkpoints is None:
            return
        size, per_state = self.block_size, self.state_pool.layout.bytes_per_request
        for i, block_hash in enumerate(hashes):
            slot = self.checkpoints.slot_of(block_hash)
            key = group_key(block_hash, STATE)
            if slot is None or not self.tier.wants(key) or not self.tier.admit_write(per_state):
                continue
            arrays = self.state_pool.read_slot(slot)
            as_bytes, dtypes = to_bytes(arrays)
            self.tier.write(BlockBytes(key, tuple(tokens[i * size : (i + 1) * size]), as_bytes, dtypes, "state"))

    def _max_file_bytes(self, kv_bytes_per_token: int) -> int:
        """The largest file a block or a state of this model makes (``kv_bytes_per_token``: every
        layer's KV of one token, from the model's measured layout: the pool's arrays may not exist
        yet when the first read comes), and room for the header (an entry per array, the block's
        token ids, the metadata)."""
        per_state = self.state_pool.layout.bytes_per_request if self.state_pool is not None else 0
        num_layers = 2 * len(self.pool.keys) + (sum(map(len, self.state_pool.layout.layers.values())) if per_state else 0)
        return max(kv_bytes_per_token * self.block_size, per_state) + 65536 + 512 * num_layers + 32 * self.block_size

    def _bytes_per_block(self) -> int:
        arrays = [a for a in self.pool.arrays() if a is not None]
        return sum(a.nbytes // a.shape[1] for a in arrays) * self.block_size

    def close(self) -> None:
        self.tier.close()


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.float32`` -> ``"float32"`` (``getattr(mx, name)`` gives it back)."""
    return str(dtype).rsplit(".", 1)[-1]


def to_bytes(arrays: dict[str, mx.array]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """MLX arrays as the tier's bytes (``uint8``, last axis times the itemsize: one copy out of
    MLX, any dtype, bfloat16 too) and their dtypes' names; ``to_arrays``/``to_state`` undo it."""
    as_bytes = {name: np.array(a.view(mx.uint8)) for name, a in arrays.items()}
    return as_bytes, {name: dtype_name(a.dtype) for name, a in arrays.items()}


def to_state(state: BlockBytes) -> dict[str, mx.array]:
    """A state checkpoint read from disk as the state pool's arrays (``StatePool.write_slot``)."""
    return {name: mx.array(a).view(getattr(mx, state.dtypes[name])) for name, a in state.arrays.items()}


def to_arrays(blocks: list[BlockBytes]) -> dict[str, mx.array]:
    """Blocks read from disk as the pool's arrays, block after block along the slot axis."""
    names = blocks[0].arrays
    return {
        name: mx.concatenate([mx.array(b.arrays[name]) for b in blocks], axis=1).view(getattr(mx, blocks[0].dtypes[name]))
        for name in names
    }

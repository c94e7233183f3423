"""The scheduler's one front door to the KV cache (vLLM v1's ``KVCacheManager``).

Behind it: the coordinator (``core/kv/coordinator.py``: one block pool, a manager per kind — full
attention, sliding window, recurrent state — and one record per request), the requests' block
hashes (``BlockAwarePrefixCache``) and the per-tenant counters. The scheduler holds only this:
it asks it for a request's cached prefix, to allocate or free a request's slots, and, after a
step, to record what the step computed; it never combines the parts itself. Observers (engine
stats, cache snapshots, the inspector) read the cache through its read methods.

Per request, the cache's life is: ``get_computed_blocks`` → ``allocate_slots`` (admission, and
each step while it runs) → ``assign`` (what the model runner needs for the step) →
``complete_step`` (after the runner: publish full blocks and state checkpoints) → ``free``
(preemption keeps its hashes for the next admission; finishing forgets them).

Hybrid models resume a prefix only where a state checkpoint was kept (``core/kv/checkpoints.py``):
a step that ends on a block boundary writes one, and a prefill chunk is cut at the request's
checkpoint boundaries (``cut_at_checkpoint``): the last block boundary before the prompt's last
token, and a branch point found at admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.core.kv.block_pool import CacheBlock
from vllm_mlx.core.kv.coordinator import KVCacheCoordinator
from vllm_mlx.core.kv.observation import CacheStats, KVSnapshot, cache_stats, kv_snapshot
from vllm_mlx.core.kv.prefix_cache import BlockAwarePrefixCache, PrefixCacheStats
from vllm_mlx.core.kv.state_slots import NULL_STATE_SLOT
from vllm_mlx.core.kv.tenant_stats import TenantCacheCounters, TenantCacheStats
from vllm_mlx.core.request import Request


@dataclass
class CacheAssignment:
    """What the model runner needs from the cache for one request's step."""

    block_ids: list[int]
    """The request's (first block group's) block table."""
    state_slot: int = 0
    state_read_slot: int | None = None
    checkpoint_slot: int | None = None
    block_tables: list[list[int]] | None = None
    """With several block groups, the table of each; else None."""


class KVCacheManager:
    """Prefix lookup, allocation, per-step bookkeeping and freeing, for the scheduler."""

    def __init__(self, coordinator: KVCacheCoordinator, namespace: str = "", enable_caching: bool = True) -> None:
        self.coordinator = coordinator
        self.block_size = coordinator.block_size
        self.prefix_cache = BlockAwarePrefixCache(coordinator, namespace, enable_caching)
        self.tenants = TenantCacheCounters()
        """Prefix-cache counters per ``cache_salt`` (disclosed only where the operator allows)."""

    # ---- admission and growth ----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> list[CacheBlock]:
        """The blocks of the request's longest cached prefix that every layer group can resume
        from (no ref counting yet: ``allocate_slots`` takes them)."""
        return self.prefix_cache.find_cached_blocks(request)

    def allocate_slots(self, request: Request, num_tokens_total: int, computed: list[CacheBlock] | None = None) -> bool:
        """Cover ``num_tokens_total`` tokens (all or nothing). A running request first gives back
        the blocks its sliding windows no longer reach."""
        if computed is None:
            self.coordinator.free_out_of_window(request.request_id, request.num_computed_tokens)
        new_ids = self.coordinator.allocate_slots(request.request_id, num_tokens_total, computed)
        if new_ids is None:
            return False
        self.tenants.record_allocations(request.cache_salt, len(new_ids))
        return True

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if self.prefix_cache.enabled:
            self.prefix_cache.record_query(request.num_tokens, num_hit_tokens)
            self.tenants.record_query(request.cache_salt, request.num_tokens, num_hit_tokens)

    def cut_at_checkpoint(self, request: Request, start: int, num_new: int) -> int:
        """With state checkpoints, end the chunk from ``start`` at the first of the request's
        checkpoint boundaries it would cross (the rest is the next step's)."""
        if not self._checkpoints_kept():
            return num_new
        crossed = [b for b in self._checkpoint_boundaries(request) if start < b < start + num_new]
        return min(crossed) - start if crossed else num_new

    # ---- one step ------------------------------------------------------------------------------

    def assign(self, request: Request, num_new: int, speculative: bool = False) -> CacheAssignment:
        """The request's tables and state slots for a step computing ``num_new`` known tokens; a
        step ending on a block boundary also gets a state checkpoint slot (hybrid models), unless
        it verifies proposed tokens (``speculative``: where its state ends is not known yet)."""
        rid, state = request.request_id, self.coordinator.state
        slot = state.slot(rid) if state else NULL_STATE_SLOT
        read_slot = state.read_slot(rid) if state else NULL_STATE_SLOT
        on_boundary = (request.num_computed_tokens + num_new) % self.block_size == 0 and not speculative
        tables = self.coordinator.get_block_tables(rid)
        return CacheAssignment(
            block_ids=tables[0],
            state_slot=slot,
            state_read_slot=read_slot if read_slot != slot else None,
            checkpoint_slot=state.reserve_checkpoint(rid) if state and tables and on_boundary else None,
            block_tables=tables if len(tables) > 1 else None,
        )

    def complete_step(self, request: Request, num_computed_before: int, checkpointed: bool, succeeded: bool) -> None:
        """After the runner: publish the blocks the step filled and its state checkpoint, or,
        when the request's work failed, drop the checkpoint slot the step reserved."""
        rid = request.request_id
        if succeeded:
            self.prefix_cache.cache_computed_blocks(request, num_computed_before)
            if checkpointed:
                moving = request.num_computed_tokens not in self._checkpoint_boundaries(request)
                self.prefix_cache.publish_state_checkpoint(request, moving)
        if self.coordinator.state is not None:
            self.coordinator.state.finish_step(rid, succeeded)

    def free(self, request: Request, finished: bool) -> None:
        """Give back the request's blocks and state slot; a finished request's hashes go too
        (a preempted one keeps them for its next admission)."""
        self.coordinator.free(request.request_id)
        if finished:
            self.prefix_cache.forget(request.request_id)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def rolls_back_by_recompute(self) -> bool:
        """Whether rejected proposed tokens are undone by recomputing from the step's start: a
        recurrent layer's state after a step holds every token it saw, rejected ones too (the
        runner then keeps the state from before the step). Attention alone just forgets the
        rejected positions, whose slots are overwritten later."""
        return self.coordinator.state is not None

    def token_capacity(self, max_step_tokens: int) -> int:
        return self.coordinator.token_capacity(max_step_tokens)

    def has_room_for(self, num_tokens: int) -> bool:
        """Whether the free blocks could hold a first chunk of ``num_tokens`` in every block
        group's table (an estimate: a prefix hit would need fewer)."""
        return self.coordinator.get_num_free_blocks() >= self.coordinator.blocks_for_first_chunk(num_tokens)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's (first block group's) block table; empty while it holds none."""
        tables = self.coordinator.get_block_tables(request_id)
        return tables[0] if tables else []

    # ---- reads for observers -------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Counts of the block pool, state slots and checkpoints."""
        return cache_stats(self.coordinator)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache.stats()

    def tenant_stats(self) -> dict[str, TenantCacheStats]:
        """Prefix-cache counters per tenant label (``tenant_stats.py``), copies."""
        return self.tenants.copy()

    def view(self, include_blocks: bool = True) -> KVSnapshot:
        """The typed view (``kv_observation.kv_snapshot``); without ``include_blocks``, only
        ``block_size``, ``stats`` and ``block_groups``."""
        return kv_snapshot(self.coordinator, include_blocks)

    def snapshot(self, include_blocks: bool = True) -> dict:
        """``view()`` as plain data; without ``include_blocks``, only ``block_size``, ``stats``
        and ``block_groups`` (``blocks`` and ``free_queue`` empty)."""
        view = self.view(include_blocks)
        return view.to_dict() if include_blocks else view.to_short_dict()

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of unreferenced blocks (blocks in use keep theirs)."""
        return self.prefix_cache.reset()

    def check_requests(self, running: list[Request]) -> None:
        """Raise AssertionError if a running request's table does not cover its computed tokens
        or holds a shared block that is not full (prefix hits are whole blocks, so writes never
        touch a shared block). The block bookkeeping itself: ``kv_observation.check_invariants``."""
        for request in running:
            rid = request.request_id
            tables = self.coordinator.get_block_tables(rid)
            covered = len(tables[0]) * self.block_size if tables else 0
            _require(covered >= request.num_computed_tokens, f"{rid} table too short")
            for bid in {b for table in tables for b in table if b}:
                block = self.coordinator.pool.blocks[bid]
                shared_partial = block.ref_cnt > 1 and block.block_hash is None
                _require(not shared_partial, f"{rid} holds shared partial block {bid}")

    def _checkpoints_kept(self) -> bool:
        state = self.coordinator.state
        return state is not None and state.checkpoints is not None

    def _checkpoint_boundaries(self, request: Request) -> tuple[int, ...]:
        """Where the request keeps state checkpoints that newer ones do not supersede: its
        branch point and its prompt's last boundary (``core/kv/checkpoints.py``)."""
        branch = self.prefix_cache.branch_point(request)
        prompt = checkpoint_boundary(request, self.block_size)
        return (prompt,) if branch is None else (branch, prompt)


def checkpoint_boundary(request: Request, block_size: int) -> int:
    """The last block boundary before the prompt's last token: as far as the same prompt can
    ever be resumed from a cached prefix (at least one token is always computed)."""
    return (request.num_prompt_tokens - 1) // block_size * block_size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

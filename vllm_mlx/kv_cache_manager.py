"""The scheduler's one front door to the KV cache (vLLM v1's ``KVCacheManager``).

Behind it: the block pool's bookkeeping with its block groups, recurrent-state slots and state
checkpoints (``PagedCacheManager``), and the requests' block hashes (``BlockAwarePrefixCache``).
The scheduler asks it for a request's cached prefix, to allocate or free a request's slots, and,
after a step, to record what the step computed; it never combines the parts itself.

Per request, the cache's life is: ``get_computed_blocks`` → ``allocate_slots`` (admission, and
each step while it runs) → ``assign`` (what the model runner needs for the step) →
``complete_step`` (after the runner: publish full blocks and state checkpoints) → ``free``
(preemption keeps its hashes for the next admission; finishing forgets them).

Hybrid models resume a prefix only where a state checkpoint was kept (``state_checkpoints.py``):
a step that ends on a block boundary writes one, and a prefill chunk is cut at the request's
checkpoint boundaries (``cut_at_checkpoint``): the last block boundary before the prompt's last
token, and a branch point found at admission.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.block_pool import CacheBlock
from vllm_mlx.paged_cache import PagedCacheManager
from vllm_mlx.prefix_cache import BlockAwarePrefixCache
from vllm_mlx.request import Request
from vllm_mlx.tenant_stats import TenantCacheCounters


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

    def __init__(self, blocks: PagedCacheManager, namespace: str = "", enable_caching: bool = True) -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.prefix_cache = BlockAwarePrefixCache(blocks, namespace, enable_caching)
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
            self.blocks.free_out_of_window(request.request_id, request.num_computed_tokens)
        new_ids = self.blocks.allocate_slots(request.request_id, num_tokens_total, computed)
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
        if self.blocks.checkpoints is None:
            return num_new
        crossed = [b for b in self._checkpoint_boundaries(request) if start < b < start + num_new]
        return min(crossed) - start if crossed else num_new

    # ---- one step ------------------------------------------------------------------------------

    def assign(self, request: Request, num_new: int) -> CacheAssignment:
        """The request's tables and state slots for a step computing ``num_new`` tokens; a step
        ending on a block boundary also gets a state checkpoint slot (hybrid models)."""
        rid = request.request_id
        slot = self.blocks.get_state_slot(rid)
        read_slot = self.blocks.get_state_read_slot(rid)
        on_boundary = (request.num_computed_tokens + num_new) % self.block_size == 0
        tables = self.blocks.get_block_tables(rid)
        return CacheAssignment(
            block_ids=tables[0],
            state_slot=slot,
            state_read_slot=read_slot if read_slot != slot else None,
            checkpoint_slot=self.blocks.reserve_state_checkpoint(rid) if on_boundary else None,
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
        self.blocks.finish_step(rid, succeeded)

    def free(self, request: Request, finished: bool) -> None:
        """Give back the request's blocks and state slot; a finished request's hashes go too
        (a preempted one keeps them for its next admission)."""
        self.blocks.free(request.request_id)
        if finished:
            self.prefix_cache.forget(request.request_id)

    # ---- queries -------------------------------------------------------------------------------

    def token_capacity(self, max_step_tokens: int) -> int:
        return self.blocks.token_capacity(max_step_tokens)

    def has_room_for(self, num_tokens: int) -> bool:
        """Whether the free blocks could hold a first chunk of ``num_tokens`` (an estimate)."""
        return self.blocks.get_num_free_blocks() >= self.blocks.num_blocks_needed(num_tokens)

    def held_block_ids(self, request: Request) -> list[int]:
        """Every block the request's tables hold (all groups; no null block)."""
        return [b for table in self.blocks.get_block_tables(request.request_id) for b in table if b]

    def _checkpoint_boundaries(self, request: Request) -> tuple[int, ...]:
        """Where the request keeps state checkpoints that newer ones do not supersede: its
        branch point and its prompt's last boundary (``state_checkpoints.py``)."""
        branch = self.prefix_cache.branch_point(request)
        prompt = checkpoint_boundary(request, self.block_size)
        return (prompt,) if branch is None else (branch, prompt)


def checkpoint_boundary(request: Request, block_size: int) -> int:
    """The last block boundary before the prompt's last token: as far as the same prompt can
    ever be resumed from a cached prefix (at least one token is always computed)."""
    return (request.num_prompt_tokens - 1) // block_size * block_size

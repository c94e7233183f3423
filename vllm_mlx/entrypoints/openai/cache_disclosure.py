"""What of the engine's cache numbers a caller may read: no prefix-cache oracle by default.

A prefix hit moves many numbers: the hit counters and hit rate, cached-token counts, block
allocations (a hit takes no new block), the count of cached blocks and their letters in the
block grid, the free queue's order (a hit takes its block from the middle, a miss from the
head), physical usage while the blocks are shared with a running request, even the step count
(fewer prefill chunks). Each of them tells a caller whether its guess of the start of another
tenant's prompt (same ``cache_salt``, or none) was right, one block at a time.

So unless the operator discloses hits (``ServingOptions.discloses_prefix_hits``), a caller reads
only numbers that follow from the live requests' statuses and lengths (``public_stats``): the
pool's size, running and waiting counts, preemptions, recurrent-state slots, and the blocks in
use counted as the running requests' lengths (prompt + output tokens) rounded up to whole
blocks, as if no block were shared. The block grid is that count of ``u`` after the null block,
then ``f`` (``public_block_states``): lengths to the nearest block, no positions.

The KV disk tier's counters move with hits too (a prompt found on disk is read, not written;
the folder grows by what was not there), so undisclosed a caller reads only whether the tier
is on and its budgets (``disk_view``).

Disclosed, the engine's stats go out as they are; the per-tenant counters
(``stats["prefix_cache_tenants"]``, see ``vllm_mlx/core/kv/tenant_stats.py``) only with ``per_tenant``
(``--enable-cache-stats-disclosure``), since they also tell of other tenants' traffic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_mlx.core.sched.observation import RequestView
from vllm_mlx.core.snapshot import SnapshotStats
from vllm_mlx.engine.kv_disk import DiskTierStats

DISK_PUBLIC_FIELDS = ("enabled", "disabled_reason", "budget_bytes", "write_bytes_per_hour")
"""What of the disk tier's stats any caller reads; the counters only where hits are disclosed."""


def disk_view(disk: DiskTierStats, disclose: bool) -> dict:
    """The disk tier's stats for a caller; never its folder (the server's file system)."""
    data = disk.to_dict()
    shown = DISK_PUBLIC_FIELDS if not disclose else [key for key in data if key != "path"]
    return {key: data[key] for key in shown}


@dataclass
class PublicStats:
    """The stats any caller may read (module docstring): the pool's size, the scheduler's
    counts, the state slots, and the blocks in use counted from the live requests' lengths."""

    num_blocks: int
    block_size: int
    running: int
    waiting: int
    preemptions: int
    num_state_slots: int
    num_used_state_slots: int
    num_used_blocks: int
    """Whole blocks the running requests' tokens fill, each counted alone (none shared)."""
    num_free_blocks: int
    usage: float

    def to_dict(self, tenants: bool = False) -> dict:
        """Plain data (``tenants`` is ignored: no per-tenant counter is public)."""
        return asdict(self)


def visible(stats: SnapshotStats, requests: dict[str, RequestView], *, disclose: bool) -> SnapshotStats | PublicStats:
    """The stats a caller reads: the engine's own (``disclose``), else ``public_stats``."""
    return stats if disclose else public_stats(stats, requests)


def visible_stats(
    stats: SnapshotStats, requests: dict[str, RequestView], *, disclose: bool, per_tenant: bool = False
) -> dict:
    """``visible`` as the JSON an endpoint sends; the per-tenant counters only with ``per_tenant``."""
    return visible(stats, requests, disclose=disclose).to_dict(tenants=per_tenant)


def public_stats(stats: SnapshotStats, requests: dict[str, RequestView]) -> PublicStats:
    """Numbers no prefix hit changes (module docstring); ``requests``: the snapshot's."""
    num_blocks = stats.num_blocks
    used = logical_used_blocks(requests, stats.block_size, num_blocks)
    usage = used / num_blocks if num_blocks else 0.0
    return PublicStats(
        num_blocks, stats.block_size, stats.running, stats.waiting, stats.preemptions, stats.num_state_slots,
        stats.num_used_state_slots, num_used_blocks=used, num_free_blocks=num_blocks - used, usage=usage,
    )  # fmt: skip


def logical_used_blocks(requests: dict[str, RequestView], block_size: int, num_blocks: int) -> int:
    """Whole blocks the running requests' tokens fill, each counted alone (none shared)."""
    running = [view for view in requests.values() if view.status == "RUNNING"]
    lengths = (view.num_prompt_tokens + view.num_output_tokens for view in running)
    return min(num_blocks, sum(-(-length // block_size) for length in lengths))


def public_block_states(num_grid_blocks: int, num_used: int) -> str:
    """A grid of ``num_grid_blocks`` letters (the null block first) without positions: the
    null block, ``num_used`` used blocks, the rest free."""
    num_used = min(num_used, max(num_grid_blocks - 1, 0))
    return ("n" + "u" * num_used).ljust(num_grid_blocks, "f")[:num_grid_blocks]

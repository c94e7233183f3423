"""The scheduler's one front door to the KV cache: a request's cache life through
``KVCacheManager`` alone (no MLX), for a hybrid model with state checkpoints."""

from __future__ import annotations

from vllm_mlx.core.kv.coordinator import KVCacheCoordinator
from vllm_mlx.core.kv.manager import KVCacheManager
from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.prefix_cache import PrefixCacheManager
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.core.sched.scheduler import Scheduler, SchedulerConfig


def hybrid_manager() -> KVCacheManager:
    blocks = PagedCacheManager(num_blocks=32, block_size=4, num_state_slots=3, num_state_checkpoints=4)
    return KVCacheManager(blocks, namespace="model")


def run_step(kv: KVCacheManager, request: Request, num_new: int, computed=None) -> None:
    """Allocate, assign, "run" and complete one step of ``num_new`` tokens."""
    start = request.num_computed_tokens
    assert kv.allocate_slots(request, start + num_new, computed)
    cache = kv.assign(request, num_new)
    request.num_computed_tokens += num_new
    kv.complete_step(request, start, cache.checkpoint_slot is not None, succeeded=True)


def test_a_prompt_is_cut_at_its_checkpoint_and_the_same_prompt_resumes_there():
    kv = hybrid_manager()
    first = Request("a", list(range(18)), SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(first) == []
    # The prompt's last boundary before its last token is 16: a 12-token chunk from 8 stops there.
    assert kv.cut_at_checkpoint(first, 8, 12) == 8 and kv.cut_at_checkpoint(first, 0, 8) == 8
    run_step(kv, first, 16, computed=[])
    assert kv.coordinator.checkpoints.keys() == [kv.prefix_cache.request_hashes(first)[3]]
    run_step(kv, first, 2)
    kv.free(first, finished=True)

    again = Request("b", list(range(18)), SamplingParams(max_tokens=4))
    hits = kv.get_computed_blocks(again)
    assert len(hits) * 4 == 16
    assert kv.allocate_slots(again, 18, hits)
    cache = kv.assign(again, 2)  # its first step reads the checkpoint, writes its own slot
    assert cache.state_read_slot == kv.coordinator.checkpoints.slot_of(hits[-1].block_hash) != cache.state_slot
    again.num_computed_tokens = 18
    kv.complete_step(again, 16, cache.checkpoint_slot is not None, succeeded=True)
    assert kv.assign(again, 1).state_read_slot is None  # then its own slot
    kv.coordinator.check_invariants()


def test_a_preempted_request_keeps_its_hashes_and_a_failed_step_publishes_nothing():
    kv = hybrid_manager()
    request = Request("a", list(range(10)), SamplingParams(max_tokens=4))
    run_step(kv, request, 8, computed=[])  # ends on a boundary: a checkpoint
    kv.free(request, finished=False)  # preempted
    assert kv.coordinator.requests["a"].block_hashes  # kept for its next admission
    request.num_computed_tokens = 0
    assert len(kv.get_computed_blocks(request)) == 2
    assert kv.allocate_slots(request, 12, kv.get_computed_blocks(request))
    request.num_computed_tokens = 8
    cache = kv.assign(request, 4)  # 8 + 4 = 12: another boundary
    assert cache.checkpoint_slot is not None
    kv.complete_step(request, 8, checkpointed=True, succeeded=False)
    assert len(kv.coordinator.checkpoints) == 1  # only the first one
    kv.free(request, finished=True)
    assert "a" not in kv.coordinator.requests
    kv.coordinator.check_invariants()


def test_room_for_a_first_chunk_counts_the_blocks_of_every_block_group():
    # A full-attention group and a sliding-window one: a first chunk takes its blocks in both.
    kv = KVCacheManager(PagedCacheManager(num_blocks=9, block_size=4, group_windows=(None, 8)))
    assert kv.has_room_for(16)  # 4 blocks in each table: the 8 free blocks
    assert not kv.has_room_for(20)  # 5 + 5 > 8, though one table's 5 would fit
    request = Request("a", list(range(20)), SamplingParams(max_tokens=4))
    assert not kv.allocate_slots(request, 20, [])  # the estimate agrees with the allocation
    assert kv.allocate_slots(request, 16, [])
    assert not kv.has_room_for(1)
    kv.free(request, finished=True)
    assert kv.has_room_for(16) and kv.stats().num_used_blocks == 0


def test_the_scheduler_holds_the_kv_cache_only_through_its_manager():
    sched = Scheduler(SchedulerConfig(block_size=4), PagedCacheManager(num_blocks=8, block_size=4))
    parts = [name for name, value in vars(sched).items() if isinstance(value, (KVCacheCoordinator, PrefixCacheManager))]
    assert parts == [] and isinstance(sched.kv, KVCacheManager)


def test_stats_count_the_checkpoint_slots_before_any_is_kept():
    stats = hybrid_manager().stats()
    assert (stats.num_state_slots, stats.num_state_checkpoints, stats.num_cached_state_checkpoints) == (2, 4, 0)

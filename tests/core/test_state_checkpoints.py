"""Recurrent-state checkpoints as bookkeeping: slots pending, keyed, pinned, evicted, and the
KV manager's front door cutting hits back to where a checkpoint is kept. (The engine-level
oracles, caching on == off and hits per conversation turn, are in test_recurrent.py.)"""

from __future__ import annotations

import pytest

from vllm_mlx.core.kv.checkpoints import StateCheckpoints
from vllm_mlx.core.kv.paged_cache import PagedCacheManager


def publish_key(checkpoints: StateCheckpoints, request_id: str, key: bytes, moving: bool = False) -> int:
    slot = checkpoints.reserve(request_id)
    checkpoints.publish(request_id, key, moving)
    return slot


def test_a_reserved_slot_is_keyed_on_publish_and_free_again_on_cancel():
    checkpoints = StateCheckpoints(first_slot=5, num_slots=2)
    assert checkpoints.reserve("a") == 5 and checkpoints.reserve("a") == 5  # one pending per request
    assert checkpoints.pending_slot("a") == 5 and b"k" not in checkpoints
    checkpoints.publish("a", b"k", moving=False)
    assert checkpoints.slot_of(b"k") == 5 and checkpoints.pending_slot("a") is None
    assert checkpoints.reserve("b") == 6
    checkpoints.cancel("b")  # its step failed
    assert checkpoints.reserve("c") == 6
    checkpoints.publish("c", b"k", moving=False)  # the same state is kept already: slot freed
    assert checkpoints.keys() == [b"k"] and checkpoints.reserve("d") == 6
    checkpoints.check_invariants({"d"})


def test_eviction_takes_the_least_recently_used_unpinned_checkpoint():
    checkpoints = StateCheckpoints(first_slot=1, num_slots=2)
    publish_key(checkpoints, "a", b"old")
    publish_key(checkpoints, "b", b"new")
    assert checkpoints.pin("c", b"old") == 1  # a hit uses it: most recently used, and pinned
    assert checkpoints.keys() == [b"new", b"old"]
    assert checkpoints.reserve("d") == 2 and checkpoints.keys() == [b"old"]  # "new" evicted
    assert checkpoints.reserve("e") is None  # "old" is pinned, "d" pends: nothing to take
    checkpoints.unpin("c")
    assert checkpoints.reserve("e") == 1 and len(checkpoints) == 0 and checkpoints.evictions == 2
    checkpoints.check_invariants({"d", "e"})


def test_a_newer_moving_checkpoint_demotes_the_previous_one_but_not_the_prompts():
    checkpoints = StateCheckpoints(first_slot=1, num_slots=3)
    publish_key(checkpoints, "a", b"prompt")
    publish_key(checkpoints, "other", b"other")
    publish_key(checkpoints, "a", b"decode-1", moving=True)
    checkpoints.reserve("a")  # the next boundary: decode-1 goes first, it is superseded
    assert checkpoints.keys() == [b"prompt", b"other"]
    checkpoints.publish("a", b"decode-2", moving=True)
    checkpoints.release("a")  # finished: its checkpoints stay for the next turn
    assert checkpoints.keys() == [b"prompt", b"other", b"decode-2"]


def test_drop_and_reset_spare_pinned_checkpoints():
    checkpoints = StateCheckpoints(first_slot=1, num_slots=3)
    for key in (b"x", b"y", b"z"):
        publish_key(checkpoints, key.decode(), key)
    checkpoints.pin("r", b"y")
    checkpoints.drop(b"x")
    checkpoints.drop(b"y")  # pinned: its request holds the block it ends
    assert checkpoints.keys() == [b"z", b"y"]
    checkpoints.reset()
    assert checkpoints.keys() == [b"y"]
    with pytest.raises(AssertionError, match="requests without blocks"):
        checkpoints.check_invariants(set())
    checkpoints.release("r")
    checkpoints.check_invariants(set())


def manager_with_prompt_cached() -> PagedCacheManager:
    """Request "a" computed 3 blocks of 4 tokens and kept a checkpoint after the second."""
    kv = PagedCacheManager(num_blocks=8, block_size=4, num_state_slots=3, num_state_checkpoints=2)
    kv.allocate_slots("a", 12)
    kv.cache_full_blocks("a", [b"h1", b"h2", b"h3"], list(range(12)), num_full_blocks=3)
    assert kv.reserve_state_checkpoint("a") == 3  # after the running slots 1 and 2
    kv.finish_step("a", succeeded=True)
    kv.publish_state_checkpoint("a", b"h2", moving=False)
    return kv


def test_a_hit_ends_at_the_last_checkpoint_and_reads_it_in_its_first_step():
    kv = manager_with_prompt_cached()
    hits = kv.get_computed_blocks("b", [b"h1", b"h2", b"h3"])
    assert [b.block_hash for b in hits] == [b"h1", b"h2"]  # h3 is cached, but no state there
    assert kv.num_cached_blocks([b"h1", b"h2", b"h3", b"h4"]) == 3
    kv.allocate_slots("b", 10, hits)
    assert kv.get_state_slot("b") == 2 and kv.get_state_read_slot("b") == 3
    kv.check_invariants()
    kv.finish_step("b", succeeded=True)
    assert kv.get_state_read_slot("b") == 2
    with pytest.raises(ValueError, match="no state checkpoint"):
        kv.allocate_slots("c", 8, [kv.cached_blocks[b"h1"]])
    assert kv.get_block_ids("c") == [] and kv.stats().num_used_state_slots == 2


def test_a_checkpoint_goes_with_the_block_carrying_its_hash():
    kv = manager_with_prompt_cached()
    kv.free("a")
    kv.allocate_slots("big", 7 * 4)  # takes every block: the cached ones are evicted
    assert len(kv.checkpoints) == 0 and kv.stats().num_cached_state_checkpoints == 0
    kv.check_invariants()


def test_a_failed_step_frees_its_reserved_checkpoint_and_without_caching_none_is_kept():
    kv = manager_with_prompt_cached()
    assert kv.reserve_state_checkpoint("a") == 4
    kv.finish_step("a", succeeded=False)
    assert kv.checkpoints.pending_slot("a") is None and kv.checkpoints.keys() == [b"h2"]
    kv.check_invariants()
    off = PagedCacheManager(num_blocks=8, block_size=4, enable_caching=False, num_state_slots=3, num_state_checkpoints=2)
    off.allocate_slots("a", 4)
    assert off.checkpoints is None and off.reserve_state_checkpoint("a") is None and not off.resumes_prefixes


def test_a_request_that_ends_leaves_nothing_but_its_published_checkpoints():
    kv = manager_with_prompt_cached()
    kv.allocate_slots("b", 10, kv.get_computed_blocks("b", [b"h1", b"h2"]))
    assert kv.requests["b"].resumes_from == b"h2" and kv.requests["b"].state_slot == 2
    assert kv.reserve_state_checkpoint("b") == 4 and kv.requests["b"].pending_checkpoint_slot == 4
    kv.free("b")  # aborted mid-step: its slot, pin and pending slot go with its record
    kv.forget("b")
    assert kv.reserve_state_checkpoint("a") == 4
    kv.finish_step("a", succeeded=True)
    kv.publish_state_checkpoint("a", b"h3", moving=True)
    assert kv.requests["a"].latest_checkpoint == b"h3"
    kv.free("a")  # finished
    kv.forget("a")
    assert kv.requests == {} and kv.state_slots.owners() == {} and kv.checkpoints.snapshot()["pending"] == {}
    assert kv.checkpoints.keys() == [b"h2", b"h3"] and kv.stats().num_used_state_slots == 0
    kv.check_invariants()


@pytest.mark.parametrize("value", [-1, 2.5, "8", True])
def test_a_bad_max_state_checkpoints_is_refused_naming_the_option(value):
    from vllm_mlx.engine.core import EngineConfig

    with pytest.raises(ValueError, match="max_state_checkpoints must be an int >= 0"):
        EngineConfig(max_state_checkpoints=value).normalize()

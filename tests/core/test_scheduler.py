"""Scheduler unit tests: token budgets, chunked prefill, preemption, prefix hits, stops.

The "runner" here is the scheduler's own test driver: it samples a deterministic token that is a
pure function of the request's tokens, so any schedule (batched, chunked, preempted, cached) must
produce exactly the same outputs as a plain sequential reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.request import Request, RequestStatus, SamplingParams
from vllm_mlx.core.sched.scheduler import (
    ModelRunnerOutput,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 1  # never produced by natural_token (which gives 10..59) unless a test forces it


def natural_token(context: list[int]) -> int:
    return sum(context) % 50 + 10


_KV_STORES: weakref.WeakKeyDictionary[PagedCacheManager, dict[int, int]] = (
    weakref.WeakKeyDictionary()
)


class FakeRunner:
    """A model stand-in that keeps a real "KV store": computing position p writes its token id
    into physical slot ``block_ids[p // bs] * bs + p % bs``, and a sample reads the whole context
    back through the block table. So a wrong prefix hit, a block registered before its KV was
    computed, or a write into a shared block changes the sampled tokens (or fails loudly).
    """

    def __init__(
        self, kv_cache: PagedCacheManager, token_fn: Callable[[list[int]], int] = natural_token
    ) -> None:
        self.kv_cache = kv_cache
        self.token_fn = token_fn
        # physical slot -> token id whose "KV" it holds; the store belongs to the pool
        self.slots: dict[int, int] = _KV_STORES.setdefault(kv_cache, {})
        self.steps: list[list[tuple[str, int, int, bool]]] = []

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids), "a request scheduled twice in one step"
        for s in out.scheduled:  # the forward pass writes every scheduled token's KV ...
            self._write(s)
        sampled = {}  # ... then attention reads the context through the block table
        for s in out.scheduled:
            if s.samples:
                sampled[s.request_id] = self.token_fn(self._read(s))
        self.steps.append([(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples)
                           for s in out.scheduled])  # fmt: skip
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _slot(self, block_ids: list[int], pos: int) -> int:
        bs = self.kv_cache.block_size
        return block_ids[pos // bs] * bs + pos % bs

    def _write(self, s) -> None:
        assert s.num_new_tokens > 0
        assert s.num_computed_tokens == s.request.num_computed_tokens
        end = s.num_computed_tokens + s.num_new_tokens
        assert len(s.block_ids) * self.kv_cache.block_size >= end, "table too short"
        tokens = s.request.all_token_ids
        for pos in range(s.num_computed_tokens, end):
            block = self.kv_cache.blocks[s.block_ids[pos // self.kv_cache.block_size]]
            assert block.ref_cnt == 1 and block.block_hash is None, "write into a shared block"
            self.slots[self._slot(s.block_ids, pos)] = tokens[pos]

    def _read(self, s) -> list[int]:
        return [self.slots[self._slot(s.block_ids, p)] for p in range(s.request.num_tokens)]


def make_scheduler(
    num_blocks: int = 64, block_size: int = 16, namespace: str = "", **config
) -> Scheduler:
    kv = PagedCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(block_size=block_size, **config), kv, namespace)


def make_request(rid: str, prompt: list[int] | int, salt: str | None = None, **params) -> Request:
    if isinstance(prompt, int):
        seed = sum(map(ord, rid))  # different ids, different prompts
        prompt = [(7 * i + seed) % 97 for i in range(prompt)]
    params.setdefault("max_tokens", 8)
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids={EOS}, cache_salt=salt)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    advanced = sched.update_from_output(out, runner(out))
    sched.check_invariants()
    sched.kv.coordinator.check_invariants()
    return out, advanced


def run_scheduler(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        step(sched, runner)
        steps += 1
        assert steps <= max_steps, "scheduler made no progress"
    return steps


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """What a request generates when run alone, token by token (the spec of the stop checks)."""
    p = request.sampling_params
    tokens, out = list(request.prompt_token_ids), []
    while True:
        t = sum(tokens) % 50 + 10
        out.append(t)
        tokens.append(t)
        may_stop = len(out) > p.min_tokens
        if may_stop and (t in p.stop_token_ids or (not p.ignore_eos and t == EOS)):
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= p.max_tokens or len(tokens) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH_CAPPED


def used_blocks(sched: Scheduler) -> int:
    return sched.kv.coordinator.stats().num_used_blocks


# ---- construction and admission ----------------------------------------------------------


def test_effective_max_model_len_is_min_of_config_and_pool():
    assert make_scheduler(num_blocks=9, block_size=4).max_model_len == 32
    assert make_scheduler(num_blocks=9, block_size=4, max_model_len=20).max_model_len == 20
    assert make_scheduler(num_blocks=9, block_size=4, max_model_len=99).max_model_len == 32
    no_chunk = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=24)
    assert no_chunk.max_model_len == 25  # a preempted request must fit in one step again


def test_rejects_inconsistent_config():
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=16), PagedCacheManager(8, 4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=0)


def test_prompt_too_long_errors_alone():
    sched = make_scheduler(num_blocks=7, block_size=4)  # 6 usable blocks = 24 tokens
    too_long, ok = make_request("long", 24), make_request("ok", 23, max_tokens=4)
    sched.add_request(too_long)
    sched.add_request(ok)
    assert too_long.status == RequestStatus.FINISHED_ERROR and too_long.finish_reason == "error"
    assert too_long.error_message == (
        "prompt has 24 tokens but the limit is 24 (context length / KV cache capacity)"
    )
    assert sched.get_request("long") is None and sched.num_waiting == 1
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    assert ok.output_token_ids == reference_output(ok, 24)[0]
    assert ok.status == RequestStatus.FINISHED_LENGTH_CAPPED  # 23 + 1 reaches the limit
    assert ok.num_output_tokens == 1


def test_prompt_limit_from_config_max_model_len():
    sched = make_scheduler(max_model_len=20)
    r = make_request("r", 20)
    sched.add_request(r)
    assert r.status == RequestStatus.FINISHED_ERROR
    assert "prompt has 20 tokens but the limit is 20" in r.error_message


def test_duplicate_live_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))


# ---- chunked prefill and budgets ----------------------------------------------------------


def test_chunked_prefill_splits_prompt_and_samples_on_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=32)
    r = make_request("r", 100, max_tokens=3)
    sched.add_request(r)
    runner = FakeRunner(sched.kv.coordinator)
    chunks = []
    for _ in range(4):
        out, advanced = step(sched, runner)
        ((_, start, num_new, samples),) = runner.steps[-1]  # recorded before the update
        chunks.append((start, num_new, samples))
        assert advanced == ([r] if samples else [])
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert r.num_computed_tokens == 100 and r.num_output_tokens == 1
    step(sched, runner)
    assert runner.steps[-1] == [("r", 100, 1, True)]
    run_scheduler(sched, runner)
    assert r.output_token_ids == reference_output(r, 10**9)[0]


def test_decodes_come_before_a_new_prefill_which_gets_the_leftover_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    a, b = make_request("a", 10, max_tokens=20), make_request("b", 10, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10), ("b", 10)]
    c = make_request("c", 100)
    sched.add_request(c)
    out, advanced = step(sched, runner)
    got = [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
    assert got == [("a", 10, 1), ("b", 10, 1), ("c", 0, 30)]
    assert advanced == [a, b]
    out, _ = step(sched, runner)
    got = [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]
    assert got == [("a", 11, 1), ("b", 11, 1), ("c", 30, 30)]


def test_running_prefill_is_capped_and_later_requests_wait_for_budget():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("long", 50))
    sched.add_request(make_request("short", 5))
    runner = FakeRunner(sched.kv.coordinator)
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 32)]
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 18), ("short", 5)]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 4, max_tokens=3) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched.kv.coordinator)
    seen_running = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        assert len(out.scheduled) <= 2
        seen_running.append(sched.num_running)
    assert max(seen_running) == 2
    assert runner.steps[0] == [("r0", 0, 4, True), ("r1", 0, 4, True)]
    assert runner.steps[3][0][0] == "r2"  # admitted only once r0 and r1 finished (3 tokens)
    for r in reqs:
        assert r.output_token_ids == reference_output(r, 10**9)[0]


def test_chunked_prefill_off_waits_for_a_step_with_room():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_request("a", 10, max_tokens=5), make_request("b", 10, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    out, _ = step(sched, runner)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 10)]
    run_scheduler(sched, runner)
    assert a.output_token_ids == reference_output(a, 17)[0]


# ---- preemption ------------------------------------------------------------------------------


def _preemption_requests() -> list[Request]:
    return [make_request(rid, 8, max_tokens=10) for rid in ("a", "b")]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tiny_pool_preempts_most_recent_which_resumes_with_identical_output(prefix_caching):
    big = make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=prefix_caching)
    for r in _preemption_requests():
        big.add_request(r)
    expected = {}
    run_scheduler(big, FakeRunner(big.kv.coordinator))
    assert big.num_preemptions == 0
    for r in big_reqs(big, _preemption_requests()):
        expected[r.request_id] = r.output_token_ids

    # 6 usable blocks of 4 tokens; each request grows to 17 computed tokens (5 blocks).
    sched = make_scheduler(num_blocks=7, block_size=4, enable_prefix_caching=prefix_caching)
    a, b = _preemption_requests()
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    preempted_at = None
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        if out.preempted_ids and preempted_at is None:
            preempted_at = sched.step_id
            assert out.preempted_ids == ["b"]
            assert [s.request_id for s in out.scheduled] == ["a"]  # no admission this step
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert sched.waiting[0] is b and sched.kv.coordinator.get_block_ids("b") == []
        assert sched.step_id < 200
    assert preempted_at is not None
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert sched.num_preemptions == b.num_preemptions
    assert a.output_token_ids == expected["a"] and b.output_token_ids == expected["b"]
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert used_blocks(sched) == 0


def test_a_step_that_preempts_admits_nobody():
    # 4 blocks of 4 tokens, budget 3: at step 7 "a" needs a third block and preempts "b"; one
    # block and 2 tokens of budget are then left, enough to readmit "b" — yet only step 8 does.
    sched = make_scheduler(
        num_blocks=5, block_size=4, max_num_batched_tokens=3, enable_prefix_caching=False
    )
    a, b = make_request("a", 4, max_tokens=12), make_request("b", 4, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    outs = [step(sched, runner)[0] for _ in range(8)]
    assert runner.steps[5] == [("a", 7, 1, True), ("b", 6, 1, True)]
    assert outs[6].preempted_ids == ["b"] and runner.steps[6] == [("a", 8, 1, True)]
    assert sched.kv.coordinator.get_num_free_blocks() == 0  # b took the free block in step 8
    assert runner.steps[7] == [("a", 9, 1, True), ("b", 0, 2, False)]
    run_scheduler(sched, runner)
    assert a.output_token_ids == reference_output(a, 16)[0]
    assert b.output_token_ids == reference_output(b, 16)[0]


def big_reqs(sched: Scheduler, fresh: list[Request]) -> list[Request]:
    """Run ``fresh`` copies alone on a big pool (the reference schedule) and return them."""
    for r in fresh:
        solo = make_scheduler(num_blocks=64, block_size=sched.block_size)
        solo.add_request(r)
        run_scheduler(solo, FakeRunner(solo.kv.coordinator))
    return fresh


def test_a_lone_request_preempts_itself_and_resumes():
    # Two requests, each needing the whole pool at its end; the head keeps running.
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2)  # 16 tokens
    a, b = make_request("a", 4, max_tokens=11), make_request("b", 4, max_tokens=11)
    sched.add_request(a)
    sched.add_request(b)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    for r in (a, b):
        assert r.output_token_ids == reference_output(r, 16)[0]
    assert b.num_preemptions >= 1 and used_blocks(sched) == 0


def test_resumed_request_gets_prefix_hits_on_its_own_old_blocks():
    sched = make_scheduler(num_blocks=7, block_size=4)
    a, b = _preemption_requests()
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    resumed = None
    while resumed is None:
        was_preempted = b.status == RequestStatus.PREEMPTED
        out = sched.schedule()
        if was_preempted:
            resumed = next((s for s in out.scheduled if s.request_id == "b"), None)
        sched.update_from_output(out, runner(out))
    # b was preempted with 3 full hashed blocks, freed tail first; "a" then took (evicted) the
    # two tail blocks, so b's first block is all that is left to hit.
    assert runner.steps[5] == [("a", 12, 1, True)]
    assert (resumed.num_computed_tokens, resumed.num_new_tokens) == (4, 9)
    assert b.num_cached_tokens == 0  # only the first admission sets it
    run_scheduler(sched, runner)


# ---- aborts and external finishes ---------------------------------------------------------------


def test_abort_mid_prefill_frees_blocks():
    sched = make_scheduler(max_num_batched_tokens=32)
    r = make_request("r", 100)
    sched.add_request(r)
    step(sched, FakeRunner(sched.kv.coordinator))
    assert used_blocks(sched) == 2
    assert sched.abort_request("r") is r
    assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    assert used_blocks(sched) == 0 and not sched.has_unfinished_requests()
    sched.check_invariants()


def test_abort_mid_decode_frees_blocks_and_others_continue():
    sched = make_scheduler()
    a, b = make_request("a", 20, max_tokens=6), make_request("b", 20, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    step(sched, runner)
    step(sched, runner)
    assert a.num_output_tokens == 2
    sched.abort_request("a")
    assert sched.kv.coordinator.get_block_ids("a") == [] and sched.running == [b]
    run_scheduler(sched, runner)
    assert a.num_output_tokens == 2 and b.output_token_ids == reference_output(b, 10**9)[0]
    assert used_blocks(sched) == 0


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    step(sched, FakeRunner(sched.kv.coordinator))
    assert sched.abort_request("b").status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0 and sched.num_running == 1


def test_abort_unknown_or_finished_is_a_noop():
    sched = make_scheduler()
    assert sched.abort_request("nope") is None
    r = make_request("r", 4, max_tokens=1)
    sched.add_request(r)
    step(sched, FakeRunner(sched.kv.coordinator))
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.abort_request("r") is None
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched.kv.coordinator)
    out = sched.schedule()
    runner_output = runner(out)
    sched.abort_request("a")
    advanced = sched.update_from_output(out, runner_output)
    assert advanced == [b]
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 0
    assert sched.kv.coordinator.get_block_ids("a") == []
    sched.check_invariants()
    sched.kv.coordinator.check_invariants()


def test_finish_request_for_stop_strings_and_errors():
    sched = make_scheduler()
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, FakeRunner(sched.kv.coordinator))
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "###")
    assert a.stop_reason == "###" and a.finish_reason == "stop"
    sched.finish_request("b", RequestStatus.FINISHED_ERROR, "boom")
    assert b.error_message == "boom" and b.status == RequestStatus.FINISHED_ERROR
    assert used_blocks(sched) == 0 and not sched.has_unfinished_requests()
    with pytest.raises(ValueError):
        sched.finish_request("x", RequestStatus.RUNNING)


def test_missing_sampled_token_errors_that_request_only():
    sched = make_scheduler()
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    advanced = sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"b": 11}))
    assert advanced == [a, b]
    assert a.status == RequestStatus.FINISHED_ERROR and "no token" in a.error_message
    assert b.output_token_ids == [11] and sched.running == [b]
    assert sched.kv.coordinator.get_block_ids("a") == []


# ---- prefix caching -------------------------------------------------------------------------------


def test_same_prompt_hits_full_blocks_and_starts_after_them():
    sched = make_scheduler()
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 + 8
    first = make_request("first", prompt, max_tokens=3)
    sched.add_request(first)
    runner = FakeRunner(sched.kv.coordinator)
    step(sched, runner)
    assert sched.kv.coordinator.stats().num_cached_blocks == 2
    first_blocks = sched.kv.coordinator.get_block_ids("first")

    second = make_request("second", prompt, max_tokens=3)
    sched.add_request(second)
    out, _ = step(sched, runner)
    s = next(s for s in out.scheduled if s.request_id == "second")
    assert (s.num_computed_tokens, s.num_new_tokens) == (32, 8)
    assert s.block_ids[:2] == first_blocks[:2] and s.block_ids[2] != first_blocks[2]
    assert second.num_cached_tokens == 32
    assert sched.snapshot()["second"]["num_cached_tokens"] == 32
    kv = sched.kv.coordinator.stats()
    assert (kv.prefix_queries, kv.prefix_hits) == (80, 32)
    run_scheduler(sched, runner)
    assert second.output_token_ids == first.output_token_ids


def test_hit_after_the_first_request_finished_revives_cached_free_blocks():
    sched = make_scheduler()
    prompt = list(range(100, 140))
    first = make_request("first", prompt, max_tokens=2)
    sched.add_request(first)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    assert used_blocks(sched) == 0
    second = make_request("second", prompt, max_tokens=2)
    sched.add_request(second)
    out, _ = step(sched, FakeRunner(sched.kv.coordinator))
    assert out.scheduled[0].num_computed_tokens == 32 and second.num_cached_tokens == 32


def test_prompt_of_exact_blocks_recomputes_its_last_block():
    sched = make_scheduler()
    prompt = list(range(200, 232))  # exactly 32 tokens
    sched.add_request(make_request("first", prompt, max_tokens=2))
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    again = make_request("again", prompt, max_tokens=2)
    sched.add_request(again)
    out, _ = step(sched, FakeRunner(sched.kv.coordinator))
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (16, 16)
    assert again.num_cached_tokens == 16


def test_cache_salt_separates_prefixes():
    sched = make_scheduler()
    prompt = list(range(100, 140))
    runner = FakeRunner(sched.kv.coordinator)
    sched.add_request(make_request("a", prompt, salt="alice", max_tokens=1))
    run_scheduler(sched, runner)
    for rid, salt, hit in (("b", "bob", 0), ("c", None, 0), ("d", "alice", 32)):
        r = make_request(rid, prompt, salt=salt, max_tokens=1)
        sched.add_request(r)
        run_scheduler(sched, runner)
        assert r.num_cached_tokens == hit, rid


def test_cache_namespace_separates_models_sharing_a_pool():
    kv = PagedCacheManager(64, 16)
    config = SchedulerConfig(block_size=16)
    prompt = list(range(100, 140))
    model_a, model_b = Scheduler(config, kv, "model-a"), Scheduler(config, kv, "model-b")
    model_a.add_request(make_request("a", prompt, max_tokens=1))
    run_scheduler(model_a, FakeRunner(kv))
    r = make_request("b", prompt, max_tokens=1)
    model_b.add_request(r)
    run_scheduler(model_b, FakeRunner(kv))
    assert r.num_cached_tokens == 0


def test_decoded_tokens_fill_and_register_blocks():
    sched = make_scheduler(block_size=4)
    r = make_request("r", 6, max_tokens=10)
    sched.add_request(r)
    runner = FakeRunner(sched.kv.coordinator)
    step(sched, runner)  # computes 6 tokens: 1 full block
    assert sched.kv.coordinator.stats().num_cached_blocks == 1
    step(sched, runner)  # computes token 7 (the first sampled one): still 1 full block
    assert r.num_computed_tokens == 7 and sched.kv.coordinator.stats().num_cached_blocks == 1
    step(sched, runner)  # 8 computed: block 2 full
    assert sched.kv.coordinator.stats().num_cached_blocks == 2


def test_prefix_caching_disabled_never_hits():
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 140))
    for rid in ("a", "b"):
        r = make_request(rid, prompt, max_tokens=1)
        sched.add_request(r)
        run_scheduler(sched, FakeRunner(sched.kv.coordinator))
        assert r.num_cached_tokens == 0
    assert sched.kv.coordinator.stats().num_cached_blocks == 0


# ---- token-level stops ------------------------------------------------------------------------------


def test_eos_stops_with_no_reason():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=10)
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator, lambda ctx: EOS))
    assert r.output_token_ids == [EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_min_tokens_suppresses_eos():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=10, min_tokens=3)
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator, lambda ctx: EOS))
    # The first three tokens may not stop; the fourth (generated after min_tokens) does.
    assert r.output_token_ids == [EOS] * 4 and r.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=4, ignore_eos=True)
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator, lambda ctx: EOS))
    assert r.output_token_ids == [EOS] * 4
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_id_finishes_with_it_as_reason():
    probe = make_request("r", 5, max_tokens=20)
    natural, _ = reference_output(probe, 10**9)
    k = next(i for i in range(2, 20) if natural[i] not in natural[:i])
    stop_id = natural[k]
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=20, stop_token_ids=[stop_id])
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    assert r.output_token_ids == natural[: k + 1]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == stop_id


def test_stop_token_id_suppressed_by_min_tokens():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=6, min_tokens=2, stop_token_ids=[42])
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator, lambda ctx: 42))
    assert r.output_token_ids == [42, 42, 42] and r.stop_reason == 42


def test_max_tokens_caps_length():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=7)
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    assert r.num_output_tokens == 7 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.finish_reason == "length" and r.stop_reason is None


def test_max_model_len_caps_length():
    sched = make_scheduler(max_model_len=12)
    r = make_request("r", 10, max_tokens=7)
    sched.add_request(r)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    assert r.num_tokens == 12 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---- observation -----------------------------------------------------------------------------------


def test_stats_and_snapshot_are_plain_data():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 4))
    step(sched, FakeRunner(sched.kv.coordinator))
    stats = sched.stats()
    assert {k: stats[k] for k in ("running", "waiting", "preemptions", "steps")} == {
        "running": 1, "waiting": 1, "preemptions": 0, "steps": 1,
    }  # fmt: skip
    assert stats["kv_cache"]["num_used_blocks"] == 2
    snap = sched.snapshot()
    assert list(snap) == ["a", "b"]
    assert snap["a"] == {
        "status": "RUNNING", "num_prompt_tokens": 20, "num_computed_tokens": 20,
        "num_cached_tokens": 0, "num_output_tokens": 1, "num_preemptions": 0, "block_ids": [1, 2],
        "num_disk_tokens": 0,
    }  # fmt: skip
    assert snap["b"]["status"] == "WAITING" and snap["b"]["block_ids"] == []


def test_step_ids_increase_and_empty_steps_are_empty():
    sched = make_scheduler()
    first, second = sched.schedule(), sched.schedule()
    assert (first.step_id, second.step_id) == (1, 2)
    assert first.is_empty and first.num_scheduled_tokens == 0
    assert sched.update_from_output(first, ModelRunnerOutput()) == []


# ---- property test: random add / step / abort over a tiny pool --------------------------------------

PROP_EOS = 23  # produced now and then by natural_token


class SchedulerMachine(RuleBasedStateMachine):
    """Random joins, steps and aborts on 12 blocks of 4 tokens: no leaks, no lost requests, and
    every request that ends on its own generated exactly what it generates alone."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = PagedCacheManager(13, 4)
        config = SchedulerConfig(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
        self.sched = Scheduler(config, self.kv)
        self.runner = FakeRunner(self.kv)
        self.added: list[Request] = []

    @rule(
        length=st.integers(1, 60),
        data=st.data(),
        max_tokens=st.integers(1, 12),
        salt=st.sampled_from([None, None, "s"]),
        key=st.sampled_from(["", "", "client-a", "client-b"]),
    )
    def add(self, length, data, max_tokens, salt, key):
        prompt = data.draw(st.lists(st.sampled_from([3, 4, 5]), min_size=length, max_size=length))
        request = Request(
            f"r{len(self.added)}", prompt, SamplingParams(max_tokens=max_tokens),
            eos_token_ids={PROP_EOS}, cache_salt=salt, fairness_key=key,
        )  # fmt: skip
        self.sched.add_request(request)
        self.added.append(request)
        if length >= self.sched.max_model_len:
            assert request.status == RequestStatus.FINISHED_ERROR

    @rule()
    def step(self):
        out = self.sched.schedule()
        assert not {s.request_id for s in out.scheduled} & set(out.preempted_ids), "ran a preempted request"
        self.sched.update_from_output(out, self.runner(out))

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), between=st.booleans())
    def abort(self, data, between):
        live = [*self.sched.running, *self.sched.waiting]
        victim = data.draw(st.sampled_from(live))
        if between:  # abort a request after it was scheduled, before the step's update
            out = self.sched.schedule()
            runner_output = self.runner(out)
            self.sched.abort_request(victim.request_id)
            self.sched.update_from_output(out, runner_output)
        else:
            self.sched.abort_request(victim.request_id)
        assert victim.status == RequestStatus.FINISHED_ABORTED
        assert self.kv.get_block_ids(victim.request_id) == []

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        self.sched.check_invariants()
        for r in self.sched.running:
            assert len(self.kv.get_block_ids(r.request_id)) * 4 >= r.num_computed_tokens

    def teardown(self):
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            self.consistent()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.kv.stats().num_used_blocks == 0, "blocks leaked"
        for r in self.added:
            assert r.is_finished, f"{r.request_id} lost"
            if r.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                expected, status = reference_output_eos(r, self.sched.max_model_len)
                assert (r.output_token_ids, r.status) == (expected, status), r.request_id


def reference_output_eos(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    tokens, out = list(request.prompt_token_ids), []
    while True:
        t = sum(tokens) % 50 + 10
        out.append(t)
        tokens.append(t)
        if t == PROP_EOS:
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= request.sampling_params.max_tokens or len(tokens) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH_CAPPED


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_a_request_that_cannot_be_admitted_yet_is_passed_over_within_a_bound():
    """``admission_check`` False (its adapter has no slot): the requests behind it are admitted
    past it, its own key's later requests wait with it, and after ``MAX_ADMISSION_PASSES`` steps
    nobody passes it any more."""
    from vllm_mlx.core.sched.scheduler import MAX_ADMISSION_PASSES

    sched = make_scheduler()
    runner = FakeRunner(sched.kv.coordinator)
    blocked = make_request("blocked", 20, max_tokens=500, ignore_eos=True)
    blocked.fairness_key = "tenant"
    behind_in_its_key = make_request("same-key", 20, max_tokens=500, ignore_eos=True)
    behind_in_its_key.fairness_key = "tenant"
    others = [make_request(f"other-{i}", 20, max_tokens=500, ignore_eos=True) for i in range(2)]
    sched.admission_check = lambda request: request is not blocked
    for request in [blocked, behind_in_its_key, *others]:
        sched.add_request(request)
    out, _ = step(sched, runner)
    assert [a.request_id for a in out.admitted] == ["other-0", "other-1"] and blocked.admission_passes == 1
    for _ in range(MAX_ADMISSION_PASSES):
        step(sched, runner)
    late = make_request("late", 20)
    sched.add_request(late)
    out, _ = step(sched, runner)
    assert out.admitted == [] and late.status == RequestStatus.WAITING  # the queue waits with it now
    sched.admission_check = None  # its slot is free
    out, _ = step(sched, runner)
    assert [a.request_id for a in out.admitted][:1] == ["blocked"]


def test_an_admission_check_that_fails_ends_that_request_alone():
    sched = make_scheduler()
    runner = FakeRunner(sched.kv.coordinator)
    failing, fine = make_request("failing", 20), make_request("fine", 20)

    def check(request: Request) -> bool:
        if request is failing:
            raise RuntimeError("its slot could not be written")
        return True

    sched.admission_check = check
    sched.add_request(failing)
    sched.add_request(fine)
    out, _ = step(sched, runner)
    assert out.failed == [failing] and failing.status == RequestStatus.FINISHED_ERROR
    assert "internal error" in failing.error_message and [a.request_id for a in out.admitted] == ["fine"]
    run_scheduler(sched, runner)
    assert used_blocks(sched) == 0

"""Fair admission: one caller's many prompts (or large ``n``) cannot starve another caller.

Scheduler-level, with the scheduler tests' deterministic runner (a real KV "store" through the
block tables), so fairness is checked together with the outputs it must not change.
"""

from __future__ import annotations

from test_scheduler import FakeRunner, make_request, make_scheduler, reference_output, step

from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.core.sched.waiting_queue import WaitingQueue


def keyed_request(rid: str, key: str, prompt: int = 8, **params) -> Request:
    request = make_request(rid, prompt, **params)
    request.fairness_key = key
    return request


# ---- the queue --------------------------------------------------------------------------------


def test_one_request_per_key_is_plain_fifo():
    queue = WaitingQueue()
    requests = [make_request(f"r{i}", 4) for i in range(5)]
    for r in requests:
        queue.append(r)
    taken = []
    while queue:
        taken.append(queue.peek())
        queue.pop(taken[-1])
    assert taken == requests


def test_keys_take_turns_and_each_key_stays_in_order():
    queue = WaitingQueue()
    big = [keyed_request(f"big-{i}", "big") for i in range(4)]
    small = [keyed_request(f"small-{i}", "small") for i in range(2)]
    for r in [*big, *small]:
        queue.append(r)
    order = []
    while queue:
        order.append(queue.peek().request_id)
        queue.pop(queue.peek())
    assert order == ["big-0", "small-0", "big-1", "small-1", "big-2", "big-3"]


def test_the_least_loaded_key_goes_first_and_a_preempted_request_resumes_first():
    queue = WaitingQueue()
    a0, a1, b0 = keyed_request("a0", "a"), keyed_request("a1", "a"), keyed_request("b0", "b")
    for r in (a0, a1, b0):
        queue.append(r)
    assert queue.peek({"a": 3}) is b0  # "a" already runs three requests
    assert queue.peek({"a": 1, "b": 1}) is a0  # equal load: rotation order
    back = keyed_request("a-preempted", "a")
    queue.appendleft(back)
    assert queue.peek() is back and list(queue)[:2] == [back, a0]
    queue.remove(a1)
    assert len(queue) == 3 and a1 not in list(queue)


# ---- the scheduler ------------------------------------------------------------------------------


def test_a_small_request_is_served_within_a_few_steps_of_a_huge_one():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv.coordinator)
    huge = [keyed_request(f"huge-{i}", "huge", max_tokens=20) for i in range(60)]
    for r in huge:
        sched.add_request(r)
    for _ in range(3):  # the huge request fills every seat
        step(sched, runner)
    assert {r.fairness_key for r in sched.running} == {"huge"} and len(sched.running) == 4
    small = keyed_request("small", "small", max_tokens=3)
    sched.add_request(small)
    steps = 0
    while not small.is_finished:
        step(sched, runner)
        steps += 1
    assert steps <= 3 + 2, f"the small request took {steps} steps"  # admitted at once, then 3 tokens
    assert sched.num_preemptions == 1  # one seat was taken back from the huge request, no more
    while sched.has_unfinished_requests():
        step(sched, runner)
    for r in [*huge, small]:  # fairness changes the order of work, never the outputs
        assert (r.output_token_ids, r.status) == reference_output(r, sched.max_model_len)
    assert sched.kv.coordinator.stats().num_used_blocks == 0


def test_fair_preemption_does_not_thrash_between_equal_keys():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv.coordinator)
    for key in ("a", "b"):
        for i in range(6):
            sched.add_request(keyed_request(f"{key}-{i}", key, max_tokens=6))
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        load = [r.fairness_key for r in sched.running]
        assert abs(load.count("a") - load.count("b")) <= 1 or not sched.waiting
    assert sched.num_preemptions == 0  # two equal clients share the seats without preempting


def test_under_block_pressure_the_small_request_finishes_before_the_heavy_ones():
    # Seats are free but blocks are short: the heavy key's requests preempt each other for them.
    sched = make_scheduler(num_blocks=1 + 12, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv.coordinator)
    heavy = [keyed_request(f"heavy-{i}", "heavy", prompt=11, max_tokens=12) for i in range(4)]
    for r in heavy:
        sched.add_request(r)
    step(sched, runner)
    small = keyed_request("small", "small", prompt=7, max_tokens=2)
    sched.add_request(small)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert small.finish_time < min(r.finish_time for r in heavy)
    for r in [*heavy, small]:
        assert (r.output_token_ids, r.status) == reference_output(r, sched.max_model_len)
    assert sched.kv.coordinator.stats().num_used_blocks == 0


def test_n_completions_share_one_key_in_the_engine(tiny_model_dir):
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=str(tiny_model_dir), max_num_seqs=4, num_kv_blocks=128)
    try:
        engine.add_request("Hello there", SamplingParams(n=6, max_tokens=24, ignore_eos=True, seed=1), "wide")
        for _ in range(4):
            engine.step()
        small = engine.add_request("Hi", SamplingParams(max_tokens=2, ignore_eos=True, seed=2), "small")
        finished_at = None
        for step_index in range(60):
            for output in engine.step():
                if output.request_id == small and output.finished:
                    finished_at = step_index
            if finished_at is not None:
                break
        assert finished_at is not None and finished_at <= 4, finished_at
        keys = {r.fairness_key for r in engine.scheduler.running}
        assert keys <= {"wide"}
    finally:
        engine.shutdown()

"""The tensor-parallel tests' two sides: ``run_batch`` (the same workload for the 2-rank engine and
the single-process one) and the scenarios each rank runs (``SCENARIOS``), one launch per test
module (``rank_scenarios.launch_scenarios``; ``python tests/distributed/tp_driver.py OUT_DIR``
under ``mlx.launch``). In each, rank 0 runs an engine and writes what it did, the other ranks
run ``worker_loop`` and write their ``WorkerStats``:

- ``batch``: ``run_batch``, and the heads rank 0's KV pool holds (a model that cannot be split,
  or ranks given different models, are refused there, on every rank);
- ``poison``: the same, with ``poison_the_runner``;
- ``spec``: the same with n-gram speculation (``SPECULATION``), and its proposed and accepted
  token counts;
- ``traffic``: ``measure_traffic`` instead: what each step handed its collectives."""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rank_scenarios import LAUNCH_TIMEOUT, Scenario, launch_ranks, run_scenarios

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",  # a prefix hit
    "Why?",
    "A much longer prompt " * 6,
]
# 12 usable blocks of 4 tokens cannot hold every request (preemption); 8 tokens a step (chunks).
ENGINE_OPTIONS = {"block_size": 4, "num_kv_blocks": 13, "max_num_batched_tokens": 8, "seed": 0}
# Always three proposals where lookup finds any: the rows verify them on every rank.
SPECULATION = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}}


def run_batch(engine) -> dict:
    """Staggered arrivals (one every third step), run to the end: greedy tokens per prompt, the
    steps' preemptions, prefix hits and prefill chunks, and the KV cache's block groups (plain
    data)."""
    from vllm_mlx.core.request import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids, final = [], {}
    for step in range(2000):
        if step % 3 == 0 and len(ids) < len(PROMPTS):
            ids.append(engine.add_request(PROMPTS[len(ids)], params, request_id=f"p{len(ids)}"))
        elif not engine.has_unfinished_requests():
            break
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    records = list(engine.step_records)
    return {
        "tokens": [final[i].outputs[0].token_ids for i in ids],
        "errors": [final[i].error for i in ids],
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hits": sum(len(r.prefix_hits) for r in records),
        "chunks": sum(1 for r in records for q in r.requests if not q.is_decode and q.num_new_tokens > 1),
        "block_groups": len(engine.kv_cache.group_windows),
    }


def speculation_counts(engine) -> dict:
    """The proposed tokens the engine's recorded steps verified, and how many were kept."""
    rows = [q for record in engine.step_records for q in record.requests]
    return {"proposed": sum(q.num_draft_tokens for q in rows), "accepted": sum(q.num_accepted_tokens for q in rows)}


def launch_two_ranks(model_dir: Path, out_prefix: Path, *args: str, driver: Path | str):
    """``driver`` on two ranks, given the model, the output prefix and ``args``: one launch per
    test, for tests/distributed/test_tensor_parallel_failures.py, whose ranks die or hang (the
    other modules share a launch: ``rank_scenarios``); the test skips where ``mlx.launch``
    cannot run and fails on a timeout."""
    import pytest

    done = launch_ranks(driver, [str(model_dir), str(out_prefix), *args], LAUNCH_TIMEOUT)
    if done.timed_out:
        pytest.fail(f"two ranks did not finish in {LAUNCH_TIMEOUT} s:\n{done.output[-3000:]}")
    return done


POISON = "p3"  # with ``poison``: every step whose batch holds this request fails, on every rank


@contextmanager
def poison_the_runner():
    """While inside, every step that runs the ``POISON`` request raises before its forward (alike
    on every rank, before any collective): rank 0 re-runs such a batch request by request, and so
    do the workers, from its messages. The stock method is back afterwards."""
    from vllm_mlx.executor.model_runner import MLXModelRunner

    stock = MLXModelRunner.execute_model

    def execute_model(self, scheduler_output):
        if any(s.request_id == POISON for s in scheduler_output.scheduled):
            raise ValueError("poisoned request")
        return stock(self, scheduler_output)

    MLXModelRunner.execute_model = execute_model
    try:
        yield
    finally:
        MLXModelRunner.execute_model = stock


# Prompts of different lengths arriving together: the first step prefills them all in two padded
# forward calls (the long one alone: padding the short ones to it would cost more than a call),
# the next ones decode the four in one.
TRAFFIC_PROMPTS = ["Why?", "The quick brown fox jumps over the lazy dog.", "One two three four five", "A much longer prompt " * 12]
TRAFFIC_OPTIONS = {"max_num_batched_tokens": 256, "seed": 0}


@dataclass
class MeasuredStep:
    """What one step on rank 0 handed ``mx.distributed.all_sum``, and what the cost model needs
    to predict it: the tokens of its forward calls (padding included) and its message's size."""

    padded_tokens: int = 0
    forward_calls: int = 0
    message_bytes: int = 0
    all_sum_bytes: list[int] = field(default_factory=list)
    collective_seconds: float = 0.0
    """Wall time inside the all_sums (inputs evaluated first), waiting for the other rank included."""


@contextmanager
def metered(engine):
    """While inside, rank 0's collectives, messages and forward calls go into the yielded list's
    last ``MeasuredStep`` (the caller appends one per step). Timing evaluates each all_sum on the
    spot: the same arithmetic, evaluated in smaller pieces."""
    import mlx.core as mx

    from vllm_mlx.distributed import protocol  # the engine looks send_message up there at each call
    from vllm_mlx.executor.model_runner import group_for_padding

    steps: list[MeasuredStep] = []
    stock_sum, stock_send, runner = mx.distributed.all_sum, protocol.send_message, engine.runner

    def all_sum(x, *args, **kwargs):
        mx.eval(x)
        start = time.perf_counter()
        out = stock_sum(x, *args, **kwargs)
        mx.eval(out)
        steps[-1].collective_seconds += time.perf_counter() - start
        steps[-1].all_sum_bytes.append(x.nbytes)
        return out

    def send_message(group, message):
        steps[-1].message_bytes = len(message.to_bytes())
        stock_send(group, message)

    def execute_model(scheduler_output):
        calls = group_for_padding(scheduler_output.scheduled, runner.pads)
        steps[-1].forward_calls += len(calls)
        steps[-1].padded_tokens += sum(len(c) * max(s.num_new_tokens for s in c) for c in calls)
        return type(runner).execute_model(runner, scheduler_output)

    mx.distributed.all_sum, protocol.send_message, runner.execute_model = all_sum, send_message, execute_model
    try:
        yield steps
    finally:
        mx.distributed.all_sum, protocol.send_message = stock_sum, stock_send
        del runner.execute_model


def measure_traffic(engine) -> list[dict]:
    """``TRAFFIC_PROMPTS`` run to the end (greedy, 6 tokens each): one ``MeasuredStep`` per step
    that ran a forward."""
    from vllm_mlx.core.request import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(TRAFFIC_PROMPTS):
        engine.add_request(prompt, params, request_id=f"t{i}")
    with metered(engine) as steps:
        while engine.has_unfinished_requests():
            steps.append(MeasuredStep())
            engine.step()
    return [dataclasses.asdict(s) for s in steps if s.forward_calls]


def worker(group, scenario: Scenario) -> dict:
    """A rank > 0 of any scenario: ``worker_loop`` until rank 0's engine stops, its ``WorkerStats``."""
    from vllm_mlx.engine.rank_worker import worker_loop

    return dataclasses.asdict(worker_loop(scenario.model_for(group.rank()), group=group))


def tp_engine(model: str, options: dict):
    from vllm_mlx.engine.core import EngineCore

    return EngineCore(model=model, tensor_parallel=True, force_model_takeover=True, **options)


def batch(group, scenario: Scenario) -> dict:
    if group.rank() > 0:
        return worker(group, scenario)
    engine = tp_engine(scenario.model, ENGINE_OPTIONS)
    try:
        result = run_batch(engine)
        return {**result, "kv_heads": engine.runner.pool.keys[0].shape[0]}  # this rank's slice ([heads, slots, dim])
    finally:
        engine.shutdown()  # sends "stop": the workers return


def spec(group, scenario: Scenario) -> dict:
    if group.rank() > 0:
        return worker(group, scenario)
    engine = tp_engine(scenario.model, {**ENGINE_OPTIONS, **SPECULATION})
    try:
        return {**run_batch(engine), **speculation_counts(engine)}
    finally:
        engine.shutdown()


def poison(group, scenario: Scenario) -> dict:
    with poison_the_runner():
        return batch(group, scenario)


def traffic(group, scenario: Scenario) -> dict:
    if group.rank() > 0:
        return worker(group, scenario)
    engine = tp_engine(scenario.model, TRAFFIC_OPTIONS)
    try:
        return {"steps": measure_traffic(engine)}
    finally:
        engine.shutdown()


SCENARIOS = {"batch": batch, "poison": poison, "spec": spec, "traffic": traffic}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)

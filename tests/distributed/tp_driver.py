"""The tensor-parallel test's two sides: ``run_batch`` (the same workload for the 2-rank engine and
the single-process one) and ``main`` (what each rank of ``mlx.launch -n 2`` runs).

``python tests/distributed/tp_driver.py MODEL_DIR OUT_PREFIX [MODE]`` under ``mlx.launch``: rank 0 writes
``OUT_PREFIX.rank0.json`` (tokens and what the steps did), rank 1 ``OUT_PREFIX.rank1.json``
(its ``WorkerStats``). MODE ``poison``: see ``poison_the_runner``; ``traffic``: rank 0 runs
``measure_traffic`` instead and writes what each step handed its collectives;
``other-model=DIR``: ranks > 0 load DIR instead, and a rank refused at start-up writes the error
to ``OUT_PREFIX.rankN.refused`` and exits 0 (so the launcher does not kill the other rank before
it has written its own)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",  # a prefix hit
    "Why?",
    "A much longer prompt " * 6,
]
# 12 usable blocks of 4 tokens cannot hold every request (preemption); 8 tokens a step (chunks).
ENGINE_OPTIONS = {"block_size": 4, "num_kv_blocks": 13, "max_num_batched_tokens": 8, "seed": 0}


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


TESTS = Path(__file__).parent  # tests/distributed: the ranks import from it, from tests/ and from the repository
LAUNCH_TIMEOUT = 400  # seconds: two model loads and ~40 steps take ~30 s on 2 cores, 4 min with 6 other jobs


def launch_two_ranks(model_dir: Path, out_prefix: Path, *args: str, driver: Path | str = __file__):
    """``driver`` (this one by default) on two ranks (``ring_launch``: its own session, killed
    whole on timeout), given the model, the output prefix and ``args``; the test skips where
    ``mlx.launch`` cannot run and fails on a timeout."""
    import mlx.core as mx
    import pytest

    from vllm_mlx.distributed.launch import LaunchError, launch_ring

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    try:
        done = launch_ring(str(driver), [str(model_dir), str(out_prefix), *args],
                           timeout=LAUNCH_TIMEOUT, pythonpath=[str(TESTS.parents[1]), str(TESTS.parent), str(TESTS)])  # fmt: skip
    except LaunchError as exc:
        pytest.skip(str(exc))
    if done.timed_out:
        pytest.fail(f"two ranks did not finish in {LAUNCH_TIMEOUT} s:\n{done.output[-3000:]}")
    return done


POISON = "p3"  # with ``poison``: every step whose batch holds this request fails, on every rank


def poison_the_runner() -> None:
    """Make every step that runs the ``POISON`` request raise before its forward (alike on every
    rank, before any collective): rank 0 re-runs such a batch request by request, and so do the
    workers, from its messages."""
    from vllm_mlx.executor.model_runner import MLXModelRunner

    stock = MLXModelRunner.execute_model

    def execute_model(self, scheduler_output):
        if any(s.request_id == POISON for s in scheduler_output.scheduled):
            raise ValueError("poisoned request")
        return stock(self, scheduler_output)

    MLXModelRunner.execute_model = execute_model


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


def main(model_dir: str, out_prefix: str, mode: str = "") -> None:
    from vllm_mlx.distributed.group import TensorParallelError, init_group

    if mode == "poison":
        poison_the_runner()
    group = init_group()
    if mode.startswith("other-model=") and group.rank() > 0:
        model_dir = mode.removeprefix("other-model=")
    try:
        run_rank(group, model_dir, Path(f"{out_prefix}.rank{group.rank()}.json"), mode)
    except TensorParallelError as exc:
        if not mode.startswith("other-model="):
            raise
        Path(f"{out_prefix}.rank{group.rank()}.refused").write_text(str(exc))


def run_rank(group, model_dir: str, out: Path, mode: str = "") -> None:
    from vllm_mlx.engine.rank_worker import worker_loop

    if group.rank() == 0:
        from vllm_mlx.engine.core import EngineCore

        options = TRAFFIC_OPTIONS if mode == "traffic" else ENGINE_OPTIONS
        engine = EngineCore(model=model_dir, tensor_parallel=True, force_model_takeover=True, **options)
        try:
            if mode == "traffic":
                result = {"steps": measure_traffic(engine)}
            else:
                result = run_batch(engine)
                result["kv_heads"] = engine.runner.pool.keys[0].shape[0]  # this rank's slice ([heads, slots, dim])
        finally:
            engine.shutdown()  # sends "stop": the workers return
    else:
        result = dataclasses.asdict(worker_loop(model_dir, group=group))
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])

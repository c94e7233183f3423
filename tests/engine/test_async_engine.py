"""AsyncEngineCore on real MLX (the tiny llama): threads, asyncio, streaming, aborts, failures.

Every wait is bounded (``bounded``/``wait_until``): a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time

import pytest

from factories import wait_until
from vllm_mlx import SamplingParams
from vllm_mlx.engine.async_engine import AsyncEngineCore, EngineDeadError
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.models.registry import get_registry
from vllm_mlx.platform.errors import ModelSourceError

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten",
    "Why?",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)  # seconds: aborts land mid-stream
TIMEOUT = 30.0


# -- helpers ----------------------------------------------------------------------------------


def bounded(fn, timeout: float = TIMEOUT):
    """Run ``fn()`` on a daemon thread; return its result, re-raise its error, fail on a hang."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def engine_used_blocks(engine: AsyncEngineCore) -> int:
    return engine.call(lambda e: e.kv_cache.stats().num_used_blocks, timeout=TIMEOUT)


def idle_and_freed(engine: AsyncEngineCore) -> bool:
    return engine.call(
        lambda e: not e.has_unfinished_requests() and e.kv_cache.stats().num_used_blocks == 0, timeout=TIMEOUT
    )


def steps_with(engine: AsyncEngineCore, request_id: str) -> int:
    return engine.call(lambda e: sum(request_id in r.request_ids for r in e.step_records), timeout=TIMEOUT)


def max_batch(engine: AsyncEngineCore) -> int:
    return engine.call(lambda e: max(len(r.request_ids) for r in e.step_records), timeout=TIMEOUT)


class Consumer(threading.Thread):
    """Reads a stream to its end on its own thread, recording outputs and the error raised."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.outputs: list = []
        self.error: BaseException | None = None
        self.started_streaming = threading.Event()

    def run(self) -> None:
        try:
            for output in self.stream:
                self.outputs.append(output)
                self.started_streaming.set()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def finish(self, timeout: float = TIMEOUT) -> Consumer:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return self


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def started_engines(tiny_model_dir):
    """Started engines on the tiny llama, stopped (bounded) after the test."""
    engines = []

    def make(**options) -> AsyncEngineCore:
        options.setdefault("force_model_takeover", True)  # tolerate an engine a failed test left
        engine = AsyncEngineCore(model=str(tiny_model_dir), **options)
        engines.append(engine)
        return bounded(engine.start)

    yield make
    for engine in engines:
        bounded(engine.stop)


@pytest.fixture(scope="module")
def solo(tiny_model_dir) -> dict:
    """The oracle: each prompt run alone, greedy, by a plain EngineCore on this thread."""
    engine = EngineCore(model=str(tiny_model_dir), force_model_takeover=True)
    try:
        result = {}
        for prompt in PROMPTS:
            engine.add_request(prompt, GREEDY)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        result[prompt] = (out.token_ids, out.text)
        return result
    finally:
        engine.shutdown()


# -- many callers ---------------------------------------------------------------------------


def test_blocking_iteration_from_threads_equals_solo_and_shares_steps(started_engines, solo):
    engine = started_engines()
    barrier = threading.Barrier(len(PROMPTS))
    results: dict = {}

    def consume(prompt):
        barrier.wait(TIMEOUT)
        results[prompt] = list(engine.add_request(prompt, GREEDY))

    threads = [threading.Thread(target=consume, args=(p,), daemon=True) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert sorted(results) == sorted(PROMPTS)
    for prompt, outs in results.items():
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert (final.token_ids, final.text) == solo[prompt]
        assert final.finish_reason == "length" and len(final.token_ids) == GREEDY.max_tokens
    assert len({outs[-1].request_id for outs in results.values()}) == len(PROMPTS)
    assert max_batch(engine) == len(PROMPTS)  # one forward pass served every thread


def test_async_with_and_concurrent_generate_consumers(tiny_model_dir, solo):
    async def main():
        async with AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True) as engine:
            assert engine.is_running

            async def consume(prompt):
                return [out async for out in engine.generate(prompt, GREEDY)]

            results = await asyncio.gather(*(consume(p) for p in PROMPTS))
            batch = await asyncio.to_thread(max_batch, engine)
        assert not engine.is_running  # __aexit__ stopped it
        return results, batch

    results, batch = bounded(lambda: asyncio.run(main()))
    for prompt, outs in zip(PROMPTS, results):
        assert outs[-1].finished and (outs[-1].token_ids, outs[-1].text) == solo[prompt]
    assert batch == len(PROMPTS)


def test_outputs_stream_and_deltas_add_up(started_engines, solo):
    engine = started_engines()
    outs = bounded(lambda: list(engine.add_request(PROMPTS[1], GREEDY)))
    assert len(outs) > 1
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert (outs[-1].token_ids, outs[-1].text) == solo[PROMPTS[1]]
    final = bounded(engine.add_request(PROMPTS[1], GREEDY).result)
    assert final.finished and final.token_ids == outs[-1].token_ids
    assert engine.get_stats()["kv_cache"] is not None


# -- aborts and early exits -------------------------------------------------------------------


def test_abort_from_another_thread_ends_the_stream_and_frees_blocks(started_engines):
    engine = started_engines()
    consumer = Consumer(engine.add_request(PROMPTS[1], LONG, request_id="victim"))
    consumer.start()
    assert consumer.started_streaming.wait(TIMEOUT)
    assert engine_used_blocks(engine) > 0
    aborter = threading.Thread(target=engine.abort, args=("victim",), daemon=True)
    aborter.start()
    aborter.join(TIMEOUT)
    consumer.finish()
    assert consumer.error is None
    final = consumer.outputs[-1]
    assert final.finished and final.finish_reason == "abort"
    assert 1 <= len(final.token_ids) < LONG.max_tokens
    assert engine_used_blocks(engine) == 0
    engine.abort("victim")  # finished and unknown ids: no-ops
    engine.abort("nope")
    assert engine.is_running and idle_and_freed(engine)


def test_cancelled_async_consumer_aborts_its_request(started_engines):
    engine = started_engines()

    async def main():
        seen = []
        two = asyncio.Event()

        async def consume():
            async for out in engine.generate(PROMPTS[1], LONG, request_id="cancelled"):
                seen.append(out)
                if len(seen) == 2:
                    two.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(two.wait(), TIMEOUT)
        assert await asyncio.to_thread(engine_used_blocks, engine) > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    seen = bounded(lambda: asyncio.run(main()))
    assert len(seen) >= 2 and not seen[-1].finished
    wait_until(lambda: idle_and_freed(engine), what="abort of the cancelled request")
    assert steps_with(engine, "cancelled") < LONG.max_tokens // 2  # stopped early, not run out


def test_blocking_consumer_that_breaks_aborts_its_request(started_engines):
    engine = started_engines()

    def consume():
        for i, _ in enumerate(engine.add_request(PROMPTS[1], LONG, request_id="broken")):
            if i == 1:
                break

    bounded(consume)
    wait_until(lambda: idle_and_freed(engine), what="abort after break")
    assert 2 <= steps_with(engine, "broken") < LONG.max_tokens // 2


def test_stream_dropped_unread_is_aborted(started_engines):
    engine = started_engines()
    stream = engine.add_request(PROMPTS[1], LONG, request_id="dropped")
    wait_until(lambda: steps_with(engine, "dropped") >= 3, what="the request running")
    del stream
    gc.collect()
    wait_until(lambda: idle_and_freed(engine), what="abort of the dropped stream")
    assert steps_with(engine, "dropped") < LONG.max_tokens // 2


def test_a_stream_whose_event_loop_closed_is_aborted(started_engines):
    engine = started_engines()
    loop = asyncio.new_event_loop()
    agen = engine.generate(PROMPTS[1], LONG, request_id="orphan")
    try:
        loop.run_until_complete(asyncio.wait_for(agen.__anext__(), TIMEOUT))
    finally:
        loop.close()  # the generator stays suspended (no shutdown_asyncgens): its stream lives on
    wait_until(lambda: idle_and_freed(engine), what="abort of the orphaned stream")
    assert engine.is_running  # outputs for a closed loop do not kill the engine
    assert steps_with(engine, "orphan") < LONG.max_tokens // 2
    asyncio.run(agen.aclose())


# -- bounded streams --------------------------------------------------------------------------

SAMPLED_N = SamplingParams(n=3, max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)


def completions(output) -> list[tuple]:
    return [(c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in output.outputs]


def test_an_unread_stream_holds_only_its_latest_output(started_engines):
    """A stream nobody reads while its request runs to the end keeps one snapshot, not one per
    step: read afterwards it gives the final output alone, equal (every choice, logprobs too) to
    the final output of a stream read step by step, its deltas joined over the skipped steps."""
    engine = started_engines()
    read_along = bounded(lambda: list(engine.add_request(PROMPTS[1], SAMPLED_N)))
    assert len(read_along) > 1
    stream = engine.add_request(PROMPTS[1], SAMPLED_N, request_id="unread")
    wait_until(lambda: idle_and_freed(engine), what="the unread request to finish")
    [final] = bounded(lambda: list(stream))
    assert final.finished and completions(final) == completions(read_along[-1])
    assert final.new_token_ids == final.token_ids and final.new_text == final.text


def test_an_async_consumer_that_lags_skips_to_the_latest_output(started_engines, solo):
    engine = started_engines()

    async def main():
        outputs = engine.generate(PROMPTS[1], GREEDY, request_id="lagging")
        first = await anext(outputs)
        await asyncio.to_thread(wait_until, lambda: idle_and_freed(engine), "the request to finish", TIMEOUT)
        return [first] + [out async for out in outputs]

    first, final = bounded(lambda: asyncio.run(main()))
    assert not first.finished and final.finished
    assert (final.token_ids, final.text) == solo[PROMPTS[1]]
    assert first.new_token_ids + final.new_token_ids == final.token_ids
    assert first.new_text + final.new_text == final.text


def test_an_unread_stream_keeps_its_final_abort_output(tiny_model_dir):
    """stop() with a stream unread: the stream holds one output, the final "abort" one."""
    engine = bounded(AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True).start)
    try:
        stream = engine.add_request(PROMPTS[1], LONG, request_id="unread-stopped")
        wait_until(lambda: steps_with(engine, "unread-stopped") >= 5, what="the request running")
    finally:
        bounded(engine.stop)
    [final] = bounded(lambda: list(stream))
    assert final.finish_reason == "abort" and len(final.new_token_ids) == len(final.token_ids) >= 5


# -- failures -------------------------------------------------------------------------------


def test_engine_failure_reaches_every_waiting_caller(started_engines):
    engine = started_engines()
    model_key = str(bounded(lambda: engine.engine.model_path))
    consumers = [Consumer(engine.add_request(p, LONG)) for p in PROMPTS[:3]]
    for c in consumers:
        c.start()
    for c in consumers:
        assert c.started_streaming.wait(TIMEOUT)
    engine.call(lambda e: setattr(e.runner, "attention", None), timeout=TIMEOUT)  # the next step raises
    causes = set()  # each stream raises the engine's exception, or EngineDeadError chained to it
    for c in consumers:
        c.finish()
        cause = c.error.__cause__ if isinstance(c.error, EngineDeadError) else c.error
        assert cause is not None and not isinstance(cause, EngineDeadError), c.error
        causes.add(id(cause))
        assert not c.outputs[-1].finished
    assert len(causes) == 1  # the one exception of the engine thread, delivered to all
    assert not engine.is_running
    with pytest.raises(EngineDeadError) as dead:
        engine.add_request(PROMPTS[0], GREEDY)
    assert dead.value.__cause__ is not None
    with pytest.raises(EngineDeadError):
        engine.call(lambda e: None)
    t0 = time.monotonic()
    bounded(engine.stop, timeout=5)
    assert time.monotonic() - t0 < 2
    assert get_registry().owner(model_key) is None  # the failed engine released its model


def test_a_bad_request_fails_alone(started_engines):
    engine = started_engines()
    good = Consumer(engine.add_request(PROMPTS[0], GREEDY.clone(max_tokens=100), request_id="good"))
    good.start()
    bad = engine.add_request([0, 10**9], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        bounded(bad.result)
    duplicate = engine.add_request(PROMPTS[1], GREEDY, request_id="good")
    with pytest.raises(ValueError, match="already in use"):
        bounded(duplicate.result)
    good.finish()
    assert good.error is None
    assert good.outputs[-1].finish_reason == "length" and len(good.outputs[-1].token_ids) == 100
    assert engine.is_running and idle_and_freed(engine)


# -- lifecycle ------------------------------------------------------------------------------


def test_idle_engine_does_not_busy_wait(started_engines):
    engine = started_engines()
    bounded(lambda: list(engine.add_request(PROMPTS[0], GREEDY)))  # warm, then idle
    engine.call(lambda e: None, timeout=TIMEOUT)
    time.sleep(0.1)
    t0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - t0 < 0.2  # CPU of the whole process (the engine thread included)


def test_start_reraises_a_load_error_and_leaves_no_thread(tmp_path):
    engine = AsyncEngineCore(model=str(tmp_path / "no-such-model"))
    before = set(threading.enumerate())
    with pytest.raises(ModelSourceError):
        bounded(engine.start)
    assert [t for t in threading.enumerate() if t not in before and t.name == "vllm-mlx-engine"] == []
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        engine.add_request(PROMPTS[0])
    bounded(engine.stop, timeout=5)  # a no-op


def test_stop_with_requests_in_flight_ends_streams_with_abort_and_releases_the_model(tiny_model_dir):
    """stop(): in-flight streams end with a final "abort" output (no exception); later calls
    raise EngineDeadError; the thread joins and the model can be loaded again without force."""
    engine = bounded(AsyncEngineCore(model=str(tiny_model_dir), force_model_takeover=True).start)
    try:
        consumers = [Consumer(engine.add_request(p, LONG)) for p in PROMPTS[:3]]
        for c in consumers:
            c.start()
        for c in consumers:
            assert c.started_streaming.wait(TIMEOUT)
        t0 = time.monotonic()
        bounded(engine.stop, timeout=10)
        assert time.monotonic() - t0 < 5
        assert not engine._thread.is_alive()
        for c in consumers:
            c.finish(timeout=5)
            assert c.error is None
            assert c.outputs[-1].finished and c.outputs[-1].finish_reason == "abort"
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            engine.add_request(PROMPTS[0])
    finally:
        bounded(engine.stop)

    def start_again_without_force():
        with AsyncEngineCore(model=str(tiny_model_dir)) as again:
            return again.is_running

    assert bounded(start_again_without_force)


def test_a_script_using_the_engine_exits_cleanly(tiny_model_dir):
    # MLX aborts a process whose engine thread left streams behind (ml-explore/mlx#3126).
    script = (
        "import sys\n"
        "from vllm_mlx import AsyncEngineCore, SamplingParams\n"
        "with AsyncEngineCore(model=sys.argv[1], num_kv_blocks=64) as engine:\n"
        "    out = engine.add_request('Hi', SamplingParams(max_tokens=3, ignore_eos=True)).result()\n"
        "print(len(out.token_ids))\n"
    )
    for _ in range(3):  # the abort was intermittent
        done = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-500:]
        assert done.stdout.strip() == "3"


def test_engine_core_refuses_work_after_shutdown(tiny_model_dir):
    from vllm_mlx.platform.errors import VllmMlxError

    core = EngineCore(model=str(tiny_model_dir), num_kv_blocks=64, force_model_takeover=True)
    core.shutdown()
    with pytest.raises(VllmMlxError, match="shut down"):
        core.add_request("Hi")

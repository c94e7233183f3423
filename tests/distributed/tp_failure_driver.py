"""Rank failures in a tensor-parallel server: what each rank of ``mlx.launch -n 2`` runs.

``python tests/distributed/tp_failure_driver.py MODEL_DIR OUT_PREFIX MODE`` with MODE:

- ``die``: rank 1 kills itself (SIGKILL) in the middle of a batch of streaming requests;
- ``hang``: rank 1 stops itself (SIGSTOP) there instead: alive, silent;
- ``idle-hang``: rank 1 stops itself on rank 0's first idle heartbeat, with no request running;
- ``startup-hang``: rank 1 never finishes loading the model (``hang_at_startup``).

Rank 0 serves the OpenAI API on 127.0.0.1 (the real app over ``AsyncEngineCore(tensor_parallel
=True)``), streams requests with the ``openai`` client, and writes ``OUT_PREFIX.rank0.json``:
what each client saw, when, and what ``/health`` said. It then stops the app and the engine and
exits normally (a stopped rank 1 is killed by rank 0, from the pid file it left), so the test
also checks that nothing is left hanging.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 8.0
"""The floor of the watchdog's deadline once warm; the driver raises it to 3x the slowest warm-up
batch (``measured_timeout``) so that a healthy step on a busy machine is never taken for a hang."""
WARM_UP_TIMEOUT_S = 120.0  # while the first steps compile CPU kernels
REQUESTS = 3
WARM_UP_REQUESTS = REQUESTS * (REQUESTS + 1) // 2  # batches of 1, 2, ... REQUESTS
FAIL_AT = 4  # rank 1 fails at its 4th step once every request has arrived


def sabotage_worker(mode: str, pid_file: Path) -> None:
    """Make rank 1 die or stop where ``mode`` says (it writes its pid first)."""
    from vllm_mlx.distributed.worker import Worker

    action = signal.SIGKILL if mode == "die" else signal.SIGSTOP
    stock_step = Worker._step
    seen: set[str] = set()
    full_steps = 0

    def fail() -> None:
        pid_file.write_text(str(os.getpid()))
        os.kill(os.getpid(), action)

    def step(self, message):
        nonlocal full_steps
        seen.update(new.request_id for new in message.new_requests)
        full_steps += len(seen) == WARM_UP_REQUESTS + REQUESTS
        if full_steps == FAIL_AT:
            fail()
        return stock_step(self, message)

    Worker._step = step
    if mode == "idle-hang":
        from vllm_mlx.distributed import worker as worker_module  # Worker.run's receive_message

        stock_receive = worker_module.receive_message

        def receive(group):
            message = stock_receive(group)
            if message.kind == "ping":
                fail()
            return message

        worker_module.receive_message = receive


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return {"status": response.status, "body": response.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}


def stream_one(client, index: int, seen: dict) -> None:
    """One streaming completion; records the tokens' arrival times and how it ended."""
    record = seen[index] = {"chunks": 0, "last_chunk_at": None, "error": None, "ended_at": None}
    try:
        stream = client.completions.create(
            model="m", prompt=f"Request number {index} asks for a long answer", max_tokens=2000,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            record["chunks"] += 1
            record["last_chunk_at"] = time.monotonic()
    except Exception as exc:  # what the client sees is the point of the test
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["ended_at"] = time.monotonic()


def serve_and_watch(model_dir: str, mode: str) -> dict:
    import openai
    from live_server import LiveServer

    from vllm_mlx.engine.async_engine import AsyncEngineCore
    from vllm_mlx.entrypoints.openai.server import build_app

    warm_up = mode != "idle-hang"  # idle-hang: rank 1 stops at the first idle heartbeat, no request ever runs
    engine = AsyncEngineCore(
        model=model_dir, tensor_parallel=True, distributed_timeout_s=WARM_UP_TIMEOUT_S if warm_up else TIMEOUT_S,
        force_model_takeover=True, block_size=4, seed=0,
    ).start()  # fmt: skip
    server = LiveServer(build_app(engine, served_model_name="m"))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    slowest = 0.0
    for batch in range(1, REQUESTS + 1 if warm_up else 1):  # warm up: compile each batch size's kernels
        threads = [threading.Thread(target=client.completions.create, kwargs={
            "model": "m", "prompt": "warm up", "max_tokens": 3}) for _ in range(batch)]  # fmt: skip
        batch_started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        slowest = max(slowest, time.monotonic() - batch_started)
    timeout = measured_timeout(slowest)
    engine.engine.watchdog.timeout_s = timeout  # read at each watch(): the next step on
    result = {"health_before": health(server.url), "timeout_s": timeout}
    seen: dict[int, dict] = {}
    started = time.monotonic()
    if mode != "idle-hang":
        threads = [threading.Thread(target=stream_one, args=(client, i, seen)) for i in range(REQUESTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    else:
        deadline = time.monotonic() + 30
        while health(server.url)["status"] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
    result.update(requests=seen, health_after=health(server.url), noticed_after_s=time.monotonic() - started)
    after = {"error": None}
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=10)
        client.completions.create(model="m", prompt="after", max_tokens=2)
    except Exception as exc:
        after["error"] = f"{type(exc).__name__}: {exc}"
    result["request_after"] = after
    stop_started = time.monotonic()
    server.stop()
    engine.stop()
    result["stop_s"] = time.monotonic() - stop_started
    return result


def measured_timeout(slowest_batch_s: float) -> float:
    """The watchdog's deadline once warm: a whole warm-up batch (prefill and three decode steps,
    kernels compiled by the batch before) three times over, at least ``TIMEOUT_S``."""
    return max(TIMEOUT_S, 3 * slowest_batch_s)


STARTUP_TIMEOUT_S = 6.0  # the start-up deadline of the startup-hang mode (rank 0 loads in ~2 s)


def hang_at_startup(group, model_dir: str, out_prefix: str) -> None:
    """Every rank writes its pid, then rank 0 builds an engine and rank 1 a worker, both with a
    start-up deadline of ``STARTUP_TIMEOUT_S``; rank 1's model load never returns. Neither call
    can return: each rank's deadline ends its process (exit status 1)."""
    from vllm_mlx import models
    from vllm_mlx.engine.core import EngineCore
    from vllm_mlx.engine.rank_worker import worker_loop

    Path(f"{out_prefix}.rank{group.rank()}.pid").write_text(str(os.getpid()))
    if group.rank() == 0:
        EngineCore(model=model_dir, tensor_parallel=True, force_model_takeover=True,
                   distributed_startup_timeout_s=STARTUP_TIMEOUT_S)  # fmt: skip
    else:
        models.load_model = lambda *args, **kwargs: threading.Event().wait()
        worker_loop(model_dir, group=group, startup_timeout_s=STARTUP_TIMEOUT_S)
    Path(f"{out_prefix}.rank{group.rank()}.returned").write_text("the start-up deadline did not fire")


def main(model_dir: str, out_prefix: str, mode: str) -> None:
    from vllm_mlx.distributed.group import init_group
    from vllm_mlx.engine.rank_worker import worker_loop

    pid_file = Path(f"{out_prefix}.rank1.pid")
    group = init_group()
    if mode == "startup-hang":
        hang_at_startup(group, model_dir, out_prefix)
        return
    if group.rank() == 0:
        # mlx.launch ends the other ranks when one exits non-zero; rank 0 must outlive rank 1's
        # death long enough to record what its clients saw.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        result = serve_and_watch(model_dir, mode)
        if pid_file.exists():  # a stopped rank 1 would keep mlx.launch waiting
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        Path(f"{out_prefix}.rank0.json").write_text(json.dumps(result))
    else:
        sabotage_worker(mode, pid_file)
        worker_loop(model_dir, group=group)


if __name__ == "__main__":
    main(*sys.argv[1:4])

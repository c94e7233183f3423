"""A tensor-parallel rank that dies or hangs (vllm_mlx/distributed/watchdog.py, distributed.py): rank 0's
server answers the waiting requests with a clear error within the timeout, ``/health`` says
why, new requests are refused, and every process ends (two real ranks on 127.0.0.1); a rank
that hangs at start-up ends every rank at the start-up deadline."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from vllm_mlx.distributed.watchdog import CollectiveWatchdog, RankLostError

TESTS = Path(__file__).parent


def test_watchdog_fires_once_for_a_block_that_outlives_its_deadline():
    fired: list[RankLostError] = []
    watchdog = CollectiveWatchdog(0.2, fired.append, world_size=2)
    with watchdog.watch("step 1"):
        time.sleep(0.05)  # in time: nothing fires
    time.sleep(0.3)  # disarmed: idle time never counts
    assert not fired and watchdog.fired is None
    with watchdog.watch("step 2"):
        time.sleep(0.6)
    time.sleep(0.1)
    assert len(fired) == 1 and watchdog.fired is fired[0]
    assert "step 2 did not finish within 0.2 s on 2 ranks" in str(fired[0])
    watchdog.close()


def test_watchdog_thread_ends_on_close():
    watchdog = CollectiveWatchdog(5.0, lambda error: None, world_size=2)
    watchdog.close()
    watchdog._thread.join(2)
    assert not watchdog._thread.is_alive()


def test_distributed_timeout_is_checked():
    from vllm_mlx.engine.core import EngineConfig

    for name in ("distributed_timeout_s", "distributed_startup_timeout_s"):
        for bad in (0, -1.0, "30", True):
            with pytest.raises(ValueError, match=name):
                EngineConfig(**{name: bad}).normalize()


def _launch_driver(model_dir: Path, tmp_path: Path, mode: str):
    """``tp_failure_driver.py`` on two ranks, writing under ``tmp_path / "tp"``."""
    from tp_driver import launch_two_ranks

    return launch_two_ranks(model_dir, tmp_path / "tp", mode, driver=TESTS / "tp_failure_driver.py")


def _launch(model_dir: Path, tmp_path: Path, mode: str) -> dict:
    done = _launch_driver(model_dir, tmp_path, mode)
    out = tmp_path / "tp.rank0.json"
    assert out.exists(), done.output[-4000:]
    result = json.loads(out.read_text())
    pid = int((tmp_path / "tp.rank1.pid").read_text())
    assert not _alive(pid), "rank 1 outlived the launch"
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _check_failed_server(result: dict, reason: str) -> None:
    """Every client got the reason, /health is a 503 that says it, new requests are refused,
    and the server stopped promptly although its engine thread is stuck."""
    assert result["health_before"]["status"] == 200
    for seen in result["requests"].values():
        assert seen["chunks"] > 0  # it was streaming when the rank failed
        assert seen["error"] is not None and reason in seen["error"], seen
    assert result["health_after"]["status"] == 503 and reason in result["health_after"]["body"]
    assert "503" in result["request_after"]["error"] and reason in result["request_after"]["error"]
    assert result["stop_s"] < 10


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_rank_lost_mid_generation_fails_the_waiting_requests(tiny_model_dir, tmp_path, mode):
    from tp_failure_driver import REQUESTS, TIMEOUT_S

    result = _launch(tiny_model_dir, tmp_path, mode)
    assert len(result["requests"]) == REQUESTS
    reason = "rank is gone" if mode == "die" else "stopped answering"
    _check_failed_server(result, reason)
    # Noticed within the timeout: the errors came at most the watchdog's deadline (measured by the
    # driver from its warm-up; + slack for 2 busy cores) after the last token any client received.
    last_token = max(seen["last_chunk_at"] for seen in result["requests"].values())
    for seen in result["requests"].values():
        assert seen["ended_at"] - last_token < result["timeout_s"] + 3
        if mode == "die":  # a dead peer is noticed at once (its liveness link closed), not at a deadline
            assert seen["ended_at"] - last_token < TIMEOUT_S


def test_a_rank_that_hangs_while_idle_is_found_by_the_heartbeat(tiny_model_dir, tmp_path):

    from vllm_mlx.engine.async_engine import HEARTBEAT_PERIOD_S

    result = _launch(tiny_model_dir, tmp_path, "idle-hang")
    assert result["health_after"]["status"] == 503 and "the idle heartbeat did not finish" in result["health_after"]["body"]
    assert result["noticed_after_s"] < 2 * HEARTBEAT_PERIOD_S + result["timeout_s"] + 5
    assert "503" in result["request_after"]["error"]


def test_a_rank_that_hangs_at_start_up_ends_every_rank_at_the_deadline(tiny_model_dir, tmp_path):
    """Rank 1 never finishes loading: rank 0, waiting in the start-up collectives, and rank 1
    itself exit at the start-up deadline, saying why; no call returns, no process is left."""
    from tp_failure_driver import STARTUP_TIMEOUT_S

    started = time.monotonic()
    done = _launch_driver(tiny_model_dir, tmp_path, "startup-hang")
    assert time.monotonic() - started < STARTUP_TIMEOUT_S + 30  # two interpreters' start, then the deadline
    assert f"start-up (every rank loading and checking the model) did not finish within {STARTUP_TIMEOUT_S:g} s" in (
        done.output
    ), done.output[-3000:]
    assert "exiting: the thread waiting on the other ranks can never return" in done.output
    assert not list(tmp_path.glob("tp.rank*.returned"))
    for rank in (0, 1):
        assert not _alive(int((tmp_path / f"tp.rank{rank}.pid").read_text())), f"rank {rank} outlived the launch"


def test_a_sync_engine_without_a_handler_is_never_left_blocked():
    """Without ``on_rank_lost`` the watchdog ends the process (the blocked caller cannot return):
    checked in a child process whose 'collective' never finishes."""
    import subprocess
    import sys

    script = (
        "import threading, time\n"
        "from vllm_mlx.engine.core import EngineCore\n"
        "from vllm_mlx.distributed.watchdog import CollectiveWatchdog\n"
        "engine = EngineCore.__new__(EngineCore)\n"
        "engine.on_rank_lost, engine.rank_failure, engine._rank_failure_lock = None, None, threading.Lock()\n"
        "engine.watchdog = CollectiveWatchdog(0.3, engine._rank_hung, 2)\n"
        "with engine._waiting_on_ranks('step 9'):\n"
        "    threading.Event().wait()  # a collective that never returns\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and time.monotonic() - started < 20
    assert "step 9 did not finish within 0.3 s" in done.stderr

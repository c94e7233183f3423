"""Rank 0's liveness monitor (vllm_mlx/distributed/liveness.py): a worker process that ends is reported
at once, by rank; strays and wrong tokens are ignored; nothing is reported after ``close``.
Real sockets on 127.0.0.1 and a real child process killed with SIGKILL."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

from vllm_mlx.distributed.liveness import LivenessMonitor, connect_to_rank_zero, parse_hello, rank_zero_host


class Reports:
    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.seen = threading.Event()

    def __call__(self, error: Exception) -> None:
        self.errors.append(error)
        self.seen.set()


def _worker_process(monitor: LivenessMonitor, rank: int) -> subprocess.Popen:
    """A child that connects as ``rank`` the way ``worker_loop`` does, then waits to be killed."""
    address = json.dumps(monitor.address.to_dict())
    code = (
        "import json, sys, time\n"
        "from vllm_mlx.distributed.liveness import LivenessAddress, connect_to_rank_zero\n"
        f"link = connect_to_rank_zero(LivenessAddress.from_dict(json.loads({address!r})), {rank})\n"
        "print('connected' if link else 'failed', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "connected"
    return child


def _wait_for_ranks(monitor: LivenessMonitor, ranks: set[int]) -> None:
    deadline = time.monotonic() + 10
    while monitor.connected_ranks != ranks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert monitor.connected_ranks == ranks


def test_a_killed_worker_is_reported_at_once_by_rank():
    reports = Reports()
    monitor = LivenessMonitor(3, reports, "127.0.0.1")
    children = [_worker_process(monitor, rank) for rank in (1, 2)]
    try:
        _wait_for_ranks(monitor, {1, 2})
        assert not reports.seen.wait(0.2)  # alive workers: nothing
        killed_at = time.monotonic()
        children[1].send_signal(signal.SIGKILL)
        assert reports.seen.wait(5)
        assert time.monotonic() - killed_at < 2
        assert len(reports.errors) == 1
        assert "a tensor-parallel rank is gone: rank 2's process ended" in str(reports.errors[0])
    finally:
        for child in children:
            child.kill()
            child.wait()
        monitor.close()


def test_strays_and_wrong_tokens_are_dropped_and_close_silences_the_monitor():
    reports = Reports()
    monitor = LivenessMonitor(2, reports, "127.0.0.1")
    stray = socket.create_connection(("127.0.0.1", monitor.address.port))
    stray.sendall(b"GET / HTTP/1.1\r\n\r\n")
    stray.close()
    impostor = socket.create_connection(("127.0.0.1", monitor.address.port))
    impostor.sendall(b"1 " + b"0" * 32 + b"\n")
    impostor.close()
    link = connect_to_rank_zero(monitor.address, 1)  # the real rank 1
    _wait_for_ranks(monitor, {1})
    assert not reports.seen.wait(0.3)  # neither the stray nor the impostor counted
    monitor.close()
    link.close()  # a worker that exits after "stop": expected
    assert not reports.seen.wait(0.3)
    assert not reports.errors


def test_hellos_name_a_rank_above_zero_with_the_token():
    assert parse_hello(b"2 abc\n", "abc", 4) == 2
    assert parse_hello(b"0 abc\n", "abc", 4) is None
    assert parse_hello(b"4 abc\n", "abc", 4) is None
    assert parse_hello(b"1 abd\n", "abc", 4) is None
    assert parse_hello(b"\xff\xfe", "abc", 4) is None
    assert parse_hello(b"", "abc", 4) is None


def test_rank_zero_host_comes_from_the_ring_hostfile(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.5:5000"], ["10.0.0.6:5000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert rank_zero_host() == "10.0.0.5"
    monkeypatch.delenv("MLX_HOSTFILE")
    assert rank_zero_host() is None
    assert LivenessMonitor.start(2, lambda error: None) is None

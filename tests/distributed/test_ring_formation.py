"""Forming the ranks' group (vllm_mlx/distributed/ring_formation.py), with real ranks on 127.0.0.1: a local
process that connects to a rank's port before its real neighbour does no longer ends the launch
(the ring is formed again), and a process of another launch that joins the ring is refused by
every rank, named as what it is."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from vllm_mlx.distributed.ring_formation import LAUNCH_NONCE_ENV, foreign_message, nonce_hash
from vllm_mlx.distributed.supervisor import ring_hostfile

TESTS = Path(__file__).parent
DRIVER = TESTS / "ring_formation_driver.py"
RANK_TIMEOUT = 120  # a failed formation costs MLX's connect back-off (~15 s) per attempt

pytestmark = pytest.mark.skipif(not mx.distributed.is_available(), reason="mlx has no distributed backend")


def _rank(rank: int, hostfile: str, nonce: str) -> subprocess.Popen:
    env = {**os.environ, "MLX_HOSTFILE": hostfile, "MLX_RANK": str(rank), LAUNCH_NONCE_ENV: nonce,
           "PYTHONPATH": os.pathsep.join([str(TESTS.parents[1]), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return subprocess.Popen([sys.executable, str(DRIVER)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _finish(ranks: list[subprocess.Popen]) -> list[tuple[dict, str]]:
    """Each rank's JSON line and its stderr; kills every rank left on a timeout."""
    results = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=RANK_TIMEOUT)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"rank wrote nothing:\n{err[-2000:]}"
            results.append((json.loads(lines[-1]), err))
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    return results


def _stray_connection(port: int, deadline_s: float = 60.0) -> socket.socket:
    """Connect to ``port`` as soon as something listens there (as a port scanner or a health
    probe would): the first connection a ring rank accepts."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def test_a_stray_connection_to_rank_0s_port_is_survived(tmp_path):
    hostfile = ring_hostfile(2)
    first_port = int(json.loads(Path(hostfile).read_text())[0][0].rsplit(":", 1)[1])
    rank0 = _rank(0, hostfile, "launch-a")
    stray = _stray_connection(first_port)  # accepted by rank 0 as if it were rank 1
    try:
        rank1 = _rank(1, hostfile, "launch-a")
        results = _finish([rank0, rank1])
    finally:
        stray.close()
        os.unlink(hostfile)
    assert [r for r, _ in results] == [{"rank": 0, "size": 2, "sum": 3}, {"rank": 1, "size": 2, "sum": 3}]
    assert any("the ring did not form" in err and "trying again" in err for _, err in results)


def test_a_rank_of_another_launch_is_refused_by_every_rank(tmp_path):
    hostfile = ring_hostfile(2)
    addresses = [a[0] for a in json.loads(Path(hostfile).read_text())]
    try:
        results = _finish([_rank(0, hostfile, "launch-a"), _rank(1, hostfile, "launch-b")])
    finally:
        os.unlink(hostfile)
    (rank0, _), (rank1, _) = results
    assert rank0["error"] == rank1["error"] == "ForeignRankError"
    assert (f"a process that is not part of this launch connected to rank 0's port ({addresses[0]}) "
            "and holds rank 1's place in the ring") in rank0["message"]  # fmt: skip
    assert "rank 1's port" in rank1["message"] and "holds rank 0's place" in rank1["message"]


def test_ranks_without_a_nonce_agree_and_the_message_names_each_foreign_place(monkeypatch):
    assert not nonce_hash(None).any() and not nonce_hash("").any()
    assert (nonce_hash("a") != nonce_hash("b")).any()
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    message = foreign_message(0, 3, [1, 2])
    assert "connected to rank 2's port and holds rank 1's place" in message
    assert "connected to rank 0's port and holds rank 2's place" in message

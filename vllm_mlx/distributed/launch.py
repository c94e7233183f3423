"""Launching ranks on this machine with ``mlx.launch --backend ring`` (loopback), bounded in time.

The tensor-parallel tests and ``bench/distributed.py`` start ranks this way. ``mlx.launch`` runs
in its own session so that, on timeout or after it returns, the whole process group (launcher,
shells, ranks) is killed: no rank outlives its caller. ``mlx.launch`` exits 0 whatever its ranks
do, so callers judge the ranks by what they wrote, not by the return code.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from vllm_mlx.distributed.ring_formation import LAUNCH_NONCE_ENV, new_launch_nonce


class LaunchError(RuntimeError):
    """``mlx.launch`` is missing, or no free ports were found."""


@dataclass
class LaunchResult:
    output: str  # stdout and stderr of the launcher and every rank, interleaved
    timed_out: bool


def free_port_run(count: int = 2, host: str = "127.0.0.1") -> int:
    """A port p with p, p + 1, ..., p + count - 1 all free on ``host`` (the ring backend listens
    on one port per rank, from ``--starting-port`` up). Free when checked: another program may
    still take one before the ranks bind, which then fail to connect, loudly."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + count - 1 <= 65535 and all(_is_free(host, port + i) for i in range(1, count)):
            return port
    raise LaunchError(f"no {count} free consecutive ports on {host}")


def _is_free(host: str, port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, port))
        return True
    except OSError:
        return False


def launch_ring(script: str, args: list[str], *, ranks: int = 2, timeout: float, pythonpath: list[str] = ()) -> LaunchResult:
    """Run ``python script *args`` as ``ranks`` ranks of a ring on loopback, at most ``timeout``
    seconds; ``pythonpath`` goes in front of the caller's ``PYTHONPATH`` on every rank."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise LaunchError("mlx.launch is not installed (it comes with mlx)")
    path = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])
    command = [
        launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port_run(ranks)),
        "--env", f"PYTHONPATH={path}", "--env", f"{LAUNCH_NONCE_ENV}={new_launch_nonce()}",
        "--python", sys.executable, script, *args,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass
    return LaunchResult(output, timed_out)

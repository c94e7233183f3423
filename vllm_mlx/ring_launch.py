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


class LaunchError(RuntimeError):
    """``mlx.launch`` is missing, or no free ports were found."""


@dataclass
class LaunchResult:
    output: str  # stdout and stderr of the launcher and every rank, interleaved
    timed_out: bool


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (the ring backend listens on one port per
    rank, from ``--starting-port`` up)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise LaunchError("no two free consecutive ports on 127.0.0.1")


def launch_ring(script: str, args: list[str], *, ranks: int = 2, timeout: float, pythonpath: list[str] = ()) -> LaunchResult:
    """Run ``python script *args`` as ``ranks`` ranks of a ring on loopback, at most ``timeout``
    seconds; ``pythonpath`` goes in front of the caller's ``PYTHONPATH`` on every rank."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise LaunchError("mlx.launch is not installed (it comes with mlx)")
    path = os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")])
    command = [
        launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port_pair()),
        "--env", f"PYTHONPATH={path}", "--python", sys.executable, script, *args,
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

"""Running N ranks of one command on this machine (a loopback ring) and supervising them.

``vllm-mlx serve MODEL --tensor-parallel-size N`` uses it: the CLI re-executes itself with
``--distributed`` as N ranks and stays in the foreground. The ranks are started here, not through
``mlx.launch``, with the environment MLX documents for the ring backend (``MLX_RANK``, and
``MLX_HOSTFILE``: a JSON list with each rank's ``host:port``). ``mlx.launch`` exits 0 whatever
its ranks do and relays their output through pipes, hiding their pids; started directly, each
rank is a child of the supervisor, so its exit status and pid are known and signals go where
they should.

Invariants:
- The ranks share one process group of their own (rank 0 leads it; same session), apart from the supervisor's:
  a terminal's Ctrl-C reaches only the supervisor, which forwards it to rank 0 alone (rank 0 shuts
  its engine down, which sends the other ranks "stop").
- When ``supervise`` returns, no rank is alive: the group is killed with SIGKILL on the way out,
  whatever happened (a bounded grace period first, none when rank 0 failed).
- Every rank of one start gets the same random nonce (``ring_formation.LAUNCH_NONCE_ENV``), which
  the ranks compare right after their group forms: a process of another launch is refused.
- Each rank knows the supervisor's pid (``SUPERVISOR_ENV``) and ends itself if the supervisor
  disappears (``watch_supervisor``), the one case the group kill above cannot cover (SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from vllm_mlx.distributed.launch import free_port_run
from vllm_mlx.distributed.ring_formation import LAUNCH_NONCE_ENV, new_launch_nonce

SUPERVISOR_ENV = "VLLM_MLX_SUPERVISOR_PID"
GRACE_S = 15.0  # after a stop request or a rank's exit, how long the others get to end on their own
POLL_S = 0.1
REPEAT_S = 1.0  # a second SIGINT/SIGTERM later than this after the first kills the ranks at once


@dataclass
class RankGroup:
    """The running ranks (``processes[r]`` is rank r) and the process group they share."""

    processes: list[subprocess.Popen]
    hostfile: str

    @property
    def pgid(self) -> int:
        return self.processes[0].pid

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.processes]

    def kill(self) -> None:
        """SIGKILL the whole group, reap every rank, remove the hostfile."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for process in self.processes:
            process.wait()
        try:
            os.unlink(self.hostfile)
        except FileNotFoundError:
            pass


def ring_hostfile(count: int, host: str = "127.0.0.1") -> str:
    """A ring hostfile (MLX's format) for ``count`` ranks on consecutive free ports of ``host``;
    returns its path."""
    first = free_port_run(count, host)
    fd, path = tempfile.mkstemp(prefix="vllm-mlx-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"{host}:{first + r}"] for r in range(count)], f)
    return path


def start_ranks(command: list[str], count: int) -> RankGroup:
    """Start ``command`` ``count`` times as the ranks of a loopback ring, in a new process group."""
    hostfile = ring_hostfile(count)
    processes: list[subprocess.Popen] = []
    base = {**os.environ, "MLX_HOSTFILE": hostfile, SUPERVISOR_ENV: str(os.getpid()),
            LAUNCH_NONCE_ENV: new_launch_nonce()}  # fmt: skip
    try:
        for rank in range(count):
            group = processes[0].pid if processes else 0  # rank 0 leads a new group (same session)
            processes.append(subprocess.Popen(command, env={**base, "MLX_RANK": str(rank)}, stdin=subprocess.DEVNULL,
                                              process_group=group))  # fmt: skip
    except BaseException:
        if processes:
            RankGroup(processes, hostfile).kill()
        raise
    return RankGroup(processes, hostfile)


@dataclass
class Supervision:
    """What ``supervise`` saw: each rank's exit status (negative: killed by that signal), the
    signal forwarded to rank 0 (a stop request) if any, and whether the grace period ran out."""

    exit_codes: list[int] = field(default_factory=list)
    stopped_by: int | None = None
    forced: bool = False

    @property
    def stop_requested(self) -> bool:
        return self.stopped_by is not None

    @property
    def ok(self) -> bool:
        """Every rank ended cleanly: status 0, or, after a forwarded stop, ended by that signal
        (uvicorn re-raises it once it has shut down) or with the shell's 128 + signal."""
        clean = {0}
        if self.stopped_by is not None:
            clean |= {-self.stopped_by, 128 + self.stopped_by}
        return not self.forced and all(code in clean for code in self.exit_codes)


def supervise(command: list[str], count: int, *, grace_s: float = GRACE_S, on_start=None) -> Supervision:
    """Run ``command`` as ``count`` loopback ranks until they end; SIGINT/SIGTERM to this process
    are forwarded to rank 0 (a second one, ``REPEAT_S`` later, kills the group). When one rank
    ends (rank 0's clean stop, or a worker's failure), the others get ``grace_s`` seconds, then
    SIGTERM, then SIGKILL; when rank 0 fails, the others are killed at once.
    ``on_start(group)`` is called once the ranks run (the CLI prints their pids)."""
    result = Supervision()
    signals = {signal.SIGINT: None, signal.SIGTERM: None}
    ranks = start_ranks(command, count)

    asked = []  # when each stop request came

    def forward(signum, _frame) -> None:
        now = time.monotonic()
        if asked and now - asked[0] > REPEAT_S:  # asked again (a second Ctrl-C): stop waiting
            os.killpg(ranks.pgid, signal.SIGKILL)
        elif not asked:  # (one event often arrives twice: e.g. timeout(1) and a shell both send it)
            _signal(ranks.processes[0], signum)
        asked.append(now)
        result.stopped_by = result.stopped_by or signum

    try:
        for signum in signals:
            signals[signum] = signal.signal(signum, forward)
        if on_start is not None:
            on_start(ranks)
        _wait(ranks, result, grace_s)
    finally:
        for signum, previous in signals.items():
            if previous is not None:
                signal.signal(signum, previous)
        ranks.kill()
        result.exit_codes = [p.returncode for p in ranks.processes]
    return result


def _wait(ranks: RankGroup, result: Supervision, grace_s: float) -> None:
    """Until every rank has ended: once the first one ends (or a stop is asked for), the rest get
    ``grace_s`` seconds, then SIGTERM and half as long again; the caller's group kill does the
    rest. Rank 0 failing unasked ends the wait at once: the other ranks have no engine left to
    serve, and one may be hung (a stopped process ignores SIGTERM)."""
    deadline = None
    terminated = False
    while None in ranks.exit_codes():
        if ranks.processes[0].poll() not in (None, 0) and not result.stop_requested:
            return
        now = time.monotonic()
        if deadline is None and (result.stop_requested or any(c is not None for c in ranks.exit_codes())):
            deadline = now + grace_s
        if deadline is not None and now > deadline:
            if terminated:
                result.forced = True
                return
            for process in ranks.processes:
                _signal(process, signal.SIGTERM)
            terminated, deadline = True, now + grace_s / 2
        time.sleep(POLL_S)


def _signal(process: subprocess.Popen, signum: int) -> None:
    if process.poll() is None:
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass


def watch_supervisor() -> None:
    """In a rank started by ``start_ranks``: end this process (SIGKILL) as soon as the
    supervisor is gone (this process was re-parented), so no rank outlives a killed supervisor.
    A daemon thread polls ``os.getppid()`` every second; nothing happens outside a supervision."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor is None or os.getppid() != int(supervisor):
        return

    def watch() -> None:
        while os.getppid() == int(supervisor):
            time.sleep(1.0)
        print(f"vllm-mlx: rank {os.environ.get('MLX_RANK', '?')}: the supervisor is gone; exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="vllm-mlx-supervisor-watch", daemon=True).start()

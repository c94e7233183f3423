"""Noticing a tensor-parallel rank that died or stopped answering (``distributed/protocol.py``).

A collective blocks inside MLX's C++ until every rank has taken part. When a peer process dies,
the ring backend notices the closed socket and the collective raises (``RuntimeError``), which
``distributed/protocol.py`` turns into ``RankLostError``. A rank that hangs (stopped, deadlocked,
swapping, or behind a link that drops packets without closing) gives no such signal: the
collective waits forever, and the thread that called it cannot be interrupted (MLX releases
the GIL while it waits, so other Python threads still run).

``CollectiveWatchdog`` is the deadline for that second case: rank 0 arms it around every piece
of work that holds collectives (a step, a heartbeat, the stop message); a daemon thread fires
``on_hang`` when one outlives ``timeout_s``. The blocked thread stays blocked; whoever handles
``on_hang`` must answer the waiting callers from the watchdog's thread (``AsyncEngineCore``
does) and must never wait for the blocked thread.

Start-up (every rank loading the model, the same-model check, the start message) has a
deadline of its own, longer, since ranks load at the speed of their disks
(``startup_deadline``): nothing can answer for a process that hangs there, so it exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from vllm_mlx.platform.errors import VllmMlxError

logger = logging.getLogger(__name__)


class RankLostError(VllmMlxError):
    """A rank of a tensor-parallel engine died or stopped answering: the engine cannot go on.

    Its message names ranks and steps only (no request content): the server shows it on
    ``/health`` and to the requests it ends."""


DEFAULT_STARTUP_TIMEOUT_S = 600.0  # as vLLM's engine-ready timeout (VLLM_ENGINE_READY_TIMEOUT_S)
STARTUP = "start-up (every rank loading and checking the model)"

COLLECTIVE_ERROR_TAGS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")
"""How MLX's distributed backends begin the messages of the errors their collectives raise
(e.g. "[ring] connection to a peer was lost")."""


def is_collective_failure(exc: BaseException) -> bool:
    """True for an error raised by a collective itself (a peer is gone), as opposed to one the
    model or the runner raised alike on every rank. After such an error the backend's later
    collectives may block instead of raising, so it must not be retried."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(COLLECTIVE_ERROR_TAGS)


class CollectiveWatchdog:
    """Fires ``on_hang(RankLostError)`` once, from its own thread, when a watched block of work
    runs longer than ``timeout_s``; after that ``fired`` holds the error."""

    def __init__(self, timeout_s: float, on_hang: Callable[[RankLostError], None], world_size: int) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self.world_size = world_size
        self.fired: RankLostError | None = None
        self._deadline: float | None = None
        self._what = ""
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="vllm-mlx-rank-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Arm the deadline for the block's duration (``what`` names it in the error)."""
        with self._changed:
            self._deadline, self._what = time.monotonic() + self.timeout_s, what
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._deadline = None
                self._changed.notify()

    def close(self) -> None:
        """Stop watching (the thread ends at its next wake-up)."""
        with self._changed:
            self.timeout_s = -1.0
            self._deadline = None
            self._changed.notify()

    def _watch(self) -> None:
        with self._changed:
            while self.timeout_s >= 0 and self.fired is None:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self.fired = RankLostError(
                    f"a tensor-parallel rank stopped answering: {self._what} did not finish within "
                    f"{self.timeout_s:g} s on {self.world_size} ranks (a rank is hung, or its link is down)"
                )
        if self.fired is not None:
            logger.critical("%s", self.fired)
            self.on_hang(self.fired)


def exit_hung_process(error: RankLostError) -> NoReturn:
    """End this process (exit status 1): its thread waiting on the other ranks can never return,
    and nothing else would end it. ``error`` was logged by the watchdog."""
    logger.critical("exiting: the thread waiting on the other ranks can never return (%s)", error)
    logging.shutdown()
    os._exit(1)


@contextmanager
def startup_deadline(group, timeout_s: float, what: str) -> Iterator[None]:
    """With a distributed ``group``: exit the process (``exit_hung_process``) if the block
    outlives ``timeout_s``; no deadline without one. For start-up, where no caller could be
    answered instead."""
    if group is None:
        yield
        return
    watchdog = CollectiveWatchdog(timeout_s, exit_hung_process, group.size())
    try:
        with watchdog.watch(what):
            yield
    finally:
        watchdog.close()

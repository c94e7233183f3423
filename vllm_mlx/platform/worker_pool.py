"""Child processes for work that may blow up: a grammar compile (``structured/compile_guard.py``),
a chat template from a model's files (``engine/template_guard.py``). Running it in a child whose
memory is capped and whose every answer has a deadline means a blow-up costs the child, never the
server: a child that overran its time is killed, one that ran out of memory dies by itself, and
either is replaced by a fresh one on the next use.

A child is ``worker_child.py`` run isolated (``python -I``) on a handler file, which it loads by
path (so a child imports the handler's libraries and nothing of ours); it speaks one JSON object
per line: the parent's first line is the setup, answered ``{"ready": true}``; each later line is
a request, answered by exactly one line.
"""

from __future__ import annotations

import contextlib
import json
import queue
import selectors
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["Worker", "WorkerCrashed", "WorkerFailed", "WorkerPool", "WorkerTimeout"]

CHILD_SCRIPT = Path(__file__).with_name("worker_child.py")


class WorkerTimeout(Exception):
    """The child did not answer in time; it was killed."""


class WorkerCrashed(Exception):
    """The child's output ended (it died: an allocation over its memory cap aborts it)."""


class WorkerFailed(Exception):
    """The handler raised on a request (its message is the exception's); the child serves on."""


class Worker:
    """One child process and its pipes; ``ask`` is one request and its answer."""

    def __init__(self, handler: Path, setup: dict, start_timeout_s: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(CHILD_SCRIPT), str(handler)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.ask(setup, start_timeout_s)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None and self.process.poll() is None

    def ask(self, message: dict, timeout_s: float, *, default: Callable[[object], object] | None = None) -> dict:
        """Send ``message``; its answer. A child that does not answer within ``timeout_s`` or dies
        is killed first, then ``WorkerTimeout`` or ``WorkerCrashed`` raised; a handler that raised
        is ``WorkerFailed``. ``default``: ``json.dumps``'s, for values JSON has no form for."""
        line = json.dumps(message, default=default)
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except OSError:  # its input closed: it died
            self.kill()
            raise WorkerCrashed from None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.kill()
                raise WorkerTimeout
        line = self.process.stdout.readline()  # children write whole lines, flushed
        if not line:
            self.kill()
            raise WorkerCrashed
        answer = json.loads(line)
        if "failed" in answer:
            raise WorkerFailed(answer["failed"])
        return answer

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class WorkerPool:
    """Up to ``max_workers`` children running ``handler``, started on first use and kept for the next.

    Args:
        handler: The handler file the children run (``worker_child.py`` says what it defines).
        setup: The child's first line (what every child of this pool starts with); its
            ``memory_bytes`` is what the child may add while answering one request.
        max_workers: Children at once; more callers wait for a free one.
        start_timeout_s: Seconds a child may take to start and answer its setup.
    """

    def __init__(self, handler: Path, setup: dict, *, max_workers: int, start_timeout_s: float = 60.0) -> None:
        self.handler = handler
        self.setup = setup
        self.max_workers = max_workers
        self.start_timeout_s = start_timeout_s
        self._idle: queue.LifoQueue[Worker | None] = queue.LifoQueue()
        for _ in range(max_workers):
            self._idle.put(None)  # a slot whose child is not started yet

    @contextlib.contextmanager
    def worker(self) -> Iterator[Worker]:
        """A live child, held for the block (waiting for a free slot). A child that died or was
        killed in the block frees its slot for a fresh one.

        Raises:
            RuntimeError: The child did not start.
        """
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive:
                try:
                    worker = Worker(self.handler, self.setup, self.start_timeout_s)
                except (WorkerTimeout, WorkerCrashed, WorkerFailed, OSError) as exc:
                    worker = None
                    raise RuntimeError(f"the worker process for {self.handler.name} did not start") from exc
            yield worker
        finally:
            self._idle.put(worker if worker is not None and worker.alive else None)

    def started(self) -> list[Worker]:
        """The children started and idle now."""
        return [worker for worker in list(self._idle.queue) if worker is not None]

    def close(self) -> None:
        """Stop the idle children (a later use starts new ones). A child also exits by itself when
        this process does (its input ends)."""
        workers = []
        with contextlib.suppress(queue.Empty):
            while len(workers) < self.max_workers:
                workers.append(self._idle.get_nowait())
        for worker in workers:
            if worker is not None:
                worker.kill()
            self._idle.put(None)


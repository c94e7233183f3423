"""Prove a grammar safe to compile before the server compiles it: build it first in a worker
process whose memory is capped and whose time is limited.

``bounds.py`` refuses the bounds known to be costly, but a walk can miss a case; compiling in
the server's own process would then let one request take all its memory. So a grammar not in
the cache is first compiled by a worker (``compile_worker.py``); only when that succeeded
within ``memory_bytes`` and ``timeout_s`` is it compiled again in-process (the matcher cannot
cross processes). A worker that ran out of memory or time is killed and replaced; the request
gets a ``ConstraintError`` saying which. At most ``max_workers`` grammars compile at once (in
the workers and in-process together), so parallel requests cannot multiply the cost.

The price, measured on a busy 2-core Linux box (docs/structured_outputs.md): ~3-5 ms more per
grammar not in the cache (the worker's compile and the round trip), and ~1 s once per worker to
start it (Python, llguidance and the tokenizer). Cache hits never reach the guard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

DEFAULT_MEMORY_BYTES = 1 << 30
"""Memory one worker may add while compiling (``maxItems: 10000`` needs ~10 MB)."""
DEFAULT_TIMEOUT_S = 20.0
"""Seconds one worker compile may take (``maxItems: 10000`` takes ~70 ms)."""
DEFAULT_MAX_WORKERS = 2

WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")

logger = logging.getLogger(__name__)


class CompileRefused(ValueError):
    """The worker ran out of memory or time on a grammar: compiling it here would hurt the server."""


class _Worker:
    """One worker process, its pipes and the read buffer of its replies."""

    def __init__(self, setup: str, start_timeout_s: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.process.stdin.write(setup + "\n")
        self.process.stdin.flush()
        self.read_reply(start_timeout_s)

    def check(self, grammar: str, timeout_s: float) -> str | None:
        """llguidance's error for ``grammar``, or None when it compiled."""
        self.process.stdin.write(json.dumps({"grammar": grammar}) + "\n")
        self.process.stdin.flush()
        return self.read_reply(timeout_s)["error"]

    def read_reply(self, timeout_s: float) -> dict:
        """The next reply line; ``TimeoutError`` or ``EOFError`` (the worker died)."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise TimeoutError
        line = self.process.stdout.readline()  # the worker writes whole lines, flushed
        if not line:
            raise EOFError
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class CompileGuard:
    """A pool of up to ``max_workers`` compile workers for one tokenizer, started on first use.

    Args:
        tokenizer_json: The tokenizer as ``LLTokenizer`` takes it (``tokenizer.json`` text).
        eos_token_ids: The tokenizer's end tokens (as the in-process ``LLTokenizer`` has them).
        memory_bytes: Memory one worker may add while compiling one grammar.
        timeout_s: Seconds one compile may take.
        max_workers: Grammars compiled at once (more requests wait for a free worker).
    """

    def __init__(
        self,
        tokenizer_json: str,
        eos_token_ids: list[int],
        *,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_workers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        self._setup = json.dumps({"tokenizer": tokenizer_json, "eos": eos_token_ids, "memory_bytes": memory_bytes})
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        self.max_workers = max_workers
        for _ in range(max_workers):
            self._idle.put(None)  # a slot whose worker is not started yet

    @contextlib.contextmanager
    def checked(self, grammar: str) -> Iterator[str | None]:
        """Compile ``grammar`` in a worker; yield llguidance's error (None when it compiled) while
        holding the worker's slot, so the caller's in-process compile counts against
        ``max_workers`` too.

        Raises:
            CompileRefused: The worker ran out of memory or time (it is replaced).
        """
        worker = self._idle.get()
        try:
            if worker is None:
                try:
                    worker = _Worker(self._setup, start_timeout_s=max(60.0, self.timeout_s))
                except (TimeoutError, EOFError, OSError) as exc:
                    raise RuntimeError("the structured-output compile worker did not start") from exc
            started = time.monotonic()
            try:
                error = worker.check(grammar, self.timeout_s)
            except TimeoutError:
                worker.kill()
                worker = None
                raise CompileRefused(
                    f"compiling it took longer than {self.timeout_s:g} s; the compile was stopped"
                ) from None
            except (EOFError, OSError):  # the worker died: an allocation over its cap aborts it
                worker.kill()
                worker = None
                elapsed = time.monotonic() - started
                raise CompileRefused(
                    f"compiling it needed more than {self.memory_bytes >> 20} MiB of memory, or crashed "
                    f"(the compile worker died after {elapsed:.1f} s)"
                ) from None
            yield error
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop the idle workers (a later compile starts new ones). A worker also exits by itself
        when this process does (its input ends)."""
        workers = []
        with contextlib.suppress(queue.Empty):
            while len(workers) < self.max_workers:
                workers.append(self._idle.get_nowait())
        for worker in workers:
            if worker is not None:
                worker.kill()
            self._idle.put(None)

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
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_mlx.platform.worker_pool import WorkerCrashed, WorkerFailed, WorkerPool, WorkerTimeout

DEFAULT_MEMORY_BYTES = 1 << 30
"""Memory one worker may add while compiling (``maxItems: 10000`` needs ~10 MB)."""
DEFAULT_TIMEOUT_S = 20.0
"""Seconds one worker compile may take (``maxItems: 10000`` takes ~70 ms)."""
DEFAULT_MAX_WORKERS = 2

WORKER_HANDLER = Path(__file__).with_name("compile_worker.py")



class CompileRefused(ValueError):
    """The worker ran out of memory or time on a grammar: compiling it here would hurt the server."""


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
        setup = {"tokenizer": tokenizer_json, "eos": eos_token_ids, "memory_bytes": memory_bytes}
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self.workers = WorkerPool(WORKER_HANDLER, setup, max_workers=max_workers, start_timeout_s=max(60.0, timeout_s))

    @contextlib.contextmanager
    def checked(self, grammar: str) -> Iterator[str | None]:
        """Compile ``grammar`` in a worker; yield llguidance's error (None when it compiled) while
        holding the worker's slot, so the caller's in-process compile counts against
        ``max_workers`` too.

        Raises:
            CompileRefused: The worker ran out of memory or time (it is replaced).
        """
        with self.workers.worker() as worker:
            started = time.monotonic()
            try:
                error = worker.ask({"grammar": grammar}, self.timeout_s)["error"]
            except WorkerTimeout:
                raise CompileRefused(
                    f"compiling it took longer than {self.timeout_s:g} s; the compile was stopped"
                ) from None
            except WorkerCrashed:  # an allocation over its cap aborts it
                elapsed = time.monotonic() - started
                raise CompileRefused(
                    f"compiling it needed more than {self.memory_bytes >> 20} MiB of memory, or crashed "
                    f"(the compile worker died after {elapsed:.1f} s)"
                ) from None
            except WorkerFailed as exc:  # e.g. a Python MemoryError under the cap
                raise CompileRefused(f"compiling it failed in the compile worker ({exc})") from None
            yield error

    def close(self) -> None:
        """Stop the idle workers (a later compile starts new ones)."""
        self.workers.close()

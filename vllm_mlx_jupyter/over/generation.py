"""``OverGeneration``: one template over many rows, fed to the shared engine with backpressure.

Threads. The kernel thread creates the handle and reads it. One driver thread runs an asyncio
loop: it renders the next row's prompt (on a one-worker builder thread, so the loop keeps
reading outputs), submits it, and reads every in-flight row's stream (``async for``: one thread
for all rows, however many). The session's monitor thread calls ``tick()`` to refresh the view
(elapsed time, ETA) between row ends. ``_lock`` orders state changes and renders.

Invariants:
- At most ``max_in_flight`` rows are submitted and unfinished at any time; the rest wait on our
  side, unrendered (100,000 rows never make 100,000 engine requests or prompts at once).
- A row ends in exactly one of: ``row_results[i]`` (finished), ``errors[i]`` (its prompt could
  not be built, or the engine refused or failed it), or neither (aborted or never started:
  ``--resume`` runs it again). One bad row never stops the others.
- Row ``i`` is the request ``f"{name}/{i}"``; with a seed ``S`` it samples with seed ``S + i``,
  so a row's output does not depend on what else ran.
- ``state`` only moves forward: generating -> done | aborted | error. Every view gets a final
  render before ``done`` becomes true.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from vllm_mlx_jupyter.over.rows import Row, RowSource
from vllm_mlx_jupyter.session.generation import (
    ABORTED, DONE, ERROR, GENERATING, MIN_INTERVAL, GenerationError, LiveViews, await_or_cancel, chosen_options,
    wait_or_cancel,
)  # fmt: skip
from vllm_mlx_jupyter.session.reading import OutputReader

RECENT = 5  # finished rows the live view shows
PARSED_KINDS = ("json", "json_object")  # constraints whose output parses to an object (--schema, --json)


@dataclass(frozen=True)
class RowResult:
    """A finished row: its text and what the engine said about it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    parsed: object = None
    parse_error: str | None = None


@dataclass(frozen=True)
class Progress:
    """Where an ``--over`` run stands. ``done`` counts rows kept from an earlier run too;
    rates and the ETA use only this run's rows and time."""

    total: int
    done: int
    failed: int
    in_flight: int
    tokens: int
    elapsed: float
    kept: int = 0

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.failed

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.elapsed if self.elapsed > 0 and self.tokens else None

    @property
    def eta(self) -> float | None:
        """Seconds until the last row, at this run's rate of rows so far (None before one ends)."""
        ended = self.done - self.kept + self.failed
        if not ended or self.elapsed <= 0:
            return None
        return self.remaining * self.elapsed / ended


class OverGeneration(LiveViews):
    """The handle of ``%%generate --over VAR`` (and of ``generate_over``).

    ``.results`` are the texts in input order (None for rows not done), or for a DataFrame a copy
    with ``output``, ``finish_reason``, ``prompt_tokens`` and ``output_tokens`` columns (and
    ``parsed`` and ``parse_error`` with ``--schema``/``--json``). ``.errors`` maps a row index
    to its error message, ``.progress`` is a ``Progress``, ``.parsed`` the parsed objects in
    input order.
    ``.cancel()`` stops it (rows done stay done), ``.wait(timeout)`` blocks, ``await`` works,
    and ``.result(timeout)`` returns ``.results`` once done.
    """

    is_over = True  # render.py shows it as an --over run

    def __init__(
        self,
        name: str,
        engine,
        source: RowSource,
        build_prompt: Callable[[Row], object],
        params,
        *,
        max_in_flight: int,
        reader_format=None,
        constraint=None,
        kept: dict[int, RowResult] | None = None,
        interval: float = MIN_INTERVAL,
        speculative: bool | None = None,
        lora_request=None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.name = self.request_id = name
        self.params = params
        self.speculative = speculative
        self.lora_request = lora_request
        self.max_in_flight = max_in_flight
        self.state = GENERATING
        self.error: BaseException | None = None
        self._errors: dict[int, str] = {}
        self.in_flight_peak = 0
        """The most rows submitted and unfinished at once (never above ``max_in_flight``)."""
        # What the session's monitor and inspector read of a generation: not one request.
        self.output = self.num_prompt_tokens = self.submitted_at = None
        self.republished = False
        self._engine = engine
        self._source = source
        self._build_prompt = build_prompt
        self._format = reader_format
        self._constraint = constraint
        self._results: dict[int, RowResult] = dict(kept or {})
        self._kept = len(self._results)
        self._in_flight: set[int] = set()
        self._tokens = 0
        self._recent: deque[tuple[int, str]] = deque(maxlen=RECENT)
        self._started = time.monotonic()
        self._ended: float | None = None
        self._interval = max(float(interval), MIN_INTERVAL)
        self._lock = threading.RLock()
        self._init_views()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._future: Future = Future()

    # -- reading --------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def total(self) -> int:
        return len(self._source)

    @property
    def progress(self) -> Progress:
        with self._lock:
            end = self._ended or time.monotonic()
            return Progress(self.total, len(self._results), len(self._errors), len(self._in_flight),
                            self._tokens, end - self._started, self._kept)  # fmt: skip

    @property
    def errors(self) -> dict[int, str]:
        """Row index -> why that row failed (a copy: the run may still add to it)."""
        with self._lock:
            return dict(self._errors)

    @property
    def row_results(self) -> list[RowResult | None]:
        """Every row's ``RowResult`` in input order (None where not done)."""
        with self._lock:
            return [self._results.get(i) for i in range(self.total)]

    @property
    def results(self):
        """The texts in input order, or the DataFrame with the result columns."""
        rows = self.row_results
        texts = [r.text if r is not None else None for r in rows]
        if not self._source.frame:
            return texts
        columns = {
            "output": texts,
            "finish_reason": [r.finish_reason if r is not None else None for r in rows],
            "prompt_tokens": [r.prompt_tokens if r is not None else None for r in rows],
            "output_tokens": [r.output_tokens if r is not None else None for r in rows],
        }
        if self._format is not None and self._format.params.kind in PARSED_KINDS:
            columns["parsed"] = [r.parsed if r is not None else None for r in rows]
            columns["parse_error"] = [r.parse_error if r is not None else None for r in rows]
        return self._source.table(columns)

    @property
    def parsed(self) -> list[object]:
        """Each row's parsed output (``--schema``/``--json``), in input order."""
        return [r.parsed if r is not None else None for r in self.row_results]

    @property
    def kept_results(self) -> dict[int, RowResult]:
        """The finished rows, by index: what ``--resume`` keeps."""
        with self._lock:
            return dict(self._results)

    def recent(self) -> list[tuple[int, str]]:
        """(row index, text) of the last rows to finish, oldest first."""
        with self._lock:
            return list(self._recent)

    def __repr__(self) -> str:
        p = self.progress
        return f"<OverGeneration {self.name!r} {self.state}: {p.done}/{p.total} rows, {p.failed} errors>"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> OverGeneration:
        """Start the driver thread; returns at once."""
        threading.Thread(target=self._run, name=f"vllm-mlx-{self.name}", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._drive())
        except BaseException as exc:  # noqa: BLE001 - delivered through result()
            self.error = exc
        finally:
            self._end()

    async def _drive(self) -> None:
        """Feed rows while slots are free; end when every submitted row has ended."""
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.max_in_flight)
        readers: set[asyncio.Task] = set()
        with ThreadPoolExecutor(1, thread_name_prefix=f"vllm-mlx-{self.name}-prompts") as builder:
            for row in self._source.rows(skip=frozenset(self._results)):
                await slots.acquire()
                if self._cancelled.is_set():
                    break
                try:
                    prompt = await loop.run_in_executor(builder, self._build_prompt, row)
                except Exception as exc:  # noqa: BLE001 - this row's problem only
                    self._fail(row.index, exc)
                    slots.release()
                    continue
                stream = self._submit(row.index, prompt)
                if stream is None:
                    break
                task = asyncio.create_task(self._read(row.index, stream, slots.release))
                readers.add(task)
                task.add_done_callback(readers.discard)
            if readers:
                await asyncio.gather(*readers)

    def _submit(self, index: int, prompt):
        """Add row ``index``'s request; None when no more rows should start."""
        from vllm_mlx.engine.async_engine import EngineDeadError

        with self._lock:
            if self._cancelled.is_set():
                return None
            self._in_flight.add(index)
            self.in_flight_peak = max(self.in_flight_peak, len(self._in_flight))
        params = self.params.clone(seed=self.params.seed + index) if self.params.seed is not None else self.params
        try:
            chosen = chosen_options(self.speculative, self.lora_request)
            stream = self._engine.add_request(prompt, params, self._row_id(index), constraint=self._constraint, **chosen)
        except EngineDeadError as exc:
            self.error = exc
            with self._lock:
                self._in_flight.discard(index)
            return None
        if self._cancelled.is_set():  # cancel() ran before this row was in flight: stop it too
            self._engine.abort(self._row_id(index))
        return stream

    async def _read(self, index: int, stream, release: Callable[[], None]) -> None:
        last, seen = None, 0
        try:
            async for last in stream:
                with self._lock:
                    self._tokens += last.num_completion_tokens - seen
                seen = last.num_completion_tokens
            self._finish_row(index, last)
        except Exception as exc:  # noqa: BLE001 - the engine refused or failed this row alone
            self._fail(index, exc)
        finally:
            with self._lock:
                self._in_flight.discard(index)
                self._dirty = True
                self._render()
            release()

    def _finish_row(self, index: int, output) -> None:
        if output is None or output.finish_reason == "abort":
            return  # not done: --resume runs it again
        if output.finish_reason == "error":
            self._fail(index, GenerationError(output.error or "the request failed"))
            return
        reading = OutputReader(self._format).finish(output.text, output.finish_reason)
        result = RowResult(output.text, output.finish_reason, output.num_prompt_tokens, output.num_completion_tokens,
                           reading.parsed, reading.parse_error)  # fmt: skip
        with self._lock:
            self._results[index] = result
            self._recent.append((index, output.text))

    def _fail(self, index: int, exc: BaseException) -> None:
        with self._lock:
            self._errors[index] = str(exc) or type(exc).__name__

    def _end(self) -> None:
        with self._lock:
            self._ended = time.monotonic()
            if self.error is not None:
                self.state = ERROR
            elif self._cancelled.is_set() and len(self._results) + len(self._errors) < self.total:
                self.state = ABORTED
            else:
                self.state = DONE
            self._render(final=True)
        if self.state == ERROR:
            failure = GenerationError(f"{self.name}: {self.error}")
            failure.__cause__ = self.error
            self._future.set_exception(failure)
        else:
            self._future.set_result(None)
        self._done.set()

    def _row_id(self, index: int) -> str:
        return f"{self.name}/{index}"

    # -- control --------------------------------------------------------------------------

    def cancel(self) -> bool:
        """Stop: no more rows start and the running ones are aborted (finished rows stay);
        False when it had already ended."""
        with self._lock:
            if self.done or self._cancelled.is_set():
                return False
            self._cancelled.set()
            running = list(self._in_flight)
        for index in running:
            self._engine.abort(self._row_id(index))
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (False on timeout). An interrupt cancels and re-raises."""
        return wait_or_cancel(self._done, timeout, self.cancel)

    def result(self, timeout: float | None = None):
        """``.results`` once done; ``TimeoutError`` after ``timeout`` seconds."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self.name!r} is still running after {timeout} s")
        self._future.result()
        return self.results

    def __await__(self):
        return self._await_results().__await__()

    async def _await_results(self):
        await await_or_cancel(self._future, self.cancel)
        return self.results

    # -- views ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Monitor hook: refresh the view (elapsed time and ETA move between row ends)."""
        with self._lock:
            self._dirty = True
            self._render()

    def observe(self, view: dict | None) -> None:
        """Monitor hook of single requests: rows are not watched one by one."""

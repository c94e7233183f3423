"""AsyncEngineCore: one engine thread owns the model; callers submit from anywhere.

MLX streams are thread-local, so the model is loaded and every forward pass runs on the engine
thread. Callers talk to it through a command queue and read their request's outputs from a
per-request stream, which is both a blocking iterator (any thread) and an async iterator (any
asyncio loop). The engine thread blocks on the command queue when idle (no busy-wait).

Guarantees:
- every stream ends: with its final output, or with the exception that stopped the engine;
- a consumer that stops early (breaks out, is cancelled, is garbage collected) aborts its
  request, which frees its KV blocks;
- ``stop()`` aborts what is running, joins the thread and releases the model.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_mlx.engine_core import EngineConfig, EngineCore
from vllm_mlx.errors import VllmMlxError
from vllm_mlx.request import RequestOutput, SamplingParams

_END = object()


class EngineDeadError(VllmMlxError):
    """The engine thread stopped (it failed, or was stopped) before the request finished."""


class RequestStream:
    """Outputs of one request, fed by the engine thread.

    Iterate it (blocking) or ``async for`` it; both end after the final output and re-raise an
    engine failure. Leaving the iteration early aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncEngineCore) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue | None = None
        self._lock = threading.Lock()
        self.finished = False

    # engine thread side
    def put(self, item: RequestOutput | BaseException | object) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            else:
                self._queue.put(item)

    # consumer side
    def _bind_loop(self) -> None:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._async_queue = asyncio.Queue()
                while not self._queue.empty():  # outputs that arrived before the first await
                    self._async_queue.put_nowait(self._queue.get())

    def _unwrap(self, item) -> RequestOutput:
        if item is _END:
            self.finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while not self.finished:
                try:
                    yield self._unwrap(self._queue.get())
                except StopIteration:
                    return
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        self._bind_loop()
        try:
            while not self.finished:
                try:
                    yield self._unwrap(await self._async_queue.get())
                except StopIteration:
                    return
        finally:
            if not self.finished:
                self._engine.abort(self.request_id)

    def result(self) -> RequestOutput:
        """Block until the request finishes; return its final output."""
        last = None
        for last in self:
            pass
        return last

    def __del__(self) -> None:
        if not self.finished and self._engine.is_running:
            self._engine.abort(self.request_id)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: RequestStream


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (e.g. a snapshot) and hand back the result."""

    fn: Callable[[EngineCore], object]
    future: Future = field(default_factory=Future)


_STOP = object()


class AsyncEngineCore:
    """An ``EngineCore`` on its own thread. ``start()``/``stop()``, or use ``with``/``async with``."""

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig()
        self._overrides = overrides
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.engine: EngineCore | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> AsyncEngineCore:
        """Start the engine thread and wait until the model is loaded (re-raising load errors)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vllm-mlx-engine", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def __enter__(self) -> AsyncEngineCore:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> AsyncEngineCore:
        await asyncio.get_running_loop().run_in_executor(None, self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request from any thread; returns its output stream at once."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self)
        self._commands.put(_Add(request_id, prompt, sampling_params or SamplingParams(), cache_salt, stream))
        return stream

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """Async iterator of a new request's outputs (the vLLM ``AsyncLLM.generate`` shape)."""
        return self.add_request(prompt, sampling_params, **kwargs).__aiter__()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are a no-op."""
        if self.is_running:
            self._commands.put(("abort", request_id))

    def call(self, fn: Callable[[EngineCore], object], timeout: float | None = None):
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._error
        command = _Call(fn)
        self._commands.put(command)
        return command.future.result(timeout)

    def get_stats(self) -> dict:
        return self.call(lambda engine: engine.get_stats())

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = EngineCore(self.config, **self._overrides)
        except BaseException as exc:  # noqa: BLE001 - delivered to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller
            self._error = exc
            self._fail_all(exc)
        finally:
            self.engine.shutdown()

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished_requests()
            if not self._drain_commands(block):
                self._abort_all()
                return
            for output in self.engine.step():
                self._deliver(output)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            self._streams[command.request_id] = command.stream
            try:
                engine.add_request(command.prompt, command.params, command.request_id, cache_salt=command.cache_salt)
            except Exception as exc:  # a bad request fails alone
                self._streams.pop(command.request_id, None)
                command.stream.put(exc)
        elif isinstance(command, _Call):
            try:
                command.future.set_result(command.fn(engine))
            except Exception as exc:
                command.future.set_exception(exc)
        else:
            _, request_id = command
            engine.abort_request(request_id)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        stream.put(output)
        if output.finished:
            del self._streams[output.request_id]

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        for output in self.engine.step():
            self._deliver(output)
        self._fail_all(EngineDeadError("the engine was stopped"))

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()
        while True:  # calls queued behind the failure must not hang
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.future.set_exception(EngineDeadError("the engine stopped"))
            elif isinstance(command, _Add):
                command.stream.put(EngineDeadError("the engine stopped"))

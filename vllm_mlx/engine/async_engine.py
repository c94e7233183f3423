"""AsyncEngineCore: one engine thread owns the model; callers submit from anywhere.

MLX streams are thread-local, so the model is loaded and every forward pass runs on the engine
thread. Callers talk to it through a command queue and read their request's outputs from a
per-request stream, which is both a blocking iterator (any thread) and an async iterator (any
asyncio loop). The engine thread blocks on the command queue when idle (no busy-wait).

Guarantees:
- every stream ends: with its final output, or with an ``EngineDeadError`` (chained to the
  engine's exception when the engine failed); a request the engine refuses (a bad prompt) raises
  its own error through its stream and leaves the others running;
- a consumer that stops early (breaks out, is cancelled, drops the stream unread) aborts its
  request, which frees its KV blocks;
- a stream holds at most one unread output (the latest snapshot; see ``RequestStream``), so a
  consumer that stalls costs memory bounded by one output, not by the number of steps;
- ``stop()`` aborts what is running (those streams end with a ``finish_reason == "abort"``
  output), joins the thread and releases the model; requests and calls submitted after the
  engine stopped or failed raise ``EngineDeadError``, they never hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mlx.config import EngineConfig
from vllm_mlx.core.outputs import StepRecord
from vllm_mlx.core.request import RequestOutput, SamplingParams
from vllm_mlx.core.snapshot import CacheSnapshot
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.engine.input_processor import PreparedPrompt
from vllm_mlx.engine.observation import EngineStats
from vllm_mlx.lora.request import LoRARequest
from vllm_mlx.multimodal.images import ImageSource
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import VllmMlxError
from vllm_mlx.platform.threads import clear_streams_at_exit, clear_thread_streams, create_random_state_here
from vllm_mlx.structured.grammar import CompiledGrammar

if TYPE_CHECKING:
    from vllm_mlx.lora.adapter import AdapterFiles

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 5.0
"""How long a tensor-parallel engine stays idle before checking its ranks (``EngineCore.heartbeat``)."""
HUNG_JOIN_S = 2.0
"""How long ``stop()`` waits for an engine thread blocked on a hung rank."""


class EngineDeadError(VllmMlxError):
    """The engine thread stopped (it failed, or was stopped) before the request finished."""


class RequestStream:
    """Outputs of one request, fed by the engine thread; read by one consumer.

    Iterate it (blocking, any thread) or ``async for`` it (any loop); both end after the final
    output (``finished=True``) and raise the request's or the engine's error. Leaving the
    iteration early, or dropping the stream unread, aborts the request.

    A stream holds at most one unread output, whatever its consumer does: outputs are
    cumulative snapshots, so one that arrives before the previous was read replaces it (its
    ``new_token_ids``/``new_text`` joined to the replaced one's, ``RequestOutput.absorb_unread``).
    A consumer that reads every step sees every output; a slow one skips to the latest. The
    final output and an error are never dropped: nothing follows the final output, and an
    error is raised once the unread output (if any) has been read.
    """

    def __init__(self, request_id: str, engine: AsyncEngineCore) -> None:
        self.request_id = request_id
        self._engine = engine
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # blocking consumers wait on it
        self._unread: RequestOutput | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None  # the async consumer's; set on its loop
        self.finished = False

    # engine thread side
    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand an output (it replaces an unread one) or an error to the consumer; False when
        the consumer's event loop is closed."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = self._error or item
            elif isinstance(self._unread, RequestOutput) and isinstance(item, RequestOutput):
                self._unread = item.absorb_unread(self._unread)
            else:  # nothing unread, or snapshots without deltas (the notebook's remote ones)
                self._unread = item
            self._arrived.notify()
            if self._loop is None:
                return True
            try:
                self._loop.call_soon_threadsafe(self._wakeup.set)
            except RuntimeError:  # the consumer's loop is closed: nobody will read this
                return False
            return True

    # consumer side
    def _take(self) -> RequestOutput | BaseException | None:
        """The unread output, else the error, else None (nothing yet). Call under the lock."""
        item, self._unread = self._unread, None
        return item if item is not None else self._error

    def _unwrap(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def _next_blocking(self) -> RequestOutput | BaseException:
        with self._arrived:
            while (item := self._take()) is None:
                self._arrived.wait()
            return item

    async def _next(self) -> RequestOutput | BaseException:
        while True:
            with self._lock:
                if (item := self._take()) is not None:
                    return item
                self._wakeup.clear()  # under the lock: a put after this sets it again
            await self._wakeup.wait()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while not self.finished:
                yield self._unwrap(self._next_blocking())
        finally:
            self._abort_if_unfinished()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        with self._lock:
            if self._loop is None:
                self._loop, self._wakeup = asyncio.get_running_loop(), asyncio.Event()
        try:
            while not self.finished:
                yield self._unwrap(await self._next())
        finally:
            self._abort_if_unfinished()

    def result(self) -> RequestOutput:
        """Block until the request finishes; return its final output."""
        last = None
        for last in self:
            pass
        return last

    def _abort_if_unfinished(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)

    def __del__(self) -> None:  # dropped unread: the engine holds only a weak reference
        self._abort_if_unfinished()


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | PreparedPrompt
    params: SamplingParams
    cache_salt: str | None
    fairness_key: str | None
    stream: RequestStream
    constraint: CompiledGrammar | None = None
    speculative: bool | None = None
    lora_request: LoRARequest | None = None
    lora_files: AdapterFiles | None = None
    """The adapter's files, read on the caller's thread when the engine did not know it yet."""


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (e.g. a snapshot) and hand back the result."""

    fn: Callable[[EngineCore], object]
    future: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


@dataclass(frozen=True)
class EngineFacts:
    """What does not change while an engine runs, kept off the engine thread for any caller."""

    model_path: Path
    weight_format: str
    max_num_seqs: int

    @classmethod
    def of(cls, engine: EngineCore) -> EngineFacts:
        return cls(engine.model_path, engine.weight_format, engine.config.max_num_seqs)


_STOP = object()


class AsyncEngineCore:
    """An ``EngineCore`` on its own thread. ``start()``/``stop()``, or use ``with``/``async with``.

    Nothing is loaded until ``start()``: the engine thread loads the model and runs every step.

    Args:
        config: The engine's settings; None for the defaults (the built-in default model).
        **overrides: ``EngineConfig`` fields that replace ``config``'s, applied on ``start()``.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig()
        self._overrides = overrides
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, weakref.ref[RequestStream]] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()  # set when the engine thread has closed everything
        self._lock = threading.Lock()  # orders "submit a command" against "stop accepting"
        self._accepting = False
        self._error: BaseException | None = None
        self._hung = False  # a tensor-parallel rank hung: the engine thread may never return
        self._ids = itertools.count()
        self.engine: EngineCore | None = None
        self._facts: EngineFacts | None = None  # set once the engine is built

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> AsyncEngineCore:
        """Start the engine thread and wait until the model is loaded.

        A load error is re-raised here, after the thread has ended. Starting a running engine
        is a no-op; a stopped or failed one cannot be restarted (``EngineDeadError``).

        Returns:
            The engine itself, so that ``engine = AsyncEngineCore(...).start()`` reads well.

        Raises:
            EngineDeadError: The engine was stopped (or failed) before.
            Exception: Whatever building the ``EngineCore`` raised (``ModelSourceError``,
                ``ModelOwnershipError``, ``TypeError`` for an unknown option, ...).
        """
        with self._lock:
            if self._thread is None:
                create_random_state_here()
                clear_streams_at_exit()
                self._thread = threading.Thread(target=self._run, name="vllm-mlx-engine", daemon=True)
                self._thread.start()
        self._ready.wait()
        if self.engine is None:  # the load failed
            self._thread.join()
            raise self._error
        if not self.is_running:
            raise EngineDeadError("the engine was stopped; create a new AsyncEngineCore") from self._error
        return self

    def stop(self) -> None:
        """Abort the running requests, join the engine thread and release the model.

        Streams of aborted requests end with a ``finish_reason == "abort"`` output. Idempotent,
        and prompt after a failure (the thread has already ended). Called on the engine thread
        (from a ``call()`` function) it only requests the stop.
        """
        if self._thread is not None:
            self._commands.put(_STOP)
            if threading.current_thread() is not self._thread:
                # A thread blocked on a hung rank may never return: do not wait for it (it is a
                # daemon; the process can still exit).
                self._thread.join(HUNG_JOIN_S if self._hung else None)

    @property
    def is_running(self) -> bool:
        """True between a successful ``start()`` and ``stop()`` or a failure."""
        return self._accepting

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread ended, if it failed (None while running or after ``stop()``)."""
        return self._error

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Block until the engine thread has ended (stopped or failed), or a tensor-parallel rank
        hung (the thread may stay blocked, but the engine is over); False on timeout."""
        return self._ended.wait(timeout)

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
        prompt: str | list[int] | PreparedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        images: Sequence[ImageSource] | None = None,
        fairness_key: str | None = None,
        constraint: CompiledGrammar | None = None,
        speculative: bool | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Submit a request from any thread; returns its output stream at once.

        Raises ``EngineDeadError`` when the engine is not running. Errors of the request itself
        (a bad prompt, a duplicate id) are raised by its stream.

        Args:
            prompt: Text or token ids.
            sampling_params: How to sample; None for the defaults.
            request_id: A unique id; None draws ``"req-<number>"``.
            cache_salt: Folded into the prefix-cache block hashes (see ``EngineCore.add_request``).
            fairness_key: Requests with one key share a turn of admission (see
                ``EngineCore.add_request``).
            images: Images for a vision-language model. They are loaded and preprocessed here,
                on the calling thread (fetching a URL may take a while: from an event loop,
                call ``prepare_prompt`` in an executor and pass its result instead).
            constraint: ``compile_constraint(sampling_params)``'s result; None compiles
                ``sampling_params.structured_outputs`` (if any) here, on the calling thread,
                never on the engine thread. An invalid one is raised by the stream.
            speculative: Whether it speculates (see ``EngineCore.add_request``).
            lora_request: Its LoRA adapter (see ``EngineCore.add_request``). Its files, the
                first time, are read here, on the calling thread.

        Returns:
            The request's ``RequestStream``: iterate it (blocking) or ``async for`` it. Leaving
            the iteration early, or dropping the stream unread, aborts the request.

        Raises:
            EngineDeadError: The engine is not running.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self)
        params = sampling_params or SamplingParams()
        try:
            if images:
                prompt = self.prepare_prompt(prompt, images)
            constraint = constraint or self.compile_constraint(params)
            lora_files = self.read_lora_files(lora_request) if lora_request is not None else None
        except EngineDeadError:
            raise
        except Exception as exc:  # the request's own error: raised by its stream
            stream.put(exc)
            return stream
        self._submit(
            _Add(request_id, prompt, params, cache_salt, fairness_key, stream, constraint, speculative, lora_request,
                 lora_files)
        )  # fmt: skip
        return stream

    def check_images(self, images: Sequence[ImageSource]) -> None:
        """``EngineCore.check_images``: ``ValueError`` for images sent to a text-only model."""
        engine = self.engine
        if engine is None or not self.is_running:
            raise self._dead_error(self._error)
        engine.check_images(images)

    def prepare_prompt(
        self,
        prompt: str | list[int],
        images: Sequence[ImageSource] | None = None,
        *,
        media_policy: MediaPolicy | None = None,
    ) -> PreparedPrompt:
        """``EngineCore.prepare_prompt`` on the calling thread (tokenizer and image processor
        only: no MLX work, so it need not wait for the engine thread). ``media_policy``
        replaces the engine's for these images (the server passes its own)."""
        engine = self.engine
        if engine is None or not self.is_running:
            raise self._dead_error(self._error)
        return engine.prepare_prompt(prompt, images, media_policy=media_policy)

    def compile_constraint(self, params: SamplingParams, max_bound: int | None = None) -> CompiledGrammar | None:
        """``EngineCore.compile_constraint`` on the calling thread (llguidance only, no MLX);
        None when ``params`` has no ``structured_outputs``.

        Raises:
            ConstraintError: An invalid schema, regex or grammar (a ``ValueError``).
            EngineDeadError: The engine is not running.
        """
        if params.structured_outputs is None:
            return None
        engine = self.engine
        if engine is None or not self.is_running:
            raise self._dead_error(self._error)
        return engine.compile_constraint(params, max_bound)

    def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        """Async iterator of a new request's outputs (the vLLM ``AsyncLLM.generate`` shape).

        Args:
            prompt: Text or token ids.
            sampling_params: How to sample; None for the defaults.
            **kwargs: ``request_id`` and ``cache_salt``, as for ``add_request``.

        Returns:
            An async iterator of ``RequestOutput``s; the last has ``finished=True``.

        Raises:
            EngineDeadError: The engine is not running.
        """
        return self.add_request(prompt, sampling_params, **kwargs).__aiter__()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are a no-op.

        Lock-free (it runs from ``__del__``): an abort that races the engine's end is dropped.
        """
        if self._accepting:
            self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[EngineCore], object], timeout: float | None = None):
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        Args:
            fn: Called with the ``EngineCore``; it must not block for long (the engine waits).
            timeout: Seconds to wait for the result; None waits as long as it takes.

        Returns:
            What ``fn`` returned.

        Raises:
            EngineDeadError: The engine is not running.
            TimeoutError: The result did not come within ``timeout``.
            Exception: Whatever ``fn`` raised.
        """
        command = _Call(fn)
        self._submit(command)
        return command.future.result(timeout)

    def _on_engine_thread(self, fn: Callable[[], object]):
        """``fn()`` on the engine thread: MLX work a caller's ``prepare_prompt`` needs (the length
        of an image the model expands, ``vlm_generic``), which no other thread may run."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.call(lambda _engine: fn())

    def stats(self) -> EngineStats:
        """The engine's ``stats()``, taken on the engine thread between steps."""
        return self.call(lambda engine: engine.stats())

    def get_stats(self) -> dict:
        """The engine's ``get_stats()`` (plain data), taken on the engine thread between steps."""
        return self.stats().to_dict()

    def snapshot(self, include_blocks: bool = True) -> CacheSnapshot:
        """The engine's ``snapshot()``, taken on the engine thread between steps."""
        return self.call(lambda engine: engine.snapshot(include_blocks))

    def cache_snapshot(self, include_blocks: bool = True) -> dict:
        """The engine's ``cache_snapshot()`` (plain data), taken on the engine thread between steps."""
        return self.snapshot(include_blocks).to_dict()

    def recent_step_records(
        self, after: int = 0, limit: int | None = None, timeout: float | None = None
    ) -> list[StepRecord]:
        """The engine's ``recent_step_records(after, limit)``: the newest kept ``StepRecord``s
        after step ``after``, oldest first (a kept record never changes); ``timeout`` as for ``call``."""
        return self.call(lambda engine: engine.recent_step_records(after, limit), timeout)

    # Facts fixed when the engine started, read without a trip to the engine thread.

    @property
    def model_path(self) -> Path:
        """Where the model was loaded from (a local directory). Needs a started engine."""
        return self._started().model_path

    @property
    def weight_format(self) -> str:
        """The weight format the engine runs: ``"quantized"`` or ``"float32"``. Needs a started engine."""
        return self._started().weight_format

    @property
    def max_num_seqs(self) -> int:
        """The most requests in the running batch. Needs a started engine."""
        return self._started().max_num_seqs

    def _started(self) -> EngineFacts:
        if self._facts is None:
            raise EngineDeadError("the engine has not started")
        return self._facts

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of every cached block not in use; returns True."""
        return self.call(lambda engine: engine.reset_prefix_cache())

    def read_lora_files(self, lora_request: LoRARequest, within: Path | None = None) -> AdapterFiles | None:
        """``EngineCore.read_lora_files`` on the calling thread (file I/O, no MLX)."""
        engine = self.engine
        if engine is None or not self.is_running:
            raise self._dead_error(self._error)
        return engine.read_lora_files(lora_request, within)

    def register_lora(self, lora_request: LoRARequest, within: Path | None = None) -> str:
        """``EngineCore.register_lora``: the files read here, on the calling thread (a stalled
        disk or a FIFO holds this caller, never the engine), parsed on the engine thread."""
        files = self.read_lora_files(lora_request, within)
        return self.call(lambda engine: engine.register_lora(lora_request, files))

    def unregister_lora(self, lora_int_id: int) -> None:
        """``EngineCore.unregister_lora`` on the engine thread."""
        self.call(lambda engine: engine.unregister_lora(lora_int_id))

    def save_prefix(self, prompt: str | list[int], path: str | Path, *, cache_salt: str | None = None) -> int:
        """``EngineCore.save_prefix``, run on the engine thread between steps."""
        return self.call(lambda engine: engine.save_prefix(prompt, path, cache_salt=cache_salt))

    def load_prefix(self, path: str | Path, *, cache_salt: str | None = None) -> int:
        """``EngineCore.load_prefix``: the file read here, on the calling thread, then loaded on
        the engine thread between steps."""
        engine = self.engine
        if engine is None or not self.is_running:
            raise self._dead_error(self._error)
        data = engine.read_prefix_bytes(path)
        return self.call(lambda engine: engine.load_prefix(path, cache_salt=cache_salt, data=data))

    def _submit(self, command: _Add | _Call) -> None:
        """Queue a command the engine must answer; raise EngineDeadError if it no longer can."""
        with self._lock:
            if not self._accepting:
                raise EngineDeadError("the engine is not running") from self._error
            self._commands.put(command)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = EngineCore(self.config, **self._overrides)
        except BaseException as exc:  # noqa: BLE001 - delivered to start()
            self._error = exc
            self._ready.set()
            self._ended.set()
            return
        if self.engine.tp_group is not None:
            self.engine.on_rank_lost = self._rank_lost
        if hasattr(self.engine.vision, "on_engine_thread"):  # images the model expands: measured here
            self.engine.vision.on_engine_thread = self._on_engine_thread
        self._facts = EngineFacts.of(self.engine)
        self._accepting = True
        self._ready.set()
        error = None
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller
            logger.critical("the engine failed; every waiting request gets the error", exc_info=exc)
            error = exc
        self._close(error)
        clear_thread_streams()
        self._ended.set()

    def _serve(self) -> None:
        """Apply commands and step until asked to stop; block on the queue when idle."""
        while self._drain_commands(block=not self.engine.has_unfinished_requests()):
            self._deliver_all(self.engine.step())

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        # A function of its own: a loop variable in ``_serve`` would keep the last output (all
        # its tokens) alive while the engine waits idle.
        for output in outputs:
            self._deliver(output)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once asked to stop. A
        tensor-parallel engine waits at most ``HEARTBEAT_PERIOD_S`` at a time and sends its
        heartbeat through the ranks between waits."""
        tensor_parallel = self.engine.tp_group is not None
        try:
            command = self._commands.get(block=block, timeout=HEARTBEAT_PERIOD_S if block and tensor_parallel else None)
        except queue.Empty:
            if block:
                self.engine.heartbeat()
            return True
        while command is not _STOP:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _apply(self, command: _Add | _Call | _Abort) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Call):
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as exc:  # the caller's function failed, not the engine
                command.future.set_exception(exc)
        else:
            self.engine.abort_request(command.request_id)

    def _add(self, command: _Add) -> None:
        """Admit a request; a request the engine refuses fails alone, through its stream."""
        try:
            if command.lora_files is not None:
                self.engine.register_lora(command.lora_request, command.lora_files)
            self.engine.add_request(
                command.prompt,
                command.params,
                command.request_id,
                cache_salt=command.cache_salt,
                fairness_key=command.fairness_key,
                constraint=command.constraint,
                speculative=command.speculative,
                lora_request=command.lora_request,
            )
        except Exception as exc:
            command.stream.put(exc)
            return
        self._streams[command.request_id] = weakref.ref(command.stream)

    def _deliver(self, output: RequestOutput) -> None:
        """Hand an output to its stream; abort the request if nobody will read it."""
        ref = self._streams.get(output.request_id)
        if ref is None:
            return
        stream = ref()
        delivered = stream is not None and stream.put(output)
        if output.finished or not delivered:
            del self._streams[output.request_id]
        if not delivered and not output.finished:
            self.engine.abort_request(output.request_id)

    # -- the end of the engine thread -------------------------------------------------------

    def _close(self, error: BaseException | None) -> None:
        """Stop accepting work, release the model, then end every stream and queued call."""
        with self._lock:
            self._accepting = False
            self._error = error
        outputs: list[RequestOutput] = []
        try:
            if error is None:
                outputs = self._abort_running()
            self.engine.shutdown()
        except BaseException as exc:  # noqa: BLE001 - still end every stream below
            error = self._error = error or exc
        for output in outputs:
            self._deliver(output)
        self._fail_streams(error)
        self._fail_queued_commands(error)

    def _abort_running(self) -> list[RequestOutput]:
        """On stop: abort every running request; return their final "abort" outputs."""
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        return self.engine.step()  # nothing is left to run: only the abort outputs

    def _rank_lost(self, error: BaseException) -> None:
        """A tensor-parallel rank hung (the watchdog's thread; the engine thread is blocked in a
        collective and may never return): end every stream and queued call with the error now,
        and stop accepting work, so ``/health`` and every waiting caller learn why."""
        with self._lock:
            self._accepting = False
            self._error = self._error or error
            self._hung = True
        self._fail_streams(self._error)
        self._fail_queued_commands(self._error)
        self._ended.set()  # as a rank that died does: the server shuts down and exits 1

    def _fail_streams(self, error: BaseException | None) -> None:
        # Taken whole: after a hang, the watchdog's thread and a late-returning engine thread
        # may both get here.
        streams, self._streams = self._streams, {}
        for ref in streams.values():
            stream = ref()
            if stream is not None:
                stream.put(self._dead_error(error))

    def _fail_queued_commands(self, error: BaseException | None) -> None:
        """Commands queued before ``_accepting`` went False must not hang their callers."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Call):
                command.future.set_exception(self._dead_error(error))
            elif isinstance(command, _Add):
                command.stream.put(self._dead_error(error))

    @staticmethod
    def _dead_error(cause: BaseException | None) -> EngineDeadError:
        """A fresh error per waiter (one exception object raised in many threads is unsafe)."""
        message = f"the engine failed: {cause!r}" if cause is not None else "the engine was stopped"
        error = EngineDeadError(message)
        error.__cause__ = cause
        return error

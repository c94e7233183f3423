"""Generation: the handle of one ``%%generate`` request.

Threads. The kernel thread creates a generation, shows its live views and reads it. One
consumer thread per generation reads the engine's stream and renders; the session's monitor
thread moves ``queued`` to ``prefilling`` and flushes throttled renders. ``_lock`` orders state
changes, view registration and renders.

Invariants:
- ``state`` only moves forward: queued -> prefilling -> generating -> done | aborted | error.
- Every view gets a final render before ``done`` becomes true, and nothing renders after it.
- Renders are throttled to one per ``interval`` (>= 0.1 s), except the final one.
- A generation that waits for ``after`` (the previous turn of its chat) builds its prompt only
  once ``after`` is done, so the prompt includes that turn.
- ``reading`` (content, tool calls, ``.parsed``) is final before ``on_finish`` runs, so a chat
  records the turn's tool calls.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from vllm_mlx_jupyter.session.reading import OutputReader, Reading, with_server_parts
from vllm_mlx_jupyter.states import ABORTED, DONE, ERROR, FINAL_STATES, GENERATING, PREFILLING, QUEUED  # noqa: F401

if TYPE_CHECKING:
    from vllm_mlx.core.sched.observation import RequestView
    from vllm_mlx.engine.input_processor import PreparedPrompt
    from vllm_mlx.tool_parsers import ToolCall
    from vllm_mlx_jupyter.views.token_view import TokenInfo, TokenLog

_ORDER = {QUEUED: 0, PREFILLING: 1, GENERATING: 2, DONE: 3, ABORTED: 3, ERROR: 3}
MIN_INTERVAL = 0.1  # at most 10 renders per second


class LiveViews:
    """The live views of a handle (a generation, an ``--over`` run): registered, re-sent, and
    rendered throttled, never after the final render. The handle sets ``_lock`` and
    ``_interval``, calls ``_init_views()``, and sets ``_dirty`` when what a view shows changed."""

    def _init_views(self) -> None:
        self._views: list = []
        self._dirty = False
        self._last_render = 0.0
        self._final_rendered = False

    def add_view(self, view) -> None:
        """Register a live view; it is rendered now and on every later (throttled) change."""
        with self._lock:
            self._views.append(view)
            view.update(self, final=self._final_rendered)

    def republish(self) -> None:
        """Send every view's current state again (``%vllm_mlx wait`` does this for finished
        handles: a headless runner such as nbclient drops updates sent between cells)."""
        with self._lock:
            for view in self._views:
                view.update(self, final=self._final_rendered, force=True)

    def has_view_in(self, execution_count: int) -> bool:
        return any(v.execution_count == execution_count for v in self._views)

    def _render(self, final: bool = False) -> None:
        """Push the state to every view (call with ``_lock`` held)."""
        if self._final_rendered:
            return
        now = time.monotonic()
        if not final and (not self._dirty or now - self._last_render < self._interval):
            return
        self._last_render, self._dirty = now, False
        self._final_rendered = final
        for view in self._views:
            view.update(self, final=final)

    def _ipython_display_(self) -> None:
        """Displaying a handle shows a live view (once per cell: the magic already showed one)."""
        from vllm_mlx_jupyter.views.render import LiveView, current_execution_count

        if not self.has_view_in(current_execution_count()):
            LiveView.show(self)


class GenerationError(RuntimeError):
    """The request failed (the engine refused it, or the engine stopped)."""


def chosen_options(speculative: bool | None, lora_request) -> dict:
    """The engine-request options a cell chose beyond its prompt, only those it chose: a server's
    client (``remote.py``) takes no ``speculative`` (the session refuses it there first)."""
    chosen: dict = {} if speculative is None else {"speculative": speculative}
    if lora_request is not None:
        chosen["lora_request"] = lora_request
    return chosen


class Generation(LiveViews):
    """A running (or finished) ``%%generate`` request.

    ``.text`` is the text so far, ``.done`` tells whether it finished, ``.output`` is the latest
    ``RequestOutput``. ``.result(timeout)`` blocks and returns the final text (an aborted
    generation returns its partial text; a failed one raises ``GenerationError``);
    ``await gen`` does the same without blocking the event loop. ``.cancel()`` aborts it.

    With ``--tools``, ``.tool_calls`` are the calls and ``.content`` the text outside them (and
    outside ``.reasoning``, a thinking model's ``<think>`` block); with
    ``--schema``/``--json``, ``.parsed`` is the validated object once done (None, with
    ``.parse_error`` saying why, when the output does not parse, e.g. cut by ``max_tokens``).
    """

    def __init__(
        self,
        name: str,
        engine,
        params,
        build_prompt: Callable[[], str | list[int]],
        *,
        after: Generation | None = None,
        on_finish: Callable[[Generation], None] | None = None,
        format: str = "markdown",
        interval: float = MIN_INTERVAL,
        reader: OutputReader | None = None,
        chat=None,
        allow_remote_images: bool = False,
        speculative: bool | None = None,
        lora_request=None,
    ) -> None:
        self.name = name
        self.speculative = speculative
        """Whether the request speculates (None: as the engine was loaded)."""
        self.lora_request = lora_request
        """The LoRA adapter it runs with (``--adapter``; None: the base model)."""
        self.request_id = name
        self.params = params
        self.format = format
        self.allow_remote_images = allow_remote_images
        """Markdown images from URLs are loaded (by default they show as links: see
        ``model_markdown.py``)."""
        self.state = QUEUED
        self.output = None
        self.error: BaseException | None = None
        self.prompt: str | list[int] | PreparedPrompt | None = None
        self.num_prompt_tokens: int | None = None
        self.submitted_at: float | None = None
        self.chat = chat
        """The ``ChatSession`` this generation is a turn of, or None."""
        self.reading = Reading("")
        self.token_log: TokenLog | None = None
        """With ``--logprobs K``: builds ``.tokens`` (the magic attaches it)."""
        self._reader = reader or OutputReader()
        self._engine = engine
        self._build_prompt = build_prompt
        self._after = after
        self._on_finish = on_finish
        self._interval = max(float(interval), MIN_INTERVAL)
        self._lock = threading.RLock()
        self._init_views()
        self._stream = None
        self._cancelled = False
        self._done = threading.Event()
        self._future: Future = Future()
        self.republished = False

    # -- reading --------------------------------------------------------------------------

    @property
    def text(self) -> str:
        output = self.output
        return output.text if output is not None else ""

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def content(self) -> str:
        """The text outside tool calls (the whole text without ``--tools``)."""
        return self.reading.content

    @property
    def reasoning(self) -> str | None:
        """``<think>`` reasoning (split off only with ``--tools``, as the server does)."""
        return self.reading.reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.reading.tool_calls

    @property
    def parsed(self) -> object:
        return self.reading.parsed

    @property
    def parse_error(self) -> str | None:
        return self.reading.parse_error

    @property
    def tokens(self) -> list[TokenInfo]:
        """With ``--logprobs K``: one ``TokenInfo`` (text, logprob, top K alternatives) per
        generated token so far; [] without."""
        log = self.token_log
        return log.update(self.output) if log is not None else []

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason if self.output is not None else None

    def __repr__(self) -> str:
        return f"<Generation {self.name!r} {self.state}: {len(self.text)} chars>"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Generation:
        """Submit now (unless waiting for ``after``) and start the consumer thread.

        A prompt that cannot be built, or an engine that is not running, raises here.
        """
        if self._after is None or self._after.done:
            self._submit()
        threading.Thread(target=self._run, name=f"vllm-mlx-{self.name}", daemon=True).start()
        return self

    def _submit(self) -> None:
        with self._lock:
            if self._cancelled or self._stream is not None:
                return
            self.prompt = self._build_prompt()
            token_ids = getattr(self.prompt, "token_ids", self.prompt)  # a PreparedPrompt has them
            if isinstance(token_ids, list):
                self.num_prompt_tokens = len(token_ids)
            self.submitted_at = time.monotonic()
            chosen = chosen_options(self.speculative, self.lora_request)
            self._stream = self._engine.add_request(self.prompt, self.params, self.request_id, **chosen)

    def _run(self) -> None:
        try:
            if self._stream is None:
                self._after._done.wait()
                self._submit()
            if self._stream is not None:
                for output in self._stream:
                    self._on_output(output)
        except BaseException as exc:  # noqa: BLE001 - delivered through result()
            self.error = exc
        finally:
            self._finish()

    def _on_output(self, output) -> None:
        with self._lock:
            self.output = output
            self.reading = with_server_parts(self._reader.feed(output.text), output)
            self.num_prompt_tokens = output.num_prompt_tokens
            if output.num_completion_tokens:
                self._advance(GENERATING)
            self._dirty = True
            self._render()

    def observe(self, view: RequestView | None) -> None:
        """Monitor hook: the engine's view of this request (``snapshot().requests``)."""
        with self._lock:
            if view is not None and view.status == "RUNNING":
                self._advance(PREFILLING)
                self._dirty = True
            self._render()

    def tick(self) -> None:
        """Monitor hook: render a change the throttle held back."""
        with self._lock:
            self._render()

    def _advance(self, state: str) -> None:
        if _ORDER[state] > _ORDER[self.state]:
            self.state = state

    def _finish(self) -> None:
        with self._lock:
            output = self.output
            if self.error is not None or (output is not None and output.finish_reason == "error"):
                self.state = ERROR
                if self.error is None:
                    self.error = GenerationError(output.error or "the request failed")
            elif self._cancelled or output is None or output.finish_reason == "abort":
                self.state = ABORTED
            else:
                self.state = DONE
            if output is not None:
                self.reading = with_server_parts(self._reader.finish(output.text, output.finish_reason), output)
        if self.state == DONE and self._on_finish is not None:
            try:
                self._on_finish(self)
            except Exception as exc:  # noqa: BLE001 - a hook must not leave the handle hanging
                self.error, self.state = exc, ERROR
        with self._lock:
            self._render(final=True)
        if self.state == ERROR:
            self._future.set_exception(_as_generation_error(self.error))
        else:
            self._future.set_result(self.text)
        self._done.set()

    # -- control --------------------------------------------------------------------------

    def cancel(self) -> bool:
        """Abort the request; False when it had already finished."""
        with self._lock:
            if self.done or self._cancelled:
                return False
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            self._engine.abort(self.request_id)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (False on timeout). An interrupt aborts the request and re-raises."""
        return wait_or_cancel(self._done, timeout, self.cancel)

    def result(self, timeout: float | None = None) -> str:
        """The final text; blocks until done (``TimeoutError`` after ``timeout`` seconds)."""
        if not self.wait(timeout):
            raise TimeoutError(f"generation {self.name!r} is still running after {timeout} s")
        return self._future.result()

    def __await__(self):
        return await_or_cancel(self._future, self.cancel).__await__()

    def add_tool_result(self, call: ToolCall | str, content: object) -> None:
        """Answer one of this turn's tool calls (a ``ToolCall`` or its id) in its chat session;
        ``content`` that is not a string is sent as JSON. The next turn of the chat
        (``%generate --chat SESSION``, no prompt, lets the model answer) includes the results."""
        self._chat_session().add_tool_result(self, call, content)

    def run_tools(self) -> list[object]:
        """Call the Python functions given as ``--tools`` with each call's arguments, add their
        results (``add_tool_result``) and return them, in call order."""
        return self._chat_session().run_tools(self)

    def _chat_session(self):
        if self.chat is None:
            raise GenerationError(f"generation {self.name!r} is not a chat turn: use --chat SESSION for tool results")
        return self.chat


def _as_generation_error(error: BaseException | None) -> BaseException:
    if isinstance(error, GenerationError):
        return error
    wrapped = GenerationError(f"generation failed: {error}")
    wrapped.__cause__ = error
    return wrapped


def wait_or_cancel(done: threading.Event, timeout: float | None, cancel: Callable[[], object]) -> bool:
    """Block until ``done`` (False after ``timeout`` seconds). An interrupt calls ``cancel``,
    waits a little for the end, and re-raises: a blocked cell stops what it waits for."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not done.wait(0.05):
            if deadline is not None and time.monotonic() >= deadline:
                return False
    except KeyboardInterrupt:
        cancel()
        done.wait(5.0)
        raise
    return True


async def await_or_cancel(future: Future, cancel: Callable[[], object]):
    """``future``'s result without blocking the event loop; cancelling the awaiting task calls
    ``cancel``."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_future) -> None:
        try:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))
        except RuntimeError:  # the loop closed before the work ended
            pass

    future.add_done_callback(wake)
    try:
        await waiter
    except asyncio.CancelledError:
        cancel()
        raise
    return future.result()

"""The kernel-resident engine: one ``AsyncEngineCore`` per kernel, its generations and chats.

The engine thread owns the model; this module only submits requests, reads streams and
snapshots, and keeps the notebook-side state (named generations, chat sessions). Nothing here
imports MLX until a model is loaded.

A monitor thread runs while generations are active: it moves queued requests to
"prefilling" (from ``snapshot().requests``) and flushes throttled renders. It spends
at most ~5% of the engine's time on snapshots (its period is 20x a snapshot's cost).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_mlx.core.snapshot import CacheSnapshot
from vllm_mlx.engine.chat import split_chat_images, template_token_ids, tool_parser_for
from vllm_mlx.platform.cpu_backend import backend_summary
from vllm_mlx.platform.errors import ImageInputError
from vllm_mlx.structured.response_format import ResponseFormat
from vllm_mlx_jupyter.session.generation import PREFILLING, QUEUED, Generation
from vllm_mlx_jupyter.session.prompt import ChatSession, user_content
from vllm_mlx_jupyter.session.reading import OutputReader
from vllm_mlx_jupyter.session.tools import ToolSet

MONITOR_PERIOD = 0.25
FINISHED_ROWS = 16  # finished generations the inspector keeps listing


class SessionError(ValueError):
    """A request the session cannot serve as asked (bad name, no chat template, ...)."""


class Session:
    """The notebook's engine and everything submitted to it."""

    def __init__(self) -> None:
        self.engine = None
        self.model: str | None = None
        self.options: dict = {}
        self.generations: dict[str, Generation] = {}
        self.chats: dict[str, ChatSession] = {}
        self.adapters: dict = {}
        """LoRA adapters by name (``%vllm_mlx adapter load``): ``LoRARequest``s of the engine."""
        self._names = itertools.count(1)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None
        self._inspector = None
        self._timeline = None
        self._colors: dict[str, int] = {}  # request id -> palette slot, shared by both widgets

    # -- the engine -------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def load(self, model: str, options: dict | None = None, progress: Callable[[str], None] | None = None):
        """Stop the current engine (if any) and start one on ``model``; blocks until loaded.

        ``options`` are ``EngineConfig`` fields. An interrupt while loading stops the half-made
        engine in the background and re-raises.
        """
        from vllm_mlx.config import EngineConfig
        from vllm_mlx.engine.async_engine import AsyncEngineCore

        self.shutdown()
        self.adapters.clear()  # their ids were the old engine's
        options = with_disk_default(dict(options or {}))
        engine = AsyncEngineCore(EngineConfig(model=str(model)), **options)
        ticker = _Ticker(progress, f"loading {model}")
        try:
            engine.start()
        except KeyboardInterrupt:
            threading.Thread(target=engine.stop, daemon=True).start()
            raise
        finally:
            ticker.stop()
        self.engine, self.model, self.options = engine, str(model), options
        self._tokenizer = self._load_template_tokenizer(engine)
        return engine

    def connect(self, url: str, api_key: str | None = None):
        """Stop the current engine (if any) and use the ``vllm-mlx serve`` at ``url`` instead
        (see ``remote.py``); raises ``ConnectError`` (nothing changes) when it cannot be used."""
        from vllm_mlx_jupyter.remote import RemoteEngine

        engine = RemoteEngine.connect(url, api_key)  # before shutdown: a failed connect changes nothing
        self.shutdown()
        self.engine, self.model, self.options, self._tokenizer = engine, engine.model, {}, None
        return engine

    @property
    def remote(self) -> bool:
        """Whether the engine is a server (``%vllm_mlx connect``), not the kernel's own."""
        return getattr(self.engine, "remote", False)

    def _refuse_remote(self, what: str) -> None:
        if self.remote:
            raise SessionError(f"{what} needs the in-kernel engine; not available while connected to "
                               f"{self.engine.url} (%vllm_mlx disconnect)")  # fmt: skip

    def max_num_seqs(self) -> int:
        """The engine's batch size (a server does not say: its default, 8)."""
        if self.remote:
            return 8
        return self.require_engine().max_num_seqs

    @staticmethod
    def _load_template_tokenizer(engine):
        """The kernel's own tokenizer for chat templates (the engine's is the engine thread's)."""
        from mlx_lm.utils import load_tokenizer

        return load_tokenizer(engine.model_path)

    def require_engine(self):
        if not self.loaded:
            raise SessionError("no model is loaded: run %vllm_mlx load [MODEL]")
        return self.engine

    @property
    def has_chat_template(self) -> bool:
        return self.remote or bool(self._template)  # a server applies its model's own template

    @property
    def _template(self) -> str:
        return getattr(self._tokenizer, "chat_template", None) or ""

    def chat_token_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Apply the model's chat template, with ``tools`` rendered by it (any thread: the
        template tokenizer is locked)."""
        if not self.has_chat_template:
            raise SessionError(f"the model {self.model!r} has no chat template: use --raw")
        with self._tokenizer_lock:
            return template_token_ids(self._tokenizer, messages, tools=tools)

    def chat_output_parser(
        self, tools: ToolSet | None, name: str | None, choice: str | None = None, prompt_tail: str = ""
    ):
        """How a request with ``tools`` is parsed: tool calls in the format ``name`` gives or the
        chat template shows (or, for ``choice`` ``required`` or a function name, the enforced
        call), and ``<think>`` reasoning; None without tools.

        A template that renders no tools gets them in the system message, and ``auto`` reads the
        calls in that format (``engine/chat.py``, ``tool_parsers/tool_prompt.py``).

        Raises:
            SessionError: A bad ``choice``, or for ``auto``: a template that renders tools in a
                tool-call format not known here, and no ``name``.
        """
        from vllm_mlx.tool_parsers.chat_output import ToolPlan, plan_chat_output

        if tools is None:
            return None
        try:
            plan = ToolPlan.of(tools.specs, _tool_choice(choice))
        except ValueError as exc:
            raise SessionError(f"--tool-choice: {exc}") from None
        template = self._template
        with self._tokenizer_lock:
            name = tool_parser_for(self._tokenizer, name)
        if plan.choice.mode == "auto" and (problem := _auto_problem(template, name)):
            raise SessionError(problem)
        try:
            return plan_chat_output(plan, template, prompt_tail, name)
        except ValueError as exc:
            raise SessionError(f"--tool-call-parser: {exc}") from None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine: running generations end as aborted; chat histories are kept."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        gens = list(self.generations.values())
        for gen in gens:  # first, so that chat turns waiting for a previous one never submit
            gen.cancel()
        engine.stop()
        for gen in gens:
            gen.wait(timeout)

    def close(self) -> None:
        """Shut down and end the monitor and the widgets (``%unload_ext``)."""
        self.shutdown()
        self._closing.set()
        self._wakeup.set()
        for widget in (self._inspector, self._timeline):
            if widget is not None:
                widget.close()
        self._inspector = self._timeline = None

    # -- generations ------------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        params,
        *,
        name: str | None = None,
        chat: str | None = None,
        system: str | None = None,
        raw: bool = False,
        format: str = "markdown",
        interval: float = 0.1,
        images: list | None = None,
        response_format: ResponseFormat | None = None,
        tools: ToolSet | None = None,
        tool_parser: str | None = None,
        tool_choice: str | None = None,
        allow_remote_images: bool = False,
        speculative: bool | None = None,
        adapter: str | None = None,
    ) -> Generation:
        """Submit a prompt (with ``images`` for a vision-language model: paths, URLs, bytes or
        PIL images, placed before the text); returns its started ``Generation`` at once.

        ``response_format`` (a ``ResponseFormat``, already in ``params``) gives ``.parsed``;
        ``tools`` are rendered by the chat template and the output's calls parsed (a chat keeps
        them for later turns; connected, the server does both); ``tool_choice`` is ``auto``
        (default), ``none``, ``required`` or a function's name (the last two are enforced by a
        constraint, on any model). An empty ``prompt`` continues a chat after tool results.
        ``allow_remote_images`` loads the images of the Markdown answer that come from URLs
        (otherwise shown as links). ``speculative``: whether this request speculates (None: as
        the engine was loaded; True without a ``--speculative-config``: n-gram lookup).
        """
        engine = self.require_engine()
        self.check_params(params)
        if speculative is not None and self.remote:
            raise SessionError("--speculative/--no-speculative: a server speculates as it was started; "
                               "connected, a cell cannot choose")  # fmt: skip
        lora_request = self.adapter(adapter) if adapter is not None else None
        if raw and (chat is not None or tools is not None):
            flag = "--chat" if chat is not None else "--tools"
            raise SessionError(f"{flag} needs the chat template; it cannot be combined with --raw")
        session = self.chats.setdefault(chat, ChatSession(chat)) if chat is not None else None
        self.check_prompt(prompt, chat)
        name = name if session is None else (name or self._next_name(session))
        name = self.claim_name(name)
        if self.remote:  # the server renders, enforces and parses the tools itself
            tools, parser = self._remote_tools(session, tools, tool_parser, tool_choice), None
            specs = ToolsForServer(tools.specs, _tool_choice(tool_choice)) if tools else None
        else:
            tools, parser_for = self._turn_tools(session, tools, tool_parser, tool_choice)
            parser = parser_for()  # refuse now what the cell cannot use; the real one needs the prompt
            specs = parser.plan.template_tools if parser is not None else None
        params = _with_forced_call(params, parser)
        reader = OutputReader(response_format)
        if session is not None:
            session.tools = tools
        build, after, on_finish = self._prompt_plan(prompt, session, system, raw, list(images or []), specs)
        if parser is not None:
            build = self._reading_with(build, reader, parser_for)
        gen = Generation(name, engine, params, build, after=after, on_finish=on_finish,
                         format=format, interval=interval, reader=reader, chat=session,
                         allow_remote_images=allow_remote_images, speculative=speculative,
                         lora_request=lora_request)  # fmt: skip
        gen.start()
        self.register(gen)
        if session is not None:
            session.pending = gen
        return gen

    def load_adapter(self, name: str, path: str):
        """Make the LoRA adapter at ``path`` known as ``name`` (read now: refused here if it does
        not fit the model); ``%%generate --adapter NAME`` then runs with it."""
        from vllm_mlx.lora.request import LoRARequest

        engine = self.require_engine()
        if self.remote:
            raise SessionError(
                "adapter load: connected, the adapters are the server's (its --lora-modules, or POST "
                "/v1/load_lora_adapter with --enable-lora-loading): %vllm_mlx adapter list shows them, "
                "%%generate --adapter NAME runs with one"
            )
        known = self.adapters.get(name)
        lora = LoRARequest(name, known.lora_int_id if known else len(self.adapters) + 1, str(path))
        try:
            engine.register_lora(lora)
        except ValueError as exc:
            raise SessionError(f"adapter load {name}: {exc}") from None
        self.adapters[name] = lora
        return lora

    def adapter(self, name: str):
        """The adapter ``--adapter NAME`` names: one loaded here, or connected, one the server serves."""
        if self.remote:
            from vllm_mlx_jupyter.remote import ServedAdapter

            served = self.served_adapters()
            if name not in served:
                raise SessionError(f"--adapter {name}: the server serves no such adapter "
                                   f"(it serves: {', '.join(served) or 'none'})")  # fmt: skip
            return ServedAdapter(name)
        try:
            return self.adapters[name]
        except KeyError:
            known = ", ".join(self.adapters) or "none yet: %vllm_mlx adapter load NAME PATH"
            raise SessionError(f"--adapter {name}: no such adapter (known: {known})") from None

    def served_adapters(self) -> list[str]:
        """Connected: the adapters the server serves, by name."""
        from vllm_mlx_jupyter.remote import ConnectError

        try:
            return self.require_engine().served_adapters()
        except ConnectError as exc:
            raise SessionError(str(exc)) from None

    def check_params(self, params) -> None:
        """Connected: refuse sampling options the OpenAI API cannot carry (not drop them)."""
        if self.remote:
            from vllm_mlx_jupyter.remote import RemoteUnsupported

            try:
                self.engine.check_params(params)
            except RemoteUnsupported as exc:
                raise SessionError(str(exc)) from None

    def _turn_tools(self, session: ChatSession | None, tools: ToolSet | None, name: str | None, choice: str | None):
        """(the turn's tools, ``parser_for(prompt_tail="")``). A chat turn without ``--tools``
        keeps the session's, called with ``auto`` only where the model's calls can be read."""
        if tools is None and session is not None and session.tools is not None:
            tools = session.tools
            if choice is None:
                with self._tokenizer_lock:
                    parser = tool_parser_for(self._tokenizer, name)
                if _auto_problem(self._template, parser):
                    choice = "none"
        return tools, functools.partial(self.chat_output_parser, tools, name, choice)

    def _remote_tools(self, session: ChatSession | None, tools: ToolSet | None, parser: str | None,
                      choice: str | None) -> ToolSet | None:  # fmt: skip
        """A connected turn's tools (a chat turn without ``--tools`` keeps the session's), checked
        with ``choice`` as the server will check them."""
        from vllm_mlx.tool_parsers.chat_output import ToolPlan

        if parser is not None:
            raise SessionError("--tool-call-parser: a server parses tool calls with its own (serve --tool-call-parser)")
        if tools is None and session is not None:
            tools = session.tools
        if tools is not None:
            try:
                ToolPlan.of(tools.specs, _tool_choice(choice))
            except ValueError as exc:
                raise SessionError(f"--tool-choice: {exc}") from None
        return tools

    def _reading_with(self, build: Callable, reader: OutputReader, parser_for: Callable) -> Callable:
        """``build``, then give ``reader`` the request's parser (``parser_for(prompt_tail)``: an
        open ``<think>`` at the prompt's end means the output starts inside reasoning)."""

        def build_and_plan():
            prompt = build()
            reader.use(parser_for(self._tail(prompt)))
            return prompt

        return build_and_plan

    def _tail(self, prompt) -> str:
        """The end of a prompt as text (a model without a chat template gets text prompts)."""
        token_ids = getattr(prompt, "token_ids", prompt)  # a PreparedPrompt has them
        if isinstance(token_ids, str):
            return token_ids[-64:]
        with self._tokenizer_lock:
            return self._tokenizer.decode(token_ids[-16:])

    def prompt_for(self, prompt: str, *, system: str | None = None, raw: bool = False, images: Iterable = ()):
        """The engine prompt of a one-turn request (no chat, no tools), built now: text, token
        ids, or a ``PreparedPrompt`` with its images (``SessionError`` for a bad image)."""
        build, _, _ = self._prompt_plan(prompt, None, system, raw, list(images), None)
        return build()

    def claim_name(self, name: str | None) -> str:
        """``name``, or the next free ``gen-N``; ``SessionError`` while one of that name runs."""
        name = name or self._next_name(None)
        previous = self.generations.get(name)
        if previous is not None and not previous.done:
            raise SessionError(f"generation {name!r} is still running: abort it or choose another --name")
        return name

    def register(self, handle) -> None:
        """Track a handle started elsewhere (an ``--over`` run) as a generation: ``%vllm_mlx
        wait``, ``abort`` and ``shutdown`` reach it, and the monitor refreshes its view."""
        with self._lock:
            self.generations.pop(handle.name, None)
            self.generations[handle.name] = handle
        self._ensure_monitor()

    def check_prompt(self, prompt: str, chat: str | None) -> None:
        """Refuse an empty prompt, unless it is a chat turn that answers tool results."""
        session = self.chats.get(chat) if chat is not None else None
        if not prompt and (session is None or not session.awaits_answer):
            raise SessionError(
                "%%generate: the cell is empty; write the prompt in the cell body "
                "(only after tool results may a --chat turn have none: %generate --chat SESSION)"
            )

    def _prompt_plan(
        self, prompt: str, session: ChatSession | None, system: str | None, raw: bool, images: list,
        specs: list[dict] | None,
    ):  # fmt: skip
        """(build_prompt, after, on_finish) for a plain, raw or chat request; ``specs``: the
        tools the chat template renders."""
        user = user_content(prompt, images) if prompt or images else None
        if session is not None:
            if system is not None:
                session.system = system
            session.turns += 1
            after = session.pending if session.pending is not None and not session.pending.done else None
            return (lambda: self.chat_prompt(session.conversation(user), specs), after,
                    lambda gen: session.record(user, gen))  # fmt: skip
        if raw or not self.has_chat_template:
            text = f"{system}\n\n{prompt}" if system else prompt
            return (lambda: self._with_images(text, images)), None, None
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return (lambda: self.chat_prompt(messages, specs)), None, None

    def chat_prompt(self, messages: list[dict], tools: list[dict] | ToolsForServer | None = None):
        """Token ids of ``messages`` (and ``tools``) under the chat template, with their images
        prepared; connected, the messages (images inline) and tools for the server."""
        if self.remote:
            from vllm_mlx_jupyter.remote import ChatPrompt, remote_messages

            try:
                messages = remote_messages(messages)
            except ImageInputError as exc:
                raise SessionError(f"--image: {exc}") from None
            return ChatPrompt(messages, tools.specs, tools.choice) if tools else ChatPrompt(messages)
        chat = split_chat_images(messages)
        try:
            self.require_engine().check_images(chat.images)
        except ValueError as exc:
            raise SessionError(f"--image: {exc}") from None
        return self._with_images(self.chat_token_ids(chat.messages, tools), chat.images)

    def _with_images(self, prompt: str | list[int], images: list):
        """``prompt`` as is, or with images, loaded and preprocessed (``PreparedPrompt``)."""
        if not images:
            return prompt
        self._refuse_remote("--image with --raw (a server takes images in chat messages only)")
        try:
            prepared = self.require_engine().prepare_prompt(prompt, images)
        except ValueError as exc:  # e.g. a text-only model
            raise SessionError(f"--image: {exc}") from None
        if prepared.error is not None:
            raise SessionError(f"--image: {prepared.error}")
        return prepared

    def _next_name(self, session: ChatSession | None) -> str:
        while True:
            name = f"{session.name}-{session.turns + 1}" if session is not None else f"gen-{next(self._names)}"
            if name not in self.generations or session is not None:
                return name

    def get(self, name: str) -> Generation:
        try:
            return self.generations[name]
        except KeyError:
            known = ", ".join(self.generations) or "none yet"
            raise SessionError(f"no generation named {name!r} (known: {known})") from None

    def active(self) -> list[Generation]:
        with self._lock:
            return [g for g in self.generations.values() if not g.done]

    def wait(self, names: Iterable[str] = ()) -> list[Generation]:
        """Block until the named (default: all active) generations are done.

        An interrupt aborts every generation being waited for and re-raises.
        """
        gens = [self.get(n) for n in names] or self.active()
        try:
            for gen in gens:
                while not gen.wait(0.5):
                    pass
        except KeyboardInterrupt:
            for gen in gens:
                gen.cancel()
            for gen in gens:
                gen.wait(5.0)
            raise
        self._republish_finished()
        for widget in (self._inspector, self._timeline):  # headless runs: the final picture
            if widget is not None:
                widget.refresh()
        return gens

    def _republish_finished(self) -> None:
        """Re-send the final views of generations that finished since the last wait."""
        with self._lock:
            finished = [g for g in self.generations.values() if g.done and not g.republished]
        for gen in finished:
            gen.republish()
            gen.republished = True

    def abort(self, names: Iterable[str]) -> list[str]:
        """Abort the named generations (``["all"]``: every active one); returns those aborted."""
        names = list(names)
        gens = self.active() if names == ["all"] else [self.get(n) for n in names]
        return [g.name for g in gens if g.cancel()]

    # -- cache and stats --------------------------------------------------------------------

    def snapshot(self, include_blocks: bool = True) -> CacheSnapshot:
        """The engine's (or the server's) ``CacheSnapshot``."""
        return self.require_engine().snapshot(include_blocks)

    def cache_snapshot(self) -> dict:
        """``snapshot()`` as plain data (what the inspector encodes for its widget)."""
        return self.require_engine().cache_snapshot()

    def reset_prefix_cache(self) -> bool:
        return self.require_engine().reset_prefix_cache()

    def status(self) -> dict:
        """Model, request counts and cache stats, as plain data."""
        if not self.loaded:
            return {"model": None, "loaded": False, "generations": len(self.generations)}
        if self.remote:
            server = self.engine.get_stats()
            return {"model": self.model, "loaded": True, "server": self.engine.url,
                    "active": [g.name for g in self.active()], **server["stats"]}  # fmt: skip
        stats = self.engine.snapshot(include_blocks=False).stats
        backend = backend_summary(self.engine.weight_format)
        disk = self.engine.stats().kv_disk
        return {"model": self.model, "loaded": True, "options": dict(self.options), "backend": backend,
                "active": [g.name for g in self.active()], **stats.to_dict(),
                **({"kv_disk": disk.to_dict()} if disk is not None else {})}  # fmt: skip

    def request_rows(self) -> list[dict]:
        """The inspector's names and states for requests (it merges them with the engine's
        snapshot, which has only the live ones), oldest first."""
        with self._lock:
            gens = list(self.generations.values())
        rows = []
        for gen in gens:
            out = gen.output
            rows.append({
                "id": gen.request_id, "name": gen.name, "status": gen.state,
                "prompt_tokens": gen.num_prompt_tokens or 0,
                "cached_tokens": out.num_cached_tokens if out is not None else 0,
                "disk_tokens": getattr(getattr(out, "metrics", None), "num_disk_tokens", 0),
                "adapter": gen.lora_request.lora_name if getattr(gen, "lora_request", None) else None,
                "output_tokens": out.num_completion_tokens if out is not None else 0,
            })  # fmt: skip
        return rows[-FINISHED_ROWS:]

    def inspector(self):
        """The session's cache inspector widget (one per session, bound to whatever is loaded)."""
        if self._inspector is None:
            from vllm_mlx_jupyter.views.inspector import CacheInspector

            self._inspector = CacheInspector(self, rows=self.request_rows, colors=self._colors)
        return self._inspector

    def timeline(self):
        """The session's scheduler timeline widget (one per session, like the inspector)."""
        self._refuse_remote("the timeline")
        if self._timeline is None:
            from vllm_mlx_jupyter.views.timeline import SchedulerTimeline

            self._timeline = SchedulerTimeline(self, colors=self._colors)
        return self._timeline

    def token_text(self, token_id: int) -> str:
        """One token's text, for ``--logprobs`` (any thread: the template tokenizer is locked)."""
        with self._tokenizer_lock:
            return self._tokenizer.decode([token_id])

    # -- the monitor ------------------------------------------------------------------------

    def _ensure_monitor(self) -> None:
        if self._monitor is None or not self._monitor.is_alive():
            self._monitor = threading.Thread(target=self._monitor_loop, name="vllm-mlx-monitor", daemon=True)
            self._monitor.start()
        self._wakeup.set()

    def _monitor_loop(self) -> None:
        while not self._closing.is_set():
            active = self.active()
            if not active:
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            cost = self._observe([g for g in active if g.state in (QUEUED, PREFILLING) and g.submitted_at])
            for gen in active:
                gen.tick()
            self._closing.wait(max(MONITOR_PERIOD, 20 * cost))

    def _observe(self, pending: list[Generation]) -> float:
        """Tell pending generations what the engine does with them; returns the snapshot cost."""
        engine = self.engine
        if not pending or engine is None:
            return 0.0
        start = time.monotonic()
        try:
            requests = engine.snapshot(include_blocks=False).requests
        except Exception:  # noqa: BLE001 - the engine stopped: the streams report it
            return 0.0
        cost = time.monotonic() - start
        for gen in pending:
            gen.observe(requests.get(gen.request_id))
        return cost


@dataclass(frozen=True)
class ToolsForServer:
    """A connected turn's tools (OpenAI's shape) and ``tool_choice`` (OpenAI's form, None: the
    server's default), sent with the messages instead of rendered here."""

    specs: list[dict]
    choice: str | dict | None


def _tool_choice(choice: str | None) -> str | dict | None:
    """``--tool-choice``: a mode, or a function's name (OpenAI's named-function form)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    return {"type": "function", "function": {"name": choice}}


def _auto_problem(template: str, parser_name: str | None) -> str | None:
    """Why ``auto`` cannot work here (the model's calls must be readable); None when it can."""
    from vllm_mlx.tool_parsers.registry import PARSER_NAMES, tool_parser_name

    if parser_name is None and tool_parser_name(template) is None:
        return (
            "the model's chat template shows no tool-call format known here: "
            f"give --tool-call-parser NAME (one of {', '.join(PARSER_NAMES)})"
        )
    return None


def _with_forced_call(params, parser):
    """``params`` with the constraint that enforces a ``required`` or named call, if any."""
    constraint = parser.plan.constraint if parser is not None else None
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise SessionError("--tool-choice required (or a function's name) is a constraint: give no other")
    return params.clone(structured_outputs=constraint)


class _Ticker:
    """Calls ``progress("<what>… N s")`` once a second from a thread until stopped."""

    def __init__(self, progress: Callable[[str], None] | None, what: str) -> None:
        self._progress, self._what = progress, what
        self._stopped = threading.Event()
        self._start = time.monotonic()
        if progress is not None:
            progress(f"{what}…")
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(1.0):
            self._progress(f"{self._what}… {time.monotonic() - self._start:.0f} s")

    def stop(self) -> None:
        self._stopped.set()


NOTEBOOK_KV_DISK_BUDGET = "2G"
"""The notebook's disk tier keeps this much by default: a laptop's SSD is shared with everything."""
KV_DISK_ENV = "VLLM_MLX_KV_DISK"
"""Where notebooks keep KV blocks when ``kv_disk_path`` is not given (``off``: nowhere)."""


def with_disk_default(options: dict) -> dict:
    """``options`` with the notebook's KV disk tier: on by default, in the user cache (or
    ``$VLLM_MLX_KV_DISK``), 2 GiB unless told; ``kv_disk_path="off"`` turns it off. A kernel
    restart then finds the prompts it computed before on disk."""
    from vllm_mlx.models.store import cache_root

    path = options.get("kv_disk_path", os.environ.get(KV_DISK_ENV) or str(cache_root() / "kv-disk"))
    if path is None or str(path).lower() in ("off", "none", ""):
        return {**options, "kv_disk_path": None}
    return {"kv_disk_budget": NOTEBOOK_KV_DISK_BUDGET, **options, "kv_disk_path": str(path)}

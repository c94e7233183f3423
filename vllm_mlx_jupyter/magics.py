"""``%%generate`` and ``%vllm_mlx``: the notebook's way to talk to the kernel-resident engine.

``%%generate`` returns at once with a live output area; several cells in a row generate
concurrently in one engine batch (the concurrency comes from the engine thread, not from the
kernel). Defaults are traitlets: ``%config GenerateMagics.max_tokens = 64``.
"""

from __future__ import annotations

import codecs
import collections
import os
import shlex
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from traitlets import Bool, Dict, Enum, Float, Int, TraitError, Unicode, default, validate

from vllm_mlx.platform.cpu_backend import warn_reference_blas
from vllm_mlx_jupyter.session.constraints import compile_check, response_format, variable
from vllm_mlx_jupyter.session.prompt import interpolate
from vllm_mlx_jupyter.session.session import Session, SessionError
from vllm_mlx_jupyter.views.markup import as_float, as_int, escape
from vllm_mlx_jupyter.views.token_view import TOKENS, TokenLog

MODEL_ENV = "VLLM_MLX_JUPYTER_MODEL"
FORMATS = ("markdown", "text", "code")
_NOT_PYTHON_OPTIONS = frozenset({"over", "out", "resume", "chat", "tools", "tool_call_parser", "tool_choice",
                                 "allow_remote_images"})  # fmt: skip

USAGE = """\
%vllm_mlx COMMAND [ARGS]

  load [MODEL] [--OPTION VALUE ...]  load a model (default: GenerateMagics.model) and start the engine;
                                     options are EngineConfig fields, e.g. --num-kv-blocks 256
  connect URL [--api-key KEY]        use a running `vllm-mlx serve` at URL instead of the in-kernel engine
  disconnect                         back to the in-kernel engine (the next %%generate loads it)
  status                             model (and server), running/waiting requests, KV usage, hit rates
  inspect                            show the KV-cache inspector widget
  timeline                           show the scheduler timeline widget (one column per engine step)
  wait [NAME ...]                    block until these (default: all) generations are done
  abort NAME ...|all                 abort generations
  reset-cache                        forget the prefix cache (blocks in use keep theirs)
  history SESSION                    show a chat session's turns
  reset SESSION                      forget a chat session
  fork SESSION NEW                   a new chat session with SESSION's turns (they share its KV blocks)
  adapter load NAME PATH | list      a LoRA adapter for %%generate --adapter NAME (load with --enable-lora)
  save-cache NAME [SESSION]          save chat SESSION (default: NAME), its turns and KV blocks, as NAME
  load-cache NAME                    restore saved chat NAME (any later kernel, same model)
  shutdown                           stop the engine (the next %%generate loads it again)
"""


@magics_class
class GenerateMagics(Magics):
    """The vllm_mlx magics; their defaults are configurable (``%config GenerateMagics``)."""

    model = Unicode(help=f"Model for %vllm_mlx load / auto-load (default: ${MODEL_ENV} or 'default').").tag(config=True)
    engine_options = Dict(help="EngineConfig options for loading, e.g. {'num_kv_blocks': 256}.").tag(config=True)
    auto_load = Bool(True, help="Load the model on the first %%generate if none is loaded.").tag(config=True)
    max_tokens = Int(256, help="Default --max-tokens.").tag(config=True)
    temperature = Float(0.7, help="Default --temperature (0 = greedy).").tag(config=True)
    top_p = Float(1.0, help="Default --top-p.").tag(config=True)
    top_k = Int(0, help="Default --top-k (0 = off).").tag(config=True)
    seed = Int(None, allow_none=True, help="Default --seed (None = random).").tag(config=True)
    system = Unicode(None, allow_none=True, help="Default --system prompt.").tag(config=True)
    format = Enum(FORMATS, "markdown", help="Default --format.").tag(config=True)
    update_interval = Float(0.1, help="Seconds between live updates of a cell (>= 0.1).").tag(config=True)
    tool_call_parser = Unicode(
        None, allow_none=True, help="Default --tool-call-parser (None: from the chat template)."
    ).tag(config=True)
    allow_remote_images = Bool(
        False, help="Load the images of Markdown answers that come from URLs (default: shown as links)."
    ).tag(config=True)

    @default("model")
    def _default_model(self) -> str:
        return os.environ.get(MODEL_ENV) or "default"

    @validate("update_interval")
    def _check_interval(self, proposal) -> float:
        return max(float(proposal["value"]), 0.1)

    @validate("engine_options")
    def _check_engine_options(self, proposal) -> dict:
        """Names are ``EngineConfig``'s declared fields: a typo fails at ``%config``, naming the
        close ones, not at the next load."""
        from vllm_mlx.config import EngineConfig  # here: %load_ext stays light
        from vllm_mlx.config.options import check_option_names

        try:
            check_option_names(EngineConfig, proposal["value"])
        except TypeError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    def __init__(self, shell=None, **kwargs) -> None:
        super().__init__(shell=shell, **kwargs)
        self.session = Session()

    # -- %%generate ---------------------------------------------------------------------------

    @no_var_expand
    @magic_arguments()
    @argument("-n", "--name", help="name of the generation (and of its engine request)")
    @argument("-o", "--out", metavar="VAR", help="store the generation handle in this variable")
    @argument("--max-tokens", type=int, help="most tokens to generate")
    @argument("--min-tokens", type=int, help="no end-of-sequence before this many tokens")
    @argument("--temperature", type=float, help="0 = greedy")
    @argument("--top-p", type=float)
    @argument("--top-k", type=int)
    @argument("--seed", type=int)
    @argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable; \\n escapes work)")
    @argument("--system", help="system prompt")
    @argument("--chat", metavar="SESSION", help="multi-turn: earlier turns of SESSION are prepended")
    @argument("--raw", action="store_true", help="send the cell as is (no chat template)")
    @argument("--image", action="append", metavar="PATH_OR_VAR",
              help="an image before the text: a notebook variable (PIL image, bytes, path) or a path/URL (repeatable)")  # fmt: skip
    @argument("--adapter", metavar="NAME", help="run with the LoRA adapter NAME (%%vllm_mlx adapter load NAME PATH)")
    @argument("--speculative", action="store_true", default=None,
              help="speculate (the engine's --speculative-config, else n-gram lookup): same text, sooner")  # fmt: skip
    @argument("--no-speculative", dest="speculative", action="store_false", help="never speculate")
    @argument("--wait", action="store_true", help="block until done (an interrupt aborts)")
    @argument("--format", choices=FORMATS, help="how to show the text")
    @argument("--allow-remote-images", action="store_true",
              help="load the Markdown answer's images from their URLs (default: shown as links, fetched on click)")  # fmt: skip
    @argument("--raw-braces", action="store_true", help="no {name} interpolation")
    @argument("--schema", metavar="VAR", help="constrain to a Pydantic model or JSON Schema dict (.parsed)")
    @argument("--json", action="store_true", help="constrain to any JSON object (.parsed)")
    @argument("--regex", metavar="PATTERN", help="constrain: the whole output matches PATTERN")
    @argument("--choice", action="append", metavar="TEXT_OR_VAR",
              help="constrain to one of these (repeatable, or one variable holding a list)")  # fmt: skip
    @argument("--grammar", metavar="VAR_OR_TEXT", help="constrain to a Lark/GBNF grammar")
    @argument("--compact-json", action="store_true", help="with --schema/--json: no whitespace between tokens")
    @argument("--logprobs", type=int, metavar="K",
              help="token view: each token shaded by its probability, its top K alternatives on hover (.tokens)")  # fmt: skip
    @argument("--tools", metavar="VAR", help="tools: a list of OpenAI tool dicts or Python functions (.tool_calls)")
    @argument("--tool-call-parser", metavar="NAME", help="tool-call format (default: from the chat template)")
    @argument("--tool-choice", metavar="auto|none|required|NAME",
              help="auto (default); required or a function NAME: a call is enforced, on any model")  # fmt: skip
    @argument("--over", metavar="VAR", help="run the cell as a template over each row of VAR (a list or a DataFrame)")
    @argument("--max-in-flight", type=int, metavar="N",
              help="with --over: at most N rows in the engine at once (default: 2x its max_num_seqs)")  # fmt: skip
    @argument("--resume", action="store_true", help="with --over: keep the rows the earlier run (-o OUT) finished")
    @line_cell_magic
    def generate(self, line: str, cell: str | None = None):
        """Generate from the cell body (the prompt); returns a ``Generation`` handle at once.

        ``{name}`` in the prompt is replaced by the value of ``name`` from the notebook when it
        exists; other braces are left alone (``--raw-braces`` turns this off). The live output
        shows the text as it streams, a status line and a stop button. The handle has
        ``.text``, ``.done``, ``.result(timeout)``, ``.cancel()``, ``.output`` and is awaitable;
        ``.parsed`` (``--schema``, ``--json``), ``.tool_calls`` and ``.add_tool_result()``
        (``--tools``). After tool results, the line form ``%generate --chat SESSION`` (no
        prompt) lets the model answer them. With ``--over VAR`` the body is a template run over
        every row of ``VAR`` (a list or a DataFrame), and the handle is an ``OverGeneration``.
        """
        args = _parse(self.generate, line)
        if args.over is not None:
            return self._generate_over(args, cell or "")
        images = [self._image(name) for name in args.image or []]
        cell = cell or ""
        prompt = cell.strip("\n") if args.raw else cell.strip()
        try:
            self.session.check_prompt(prompt, args.chat)  # before a model loads for nothing
        except SessionError as exc:
            raise UsageError(str(exc)) from None
        system = args.system if args.system is not None else self.system
        if not args.raw_braces:
            prompt = interpolate(prompt, self.shell.user_ns)
            system = interpolate(system, self.shell.user_ns) if system else system
        fmt = response_format(args, self.shell.user_ns)
        tools = self._tools(args.tools)
        params = self._sampling_params(args, fmt)
        self._ensure_loaded()
        if fmt is not None:
            compile_check(self.session.engine, fmt)
        try:
            gen = self.session.generate(
                prompt, params, name=args.name, chat=args.chat, system=system, raw=args.raw,
                format=TOKENS if args.logprobs is not None else args.format or self.format,
                interval=self.update_interval, images=images,
                response_format=fmt, tools=tools, tool_parser=args.tool_call_parser or self.tool_call_parser,
                tool_choice=args.tool_choice, allow_remote_images=args.allow_remote_images or self.allow_remote_images,
                speculative=args.speculative, adapter=args.adapter,
            )  # fmt: skip
        except SessionError as exc:
            raise UsageError(str(exc)) from None
        if args.logprobs is not None:
            gen.token_log = TokenLog(self.session.token_text, args.logprobs)
        if args.out:
            self.shell.user_ns[args.out] = gen
        return _show(gen, args.wait)

    def _generate_over(self, args, cell: str):
        """``%%generate --over VAR``: the cell body is every row's template."""
        for flag, value in (("--chat", args.chat), ("--tools", args.tools)):
            if value is not None:
                raise UsageError(f"%%generate: {flag} cannot go with --over: each row is a one-turn request "
                                 "of its own, not a turn of a conversation")  # fmt: skip
        if args.resume and not (args.out or args.name):
            raise UsageError("%%generate --resume: give -o OUT (or --name NAME), the earlier run to resume")
        items = variable("--over", args.over, self.shell.user_ns)
        previous = self.shell.user_ns.get(args.out) if args.out else self.session.generations.get(args.name)
        return self.run_over(items, cell, args, previous=previous if args.resume else None)

    def run_over(self, items, template: str, args, *, previous=None, values: dict | None = None):
        """Start an ``--over`` run of ``template`` over ``items`` with the cell flags ``args``;
        ``values`` are constraint objects by name (``generate_over``'s ``schema=...``)."""
        from vllm_mlx_jupyter.over.cell import OverRequest, start_over
        from vllm_mlx_jupyter.over.generation import OverGeneration

        template = template.strip("\n") if args.raw else template.strip()
        if not template:
            raise UsageError("%%generate --over: the cell is empty; write the template in it, e.g. Classify: {item}")
        fmt = response_format(args, collections.ChainMap(values or {}, self.shell.user_ns))
        params = self._sampling_params(args, fmt)
        self._ensure_loaded()
        if fmt is not None:
            compile_check(self.session.engine, fmt)
        request = OverRequest(
            items, template, params, name=args.name, system=args.system if args.system is not None else self.system,
            raw=args.raw, images=list(args.image or []), response_format=fmt, interpolate=not args.raw_braces,
            namespace=self.shell.user_ns, max_in_flight=args.max_in_flight,
            resume=previous if isinstance(previous, OverGeneration) else None, interval=self.update_interval,
            speculative=args.speculative, adapter=args.adapter,
        )  # fmt: skip
        try:
            handle = start_over(self.session, request, self._image_value)
        except SessionError as exc:
            raise UsageError(str(exc)) from None
        if args.out:
            self.shell.user_ns[args.out] = handle
        return _show(handle, args.wait)

    def _image_value(self, image):
        """An ``--image`` of every row: a name as ``--image NAME`` reads it, or a value as is."""
        return self._image(image) if isinstance(image, str) else image

    def over_call(self, items, template: str, options: dict, resume=None):
        """``generate_over(items, template, **options)``: options are the flags' names with
        Python values (``max_tokens=16``, ``choice=[...]``, ``schema=Model``, ``image="path"``)."""
        args = self.generate.parser.parse_args([])
        values = {}
        for key, value in options.items():
            if key in _NOT_PYTHON_OPTIONS or not hasattr(args, key):
                raise TypeError(f"generate_over() got an unexpected option {key!r}")
            if key == "schema":
                values["schema"], value = value, "schema"
            elif key in ("stop", "image", "choice") and (isinstance(value, str) or not isinstance(value, list | tuple)):
                value = [value]
            setattr(args, key, list(value) if isinstance(value, tuple) else value)
        return self.run_over(items, template, args, previous=resume, values=values)

    def _sampling_params(self, args, fmt):
        from vllm_mlx.core.request import SamplingParams

        def pick(value, fallback):
            return fallback if value is None else value

        stop = [codecs.decode(s, "unicode_escape") for s in args.stop or []]
        try:
            return SamplingParams(
                max_tokens=pick(args.max_tokens, self.max_tokens), min_tokens=pick(args.min_tokens, 0),
                temperature=pick(args.temperature, self.temperature),
                top_p=pick(args.top_p, self.top_p), top_k=pick(args.top_k, self.top_k),
                seed=pick(args.seed, self.seed), stop=stop,
                structured_outputs=fmt.params if fmt is not None else None, logprobs=args.logprobs,
            )  # fmt: skip
        except ValueError as exc:
            raise UsageError(f"%%generate: {exc}") from None

    def _tools(self, name: str | None):
        """``--tools VAR``: the variable's tools (OpenAI dicts or functions), or None."""
        from vllm_mlx_jupyter.session.tools import tool_set

        if name is None:
            return None
        try:
            return tool_set(variable("--tools", name, self.shell.user_ns))
        except (ValueError, TypeError) as exc:
            raise UsageError(f"%%generate --tools {name}: {exc}") from None

    def _image(self, name: str):
        """``--image NAME``: the notebook variable NAME, else NAME as a path or URL."""
        if name.isidentifier() and name in self.shell.user_ns:
            return self.shell.user_ns[name]
        if name.startswith("data:") or "://" in name:
            return name  # a URL: fetched (and checked) when the prompt is prepared
        path = Path(name).expanduser()
        if not path.exists():
            raise UsageError(f"--image {name}: no such file, and no variable of that name")
        return str(path)

    def _ensure_loaded(self) -> None:
        if self.session.loaded:
            return
        if not self.auto_load:
            raise UsageError("no model is loaded: run %vllm_mlx load [MODEL]")
        self._load(self.model, dict(self.engine_options))

    def _load(self, model: str, options: dict) -> None:
        from vllm_mlx.platform.errors import VllmMlxError

        handle = display(_note("loading…"), raw=True, display_id=True)
        try:
            engine = self.session.load(model, options, progress=lambda msg: handle.update(_note(msg), raw=True))
        except (VllmMlxError, ValueError, TypeError, OSError) as exc:
            handle.update(_note(f"could not load {model}: {exc}", error=True), raw=True)
            raise UsageError(f"could not load {model!r}: {exc}") from None
        kv = engine.stats().kv_cache
        handle.update(_note(f"loaded {model}: {kv.num_blocks} KV blocks × {kv.block_size} tokens"), raw=True)

    # -- %vllm_mlx ----------------------------------------------------------------------------

    @no_var_expand
    @line_magic
    def vllm_mlx(self, line: str):
        """Manage the engine: load, connect, disconnect, status, inspect, timeline, wait, abort,
        reset-cache, history, reset, fork, save-cache, load-cache, shutdown."""
        try:
            argv = split_line(line)
        except ValueError as exc:
            raise UsageError(f"%vllm_mlx: {exc}\n\n{USAGE}") from None
        if not argv or argv[0] in ("help", "-h", "--help"):
            print(USAGE)
            return None
        command = getattr(self, "_cmd_" + argv[0].replace("-", "_"), None)
        if command is None:
            raise UsageError(f"%vllm_mlx: unknown command {argv[0]!r}\n\n{USAGE}")
        try:
            return command(argv[1:])
        except SessionError as exc:
            raise UsageError(str(exc)) from None

    def _cmd_load(self, argv: list[str]) -> None:
        from vllm_mlx_jupyter.options import parse_load

        model, options = parse_load(argv)
        self._load(model or self.model, {**self.engine_options, **options})

    def _cmd_connect(self, argv: list[str]) -> None:
        from vllm_mlx_jupyter.remote import ConnectError

        url, api_key = _connect_args(argv)
        try:
            engine = self.session.connect(url, api_key)
        except ConnectError as exc:
            raise UsageError(str(exc)) from None
        display(_note(f"connected to {engine.url}: model {engine.model}"), raw=True)

    def _cmd_disconnect(self, argv: list[str]) -> None:
        if not self.session.remote:
            print("not connected to a server")
            return
        url = self.session.engine.url
        self.session.shutdown()
        print(f"disconnected from {url}; the next %%generate loads the in-kernel engine")

    def _cmd_status(self, argv: list[str]) -> None:
        display(_status_bundle(self.session.status()), raw=True)
        if self.session.loaded and not self.session.remote:
            warn_reference_blas()  # once per kernel: the backend row says which BLAS runs

    def _cmd_inspect(self, argv: list[str]) -> None:
        display(self.session.inspector())

    def _cmd_timeline(self, argv: list[str]):
        return self.session.timeline()

    def _cmd_wait(self, argv: list[str]) -> None:
        self.session.wait(argv)

    def _cmd_abort(self, argv: list[str]) -> None:
        if not argv:
            raise UsageError("%vllm_mlx abort NAME ...|all")
        aborted = self.session.abort(argv)
        print(f"aborted: {', '.join(aborted)}" if aborted else "nothing to abort")

    def _cmd_reset_cache(self, argv: list[str]) -> None:
        ok = self.session.reset_prefix_cache()
        print("prefix cache reset" if ok else "prefix cache not reset (is prefix caching on?)")

    def _cmd_history(self, argv: list[str]) -> None:
        print(self._chat(argv).transcript())

    def _cmd_adapter(self, argv: list[str]) -> None:
        if argv[:1] == ["list"] and len(argv) == 1:
            if self.session.remote:
                print("\n".join(f"{n}: served" for n in self.session.served_adapters()) or "the server serves no adapter")
            else:
                print("\n".join(f"{n}: {a.lora_path}" for n, a in self.session.adapters.items()) or "no adapters loaded")
            return
        if argv[:1] != ["load"] or len(argv) != 3:
            raise UsageError("%vllm_mlx adapter load NAME PATH | adapter list")
        self._ensure_loaded()
        lora = self.session.load_adapter(argv[1], argv[2])
        print(f"adapter {lora.lora_name!r} loaded from {lora.lora_path}: %%generate --adapter {lora.lora_name}")

    def _cmd_fork(self, argv: list[str]) -> None:
        from vllm_mlx_jupyter.session.saved_chats import fork_chat

        if len(argv) != 2:
            raise UsageError("%vllm_mlx fork SESSION NEW")
        if argv[1] in self.session.chats:
            raise UsageError(f"chat session {argv[1]!r} exists already (%vllm_mlx reset {argv[1]} first)")
        self.session.chats[argv[1]] = fork_chat(self._chat(argv[:1]), argv[1])
        print(f"chat session {argv[1]!r}: {argv[0]!r}'s {len(self.session.chats[argv[1]].messages)} messages")

    def _cmd_save_cache(self, argv: list[str]) -> None:
        from vllm_mlx_jupyter.session.saved_chats import SavedChat, save_chat

        if len(argv) not in (1, 2):
            raise UsageError("%vllm_mlx save-cache NAME [SESSION]")
        self._local_only("save-cache")
        saved = SavedChat.named(argv[0])
        tokens = save_chat(self.session, saved, self._chat(argv[-1:]))
        print(f"saved chat {argv[-1]!r} as {saved.name!r}: its messages and {tokens} tokens of KV ({saved.folder})")

    def _cmd_load_cache(self, argv: list[str]) -> None:
        from vllm_mlx_jupyter.session.saved_chats import SavedChat, load_chat

        if len(argv) != 1:
            raise UsageError("%vllm_mlx load-cache NAME")
        self._local_only("load-cache")
        self._ensure_loaded()
        chat, tokens, why = load_chat(self.session, SavedChat.named(argv[0]))
        self.session.chats[chat.name] = chat
        kv = f"{tokens} tokens of KV loaded" if why is None else f"its KV not loaded ({why}): the next turn recomputes it"
        print(f"chat session {chat.name!r} restored: {len(chat.messages)} messages; {kv}")

    def _local_only(self, command: str) -> None:
        if self.session.remote:
            raise UsageError(f"%vllm_mlx {command}: a server keeps its own cache; not when connected")

    def _cmd_reset(self, argv: list[str]) -> None:
        chat = self._chat(argv)
        del self.session.chats[chat.name]
        print(f"chat session {chat.name!r} forgotten")

    def _cmd_shutdown(self, argv: list[str]) -> None:
        self.session.shutdown()
        print("engine stopped")

    def _chat(self, argv: list[str]):
        if len(argv) != 1:
            raise UsageError("give one chat session name")
        try:
            return self.session.chats[argv[0]]
        except KeyError:
            known = ", ".join(self.session.chats) or "none yet"
            raise UsageError(f"no chat session {argv[0]!r} (known: {known})") from None


def _connect_args(argv: list[str]) -> tuple[str, str | None]:
    """``URL [--api-key KEY]`` (the key may also be ``--api-key=KEY``)."""
    words, key = [], None
    rest = iter(argv)
    for word in rest:
        if word == "--api-key":
            key = next(rest, None)
            if key is None:
                raise UsageError("%vllm_mlx connect: --api-key needs a value")
        elif word.startswith("--api-key="):
            key = word.split("=", 1)[1]
        else:
            words.append(word)
    if len(words) != 1:
        raise UsageError("%vllm_mlx connect URL [--api-key KEY]")
    return words[0], key


def _show(handle, wait: bool):
    """Show ``handle``'s live view; with ``wait``, block until it is done. With ``wait``, an
    interrupt anywhere here (even while the view is still being drawn) cancels what the cell
    started before it is re-raised: the cell never leaves a generation running behind it."""
    from vllm_mlx_jupyter.views.render import LiveView

    try:
        LiveView.show(handle)
        if wait:
            handle.wait()
    except KeyboardInterrupt:
        if wait:
            handle.cancel()
        raise
    return handle


def split_line(line: str) -> list[str]:
    """Shell-like words (quotes, backslashes); an unquoted word starting with ``#`` starts a
    comment, so ``%vllm_mlx load  # note`` works while ``--stop "#"`` and ``-n a#1`` stay."""
    quote, escaped, previous = None, False, " "
    for index, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            line = line[:index]
            break
        previous = char
    return shlex.split(line)


def _parse(magic, line: str):
    """magic_arguments parsing (shell-like quoting), with the help text on a bad flag."""
    try:
        return magic.parser.parse_args(split_line(line))
    except UsageError as exc:
        raise UsageError(f"%%{magic.__name__}: {exc}\n\n{magic.parser.format_help()}") from None
    except ValueError as exc:  # unbalanced quotes
        raise UsageError(f"%%{magic.__name__}: {exc}\n\n{magic.parser.format_usage()}") from None


def _note(text: str, error: bool = False) -> dict:
    color = "#e53935" if error else "#666"
    return {
        "text/plain": text,
        "text/html": f'<div style="font:12px monospace;color:{color}">{escape(text)}</div>',
    }


def disk_summary(disk: dict) -> str:
    """The KV disk tier's status row: size against budget, traffic, the write budget left."""
    if not disk.get("enabled"):
        return f"off: {disk.get('disabled_reason')}"
    mib = 1 << 20
    left = disk.get("write_budget_left")
    budget = "no write budget" if left is None else f"{as_int(left) / mib:.0f} MiB of this hour's writes left"
    return (
        f"{as_int(disk.get('bytes_on_disk')) / mib:.0f} of {as_int(disk.get('budget_bytes')) / mib:.0f} MiB "
        f"({as_int(disk.get('num_files'))} blocks) in {disk.get('path')}; {as_int(disk.get('blocks_read'))} blocks "
        f"read, {as_int(disk.get('blocks_written'))} written; {budget}"
    )


def _status_bundle(status: dict) -> dict:
    """The status table. Connected, the counts are a server's: coerced to numbers here."""
    if not status.get("loaded"):
        text = "no model loaded (run %vllm_mlx load, or just %%generate)"
        return {"text/plain": text, "text/html": f"<div>{escape(text)}</div>"}
    prefix = status.get("prefix_cache")  # a server shows none unless its operator discloses hits
    count = {key: as_int(status.get(key)) for key in
             ("num_used_blocks", "num_blocks", "num_cached_free_blocks", "num_free_blocks", "evictions", "running",
              "waiting")}  # fmt: skip
    kv = (
        f"{as_float(status.get('usage')):.0%} ({count['num_used_blocks']} of {count['num_blocks']} blocks "
        f"in use; {count['num_cached_free_blocks']} cached, {count['num_free_blocks']} free)"
    )
    hits = "not disclosed by the server" if not isinstance(prefix, dict) else (
        f"hit rate {as_float(prefix.get('hit_rate')):.0%}, {as_int(prefix.get('tokens_saved'))} tokens saved, "
        f"{count['evictions']} evictions"
    )
    rows = [
        ("model", status["model"]),
        ("server", status["server"]) if "server" in status else ("backend", status.get("backend", "")),
        ("requests", f"{count['running']} running, {count['waiting']} waiting"),
        ("KV usage", kv),
        ("prefix cache", hits),
        *([("KV on disk", disk_summary(status["kv_disk"]))] if isinstance(status.get("kv_disk"), dict) else []),
        ("active", ", ".join(status["active"]) or "none"),
    ]
    text = "\n".join(f"{k:>13}: {v}" for k, v in rows)
    cells = "".join(
        f"<tr><th style='text-align:right'>{escape(k)}</th>"
        f"<td style='text-align:left'>{escape(v)}</td></tr>"
        for k, v in rows
    )
    return {"text/plain": text, "text/html": f"<table>{cells}</table>"}

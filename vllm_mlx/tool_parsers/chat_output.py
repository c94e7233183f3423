"""One assistant output -> reasoning, content and tool calls, whole or streamed (any API).

A request's ``ChatOutputParser`` is planned from its tools, its ``tool_choice`` and the model's
chat template (``plan_chat_output``), then parses every completion of that request: the text goes
through the reasoning parser first (when the template has ``<think>``), and what is content goes
through the tool-call parser of ``auto`` or the ``ForcedCallStream`` of ``required``/named calls.
A Harmony model's output (gpt-oss) goes through one ``HarmonyStream`` instead, which yields all
three; its forced calls stay constrained JSON from the first token (the forced stream).

Streaming any chunking gives exactly the non-streamed result (``extract`` is the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.structured.params import StructuredOutputsParams
from vllm_mlx.tool_parsers.base import ChatDelta, ChatResult, IdFactory, ToolParser, assemble
from vllm_mlx.tool_parsers.harmony import HarmonyParser, HarmonyStream
from vllm_mlx.tool_parsers.reasoning import ReasoningParser
from vllm_mlx.tool_parsers.registry import select_reasoning_parser, select_tool_parser, uses_harmony
from vllm_mlx.tool_parsers.tool_choice import (
    ForcedCallStream,
    ToolChoice,
    check_tools,
    forced_call_constraint,
    parse_tool_choice,
)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean before the prompt is rendered."""

    choice: ToolChoice
    template_tools: list[dict] | None
    """The tools the chat template renders (none for ``tool_choice: none``)."""
    constraint: StructuredOutputsParams | None
    """The constraint that enforces ``required`` / a named function."""

    @classmethod
    def of(cls, tools: object, tool_choice: object = None, parallel_tool_calls: bool = True) -> ToolPlan:
        """Raises ``ValueError`` for bad tools or a bad ``tool_choice`` (the message says which)."""
        tools = check_tools(tools) if tools else None
        choice = parse_tool_choice(tool_choice, tools)
        rendered = tools if choice.mode != "none" else None
        return cls(choice, rendered, forced_call_constraint(tools or [], choice, parallel_tool_calls))


NO_TOOLS = ToolPlan(ToolChoice("none"), None, None)


class ChatOutputParser:
    """How every completion of one request is parsed; ``stream()`` gives one output's parser."""

    def __init__(
        self,
        plan: ToolPlan = NO_TOOLS,
        tool_parser: ToolParser | None = None,
        reasoning: ReasoningParser | None = None,
        id_factory: IdFactory | None = None,
        harmony: HarmonyParser | None = None,
    ) -> None:
        self.plan, self.tool_parser, self.reasoning, self.id_factory = plan, tool_parser, reasoning, id_factory
        self.harmony = harmony
        """Set: every output is Harmony, parsed by its own stream (no reasoning or tool parser)."""

    @property
    def parses_anything(self) -> bool:
        parsers = (self.reasoning, self.tool_parser, self.harmony)
        return self.plan.choice.forced or any(p is not None for p in parsers)

    @property
    def needs_special_tokens(self) -> bool:
        """The format's markers are special tokens: the output must be decoded with them."""
        return any(getattr(p, "needs_special_tokens", False) for p in (self.tool_parser, self.harmony))

    def stream(self) -> ChatOutputStream | HarmonyStream:
        return self.harmony.stream() if self.harmony is not None else ChatOutputStream(self)

    def extract(self, text: str) -> ChatResult:
        return assemble(self.stream().feed_all(text))

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: ``tool_calls`` when the model stopped after calling (a forced named call
        ends with ``stop``, as OpenAI's does)."""
        if engine_reason == "stop" and num_calls and self.plan.choice.mode != "function":
            return "tool_calls"
        return engine_reason


def plan_chat_output(
    plan: ToolPlan,
    chat_template: str | None,
    prompt_tail: str,
    tool_parser_name: str | None = None,
    id_factory: IdFactory | None = None,
    constraints_follow_reasoning: bool = False,
) -> ChatOutputParser:
    """The parser for one request. ``prompt_tail``: the end of the rendered prompt (an open
    ``<think>`` there means the output starts inside the reasoning).

    ``constraints_follow_reasoning``: the engine starts constraints after ``</think>`` (the
    tokenizer has single-token think markers, see ``structured.reasoning_gate``). Otherwise a
    forced call's output is JSON from its first token, so it is not split for reasoning.

    A Harmony template (or ``tool_parser_name`` harmony) gives a Harmony parser unless the call
    is forced; only ``auto`` calls a function (with ``none`` or no tools a call is content).

    Raises:
        ValueError: ``auto`` with tools, but no tool-call format is known for the template and
            no ``tool_parser_name`` was given; or an unknown ``tool_parser_name``.
    """
    tools = plan.template_tools
    if not plan.choice.forced and uses_harmony(chat_template, tool_parser_name):
        harmony = HarmonyParser(tools if plan.choice.mode == "auto" else [], id_factory)
        return ChatOutputParser(plan, id_factory=id_factory, harmony=harmony)
    tool_parser = None
    if plan.choice.mode == "auto":
        tool_parser = select_tool_parser(chat_template, tool_parser_name, tools, id_factory)
        if tool_parser is None:
            raise ValueError(
                "tool_choice 'auto' needs the model's tool-call format, and this model's chat template "
                "shows none we know: start the server with --tool-call-parser NAME, or use "
                "tool_choice 'required' or a named function (enforced on any model)"
            )
    splits_reasoning = constraints_follow_reasoning or not plan.choice.forced
    reasoning = select_reasoning_parser(chat_template, prompt_tail) if splits_reasoning else None
    return ChatOutputParser(plan, tool_parser, reasoning, id_factory)


class ChatOutputStream:
    """One output's incremental parser: ``feed`` text deltas, then ``finish`` once."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.reasoning = parser.reasoning.stream() if parser.reasoning else None
        if parser.plan.choice.forced:
            self.calls = ForcedCallStream(parser.plan.choice, parser.id_factory)
        else:
            self.calls = parser.tool_parser.stream() if parser.tool_parser else None
        self.num_calls = 0

    def feed(self, text: str) -> list[ChatDelta]:
        if self.reasoning is None:
            return self._content(text)
        return self._split(self.reasoning.feed(text))

    def finish(self) -> list[ChatDelta]:
        out = self._split(self.reasoning.finish()) if self.reasoning else []
        if self.calls is not None:
            out += self._calls(self.calls.finish())
        return out

    def feed_all(self, text: str) -> list[ChatDelta]:
        return [*self.feed(text), *self.finish()]

    def _split(self, deltas) -> list[ChatDelta]:
        out = []
        for delta in deltas:
            if delta.reasoning_content:
                out.append(ChatDelta(reasoning_content=delta.reasoning_content))
            if delta.content:
                out += self._content(delta.content)
        return out

    def _content(self, text: str) -> list[ChatDelta]:
        if self.calls is None:
            return [ChatDelta(content=text)] if text else []
        return self._calls(self.calls.feed(text))

    def _calls(self, deltas) -> list[ChatDelta]:
        out = []
        for delta in deltas:
            if delta.tool_call is not None:
                self.num_calls = max(self.num_calls, delta.tool_call.index + 1)
            out.append(ChatDelta(content=delta.content, tool_call=delta.tool_call))
        return out

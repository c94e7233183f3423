"""What a generation's text means: its content, reasoning, tool calls and parsed object.

One ``OutputReader`` per generation, fed the cumulative text on every output (on the consumer
thread). Tool calls and ``<think>`` reasoning are split incrementally by the request's
``ChatOutputParser`` (the server's, ``vllm_mlx.tool_parsers.chat_output``), which holds back an
open ``<tool_call>`` region: a live view never shows call markup, and the final reading equals
parsing the whole text at once. The constraint's parser runs once, on the final text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm_mlx.structured.response_format import ResponseFormat
from vllm_mlx.tool_parsers import ToolCall
from vllm_mlx.tool_parsers.chat_output import ChatDelta, ChatOutputParser, assemble


@dataclass
class Reading:
    """The text so far, read: ``content`` is the text outside tool calls and reasoning."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: object = None
    parse_error: str | None = None
    """Why a constrained (``--schema``/``--json``) output did not parse; None when it did."""


class OutputReader:
    """Reads one generation's output with an optional chat-output parser and response format."""

    def __init__(self, response_format: ResponseFormat | None = None) -> None:
        self.response_format = response_format
        self._parser: ChatOutputParser | None = None
        self._stream = None
        self._seen = ""
        self._deltas: list[ChatDelta] = []

    def use(self, parser: ChatOutputParser | None) -> None:
        """Parse tool calls and reasoning with ``parser`` (set once the prompt is rendered, whose
        end tells whether the output starts inside ``<think>``; before the first ``feed``)."""
        self._parser = parser if parser is not None and parser.parses_anything else None
        self._stream = self._parser.stream() if self._parser is not None else None

    def feed(self, text: str) -> Reading:
        """The reading of ``text``, the whole output so far (it only grows)."""
        if self._stream is None:
            return Reading(text)
        if not text.startswith(self._seen):  # never expected; start over rather than misparse
            self.use(self._parser)
            self._seen, self._deltas = "", []
        self._deltas += self._stream.feed(text[len(self._seen) :])
        self._seen = text
        return _reading(self._deltas)

    def finish(self, text: str, finish_reason: str | None) -> Reading:
        """The final reading: the held-back end of the text, and the parsed object."""
        reading = self.feed(text)
        if self._stream is not None:
            reading = _reading([*self._deltas, *self._stream.finish()])
        if self.response_format is not None:
            try:
                reading.parsed = self.response_format.parse(text)
            except ValueError as exc:
                reading.parse_error = _parse_error(exc, finish_reason)
        return reading


def _reading(deltas: list[ChatDelta]) -> Reading:
    result = assemble(deltas)
    return Reading(result.content or "", result.reasoning_content, result.tool_calls)


def _parse_error(exc: ValueError, finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "the output was cut by max_tokens before it was complete"
    return f"the output does not parse: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def with_server_parts(reading: Reading, output) -> Reading:
    """``reading`` with what a server parsed itself: a ``RemoteOutput``'s tool calls and
    reasoning (its text is already the content outside them); the kernel's outputs have none."""
    calls = getattr(output, "tool_calls", None)
    if calls is None:
        return reading
    return dataclasses.replace(reading, tool_calls=list(calls), reasoning=output.reasoning or reading.reasoning)

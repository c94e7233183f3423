"""What a generation's text means: its content, its tool calls and its parsed object.

One ``OutputReader`` per generation, fed the cumulative text on every output (on the consumer
thread). Tool calls are parsed incrementally by the tool parser's stream, which holds back an
open ``<tool_call>`` region: a live view never shows call markup, and the final reading equals
parsing the whole text at once (the stream's invariant). The constraint's parser runs once, on
the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mlx.structured.response_format import ResponseFormat
from vllm_mlx.tool_parsers import StreamDelta, ToolCall, ToolParser, reassemble


@dataclass
class Reading:
    """The text so far, read: ``content`` is the text outside tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: object = None
    parse_error: str | None = None
    """Why a constrained (``--schema``/``--json``) output did not parse; None when it did."""


class OutputReader:
    """Reads one generation's output with an optional tool parser and response format."""

    def __init__(self, response_format: ResponseFormat | None = None, tool_parser: ToolParser | None = None):
        self.response_format = response_format
        self._parser = tool_parser
        self._stream = tool_parser.stream() if tool_parser is not None else None
        self._seen = ""
        self._deltas: list[StreamDelta] = []

    def feed(self, text: str) -> Reading:
        """The reading of ``text``, the whole output so far (it only grows)."""
        if self._stream is None:
            return Reading(text)
        if not text.startswith(self._seen):  # never expected; start over rather than misparse
            self._stream, self._seen, self._deltas = self._parser.stream(), "", []
        self._deltas += self._stream.feed(text[len(self._seen) :])
        self._seen = text
        return self._reading(self._deltas)

    def finish(self, text: str, finish_reason: str | None) -> Reading:
        """The final reading: the held-back end of the text, and the parsed object."""
        reading = self.feed(text)
        if self._stream is not None:
            reading = self._reading([*self._deltas, *self._stream.finish()])
        if self.response_format is not None:
            try:
                reading.parsed = self.response_format.parse(text)
            except ValueError as exc:
                reading.parse_error = _parse_error(exc, finish_reason)
        return reading

    @staticmethod
    def _reading(deltas: list[StreamDelta]) -> Reading:
        result = reassemble(deltas)
        return Reading(result.content or "", result.tool_calls)


def _parse_error(exc: ValueError, finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "the output was cut by max_tokens before it was complete"
    return f"the output does not parse: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"

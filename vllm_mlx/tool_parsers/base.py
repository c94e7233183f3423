"""The tool-call parser interface, and the one incremental machine every format runs on.

A model's output is text outside tool calls (content) and *regions* that hold calls: a region
opens at a start marker (``<tool_call>``, ``[TOOL_CALLS]``, ...) and closes at an end marker, at
the next start marker, or at the end of the output, as the format says. A format only says where
its regions are and how one region's text becomes calls (``parse_region``).

Invariants (tests/structured/test_tool_parsers.py checks them on every recorded output, in random chunkings):

- ``extract(text)`` is ``ToolCallStream.feed(text)`` + ``finish()``, reassembled: the streamed
  deltas of any chunking of ``text`` concatenate to exactly the non-streamed result.
- Nothing raises on malformed output. A region whose text does not parse, or names a function
  that is not in ``tools`` (when tools are given), is content, byte for byte as the model wrote
  it (markers included). A region is all or nothing unless its format documents otherwise.
- Whitespace that only separates content from a call is dropped (the ``\\n\\n`` a model writes
  before ``<tool_call>``, and between and after calls); whitespace before a call that separates two
  pieces of content is kept, once (``A\\n\\n<call>\\nB`` -> ``A\\n\\nB``); everything else is
  kept. An output with no call is returned unchanged as content.
- A call is streamed once its region is complete: first a delta with its index, id and name (and
  ``arguments=""``), then its arguments. Nothing is ever retracted, so nothing is sent that a
  later token could still turn back into content.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

IdFactory = Callable[[], str]


def random_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object as a string, as OpenAI sends it."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(slots=True)
class ToolCallResult:
    """A whole output, parsed: the text outside calls (``None`` when empty) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index``: its first delta has ``id`` and ``name``, later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    """One streamed piece: either content or a piece of a tool call, as OpenAI's ``delta``."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass(slots=True)
class ParsedCall:
    """What a format found in a region, before it gets an id: a name and an arguments object."""

    name: str
    arguments: dict[str, Any]


def reassemble(deltas: Iterable[StreamDelta]) -> ToolCallResult:
    """Concatenate streamed deltas back into a result, as an OpenAI client does."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.content or ""
        if (piece := delta.tool_call) is not None:
            if piece.index not in calls:
                calls[piece.index] = ToolCall(id=piece.id or "", name=piece.name or "", arguments="")
            calls[piece.index].arguments += piece.arguments
    return ToolCallResult(content or None, [calls[i] for i in sorted(calls)])


def tool_schemas(tools: Sequence[dict] | None) -> dict[str, dict] | None:
    """Function name -> its parameters JSON Schema, from OpenAI ``tools``; ``None`` if no tools."""
    if tools is None:
        return None
    schemas = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {}
    return schemas


def dump_arguments(arguments: dict[str, Any]) -> str:
    """Arguments as strict JSON (``NaN``/``Infinity``, which Python's parser admits, raise)."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def call_from_object(obj: Any, argument_keys: Sequence[str] = ("arguments",)) -> ParsedCall | None:
    """``{"name": str, "<argument key>": object or JSON string}`` -> a call; anything else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):  # some models send the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ParsedCall(obj["name"], arguments) if isinstance(arguments, dict) else None


class ToolParser:
    """A tool-call format. Subclasses set the markers and implement ``parse_region``.

    Args:
        tools: the request's OpenAI ``tools``; when given, a call to any other name is not a call.
        id_factory: makes call ids (tests pass a deterministic one).
    """

    name: str = ""
    start_markers: tuple[str, ...] = ()
    # None: a region runs to the end of the output. A start marker also closes an open region
    # when ``start_closes_region`` (Mistral's ``[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}``).
    end_marker: str | None = None
    start_closes_region: bool = False
    # The markers are special tokens, dropped from text unless the request decodes them.
    needs_special_tokens: bool = False

    def __init__(self, tools: Sequence[dict] | None = None, id_factory: IdFactory | None = None):
        self.schemas = tool_schemas(tools)
        self.id_factory = id_factory or random_call_id

    def parse_region(self, body: str) -> list[ParsedCall] | None:
        """The calls in one region's text (between the markers); None if it is not valid."""
        raise NotImplementedError

    def region_start_at_beginning(self) -> str | None:
        """A character that opens a region when it is the output's first non-space one."""
        return None

    def known(self, call: ParsedCall) -> bool:
        return self.schemas is None or call.name in self.schemas

    def stream(self) -> ToolCallStream:
        """A fresh streaming parser for one output."""
        return ToolCallStream(self)

    def extract(self, text: str) -> ToolCallResult:
        """Parse a whole output; equal to streaming it in any chunking."""
        stream = self.stream()
        return reassemble([*stream.feed(text), *stream.finish()])


def held_back(buffer: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:n]):
                longest = n
                break
    return longest


class ToolCallStream:
    """One output's incremental parser: ``feed`` text deltas, then ``finish`` once.

    Holds back only what could still change meaning: a suffix that may begin a start marker, an
    open region, and trailing whitespace (sent only once more content follows).
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buffer = ""  # outside: text not yet sent; inside: the open region's body
        self.marker: str | None = None  # the start marker of the open region, if any
        self.pending_ws = ""  # trailing content whitespace: sent only if more content follows
        self.after_call = False  # the last thing was a call: drop the whitespace that follows it
        self.sent_content = False
        self.at_beginning = True  # nothing but whitespace seen so far
        self.scanned = 0  # inside: the region's body before this holds no end (a long file stays linear)
        self.num_calls = 0

    def feed(self, text: str) -> list[StreamDelta]:
        self.buffer += text
        out: list[StreamDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if self.marker is not None:
            body, marker, self.buffer = self.buffer, self.marker, ""
            if self.parser.end_marker is None:
                self._close_region(marker, body, "", out)
            else:  # an unclosed region is not a call
                self._content(marker + body, out)
        else:
            self._content(self.buffer, out)
            self.buffer = ""
        if self.pending_ws and not self.after_call:
            out.append(StreamDelta(content=self.pending_ws))
        self.pending_ws = ""
        return out

    # -- the state machine ----------------------------------------------------------------------

    def _step(self, out: list[StreamDelta]) -> bool:
        """Consume what can be decided now; True if it changed state and may go on."""
        return self._step_inside(out) if self.marker is not None else self._step_outside(out)

    def _step_outside(self, out: list[StreamDelta]) -> bool:
        parser = self.parser
        opener = parser.region_start_at_beginning()
        if opener and self.at_beginning:
            stripped = self.buffer.lstrip()
            if stripped.startswith(opener):
                self.pending_ws += self.buffer[: len(self.buffer) - len(stripped)]
                self.marker, self.buffer = "", stripped
                self.at_beginning = False
                return True
            if not stripped:  # only whitespace yet: the opener may still come
                return False
        found = [(self.buffer.find(m), m) for m in parser.start_markers if m in self.buffer]
        if found:
            pos, marker = min(found)
            self._content(self.buffer[:pos], out)
            self.marker, self.buffer = marker, self.buffer[pos + len(marker) :]
            self.at_beginning = False
            return True
        keep = held_back(self.buffer, parser.start_markers)
        self._content(self.buffer[: len(self.buffer) - keep], out)
        self.buffer = self.buffer[len(self.buffer) - keep :]
        return False

    def _step_inside(self, out: list[StreamDelta]) -> bool:
        parser = self.parser
        closers = [(parser.end_marker, parser.end_marker)] if parser.end_marker else []
        if parser.start_closes_region:  # the next start marker stays, to open the next region
            closers += [(marker, "") for marker in parser.start_markers]
        ends = []
        for text, consumed in closers:
            pos = self.buffer.find(text, max(0, self.scanned - len(text) + 1))
            if pos >= 0:
                ends.append((pos, consumed))
        if not ends:
            self.scanned = len(self.buffer)
            return False
        pos, end = min(ends, key=lambda e: e[0])
        marker, body = self.marker, self.buffer[:pos]
        self.marker, self.buffer, self.scanned = None, self.buffer[pos + len(end) :], 0
        self._close_region(marker, body, end, out)
        return True

    def _close_region(self, marker: str, body: str, end: str, out: list[StreamDelta]) -> None:
        try:
            calls = [(call.name, dump_arguments(call.arguments)) for call in self.parser.parse_region(body) or []]
        except Exception:  # noqa: BLE001 - no output may end the request: what fails is content
            calls = []
        if not calls:
            self._content(marker + body + end, out)
            return
        if not self.sent_content:  # nothing before the call for that whitespace to separate
            self.pending_ws = ""
        self.after_call = True
        for name, arguments in calls:
            index, self.num_calls = self.num_calls, self.num_calls + 1
            out.append(StreamDelta(tool_call=ToolCallDelta(index, self.parser.id_factory(), name)))
            out.append(StreamDelta(tool_call=ToolCallDelta(index, arguments=arguments)))

    def _content(self, text: str, out: list[StreamDelta]) -> None:
        """Send content, holding back trailing whitespace and dropping it after a call."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        if text.strip():
            self.at_beginning = False
        body = text.rstrip()
        if body:
            out.append(StreamDelta(content=self.pending_ws + body))
            self.pending_ws, self.sent_content = "", True
        self.pending_ws += text[len(body) :]


# -- one chat output: reasoning, content and calls (chat_output.py and harmony.py make these) --


@dataclass(slots=True)
class ChatDelta:
    """One streamed piece: reasoning, content, or a piece of a tool call."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass(slots=True)
class ChatResult:
    """A whole output, parsed; empty parts are None (``tool_calls`` an empty list)."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def assemble(deltas: Sequence[ChatDelta]) -> ChatResult:
    """Concatenate deltas, as a client reassembles a stream."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        if (piece := delta.tool_call) is not None:
            call = calls.setdefault(piece.index, ToolCall(id=piece.id or "", name=piece.name or "", arguments=""))
            call.arguments += piece.arguments
    return ChatResult(content or None, reasoning or None, [calls[i] for i in sorted(calls)])

"""gpt-oss's Harmony output -> reasoning, content and tool calls, whole or streamed.

Harmony writes messages ``<|start|>assistant<|channel|>CHANNEL<|message|>TEXT<|end|>``; the
generation prompt ends with ``<|start|>assistant``, so an output begins at its first message's
header. The channel says what a message is:

- ``analysis``: reasoning -> ``reasoning_content``, streamed as it comes.
- ``final``, and ``commentary`` without a recipient (a preamble shown to the user): content,
  streamed as it comes.
- any channel with a recipient ``to=functions.NAME`` (in the header, before or after
  ``<|channel|>``; a content type ``json`` or ``<|constrain|>json`` may follow): a call of NAME,
  its arguments the message text, sent when the message ends (``<|call|>``, or ``<|end|>``).

A message ends at ``<|end|>``, ``<|call|>``, ``<|return|>`` or ``<|endoftext|>`` (those three
are stop tokens: the last one the model wrote ends the text when special tokens are decoded),
at the next ``<|start|>``, or at the end of the output.

Malformed output never raises and nothing sent is retracted: a header that is not one (no
``<|channel|>``, other words, an unknown channel) is content as written; so is a call that is not
complete, whose text is not a JSON object, or whose function is not in ``tools`` (its header and
text, markers included, less the marker that ended it). Text between messages is content; a
stray end marker is content unless it is the last thing in the output. An output with no
Harmony markers is content unchanged, streamed as it comes (only a suffix that could begin a
marker is held back).

This is our own text-level parser: the ``openai-harmony`` package parses token ids with a
vocabulary it downloads at first use, which an offline server cannot do. The markers are special
tokens of gpt-oss's tokenizer, so the request must decode them (``needs_special_tokens``).
Streaming any chunking gives exactly the non-streamed result (``extract`` is the stream).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from vllm_mlx.tool_parsers.base import (
    ChatDelta,
    ChatResult,
    IdFactory,
    ToolCallDelta,
    assemble,
    dump_arguments,
    held_back,
    random_call_id,
    tool_schemas,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN, END_OF_TEXT = "<|end|>", "<|call|>", "<|return|>", "<|endoftext|>"
ENDS = (END, CALL, RETURN, END_OF_TEXT)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
CHANNELS = ("analysis", "commentary", "final")
ROLE, RECIPIENT, FUNCTIONS = "assistant", "to=", "functions."
MAX_HEADER = 256  # header characters without <|message|> after which it is not a header


class HarmonyParser:
    """Harmony for one request; ``stream()`` gives one output's parser.

    Args:
        tools: the request's OpenAI ``tools``; a call to any other function is content
            (``None``: any name is a call).
        id_factory: makes call ids (tests pass a deterministic one).
    """

    name = "harmony"
    needs_special_tokens = True

    def __init__(self, tools: Sequence[dict] | None = None, id_factory: IdFactory | None = None) -> None:
        self.schemas = tool_schemas(tools)
        self.id_factory = id_factory or random_call_id

    def stream(self) -> HarmonyStream:
        return HarmonyStream(self)

    def extract(self, text: str) -> ChatResult:
        return assemble(self.stream().feed_all(text))


def lex(buffer: str, final: bool) -> tuple[list[str], str]:
    """Split ``buffer`` into text pieces and whole markers; the rest is a suffix that may still
    begin a marker (none when ``final``)."""
    pieces, start, pos = [], 0, 0
    while (pos := buffer.find("<|", pos)) >= 0:
        marker = next((m for m in MARKERS if buffer.startswith(m, pos)), None)
        if marker is None:
            pos += 1
            continue
        if pos > start:
            pieces.append(buffer[start:pos])
        pieces.append(marker)
        start = pos = pos + len(marker)
    keep = 0 if final else held_back(buffer[start:], MARKERS)
    if len(buffer) - keep > start:
        pieces.append(buffer[start : len(buffer) - keep])
    return pieces, buffer[len(buffer) - keep :]


def could_open_header(text: str) -> bool:
    """The text before ``<|channel|>`` in a header: a role and a recipient, or a prefix of them
    (false stays false as text is added, so the answer does not depend on the chunking)."""
    words = text.split()
    open_word = bool(text) and not text[-1].isspace()
    for i, word in enumerate(words):
        last = open_word and i == len(words) - 1
        if word == ROLE or word.startswith(RECIPIENT):
            continue
        if not (last and (ROLE.startswith(word) or RECIPIENT.startswith(word))):
            return False
    return True


class HarmonyStream:
    """One output's incremental parser: ``feed`` text deltas, then ``finish`` once.

    States: ``header`` (between a message's start and ``<|message|>``), ``body`` (a message's
    text), ``outside`` (between messages). The output starts in a header opened by the prompt.
    """

    def __init__(self, parser: HarmonyParser) -> None:
        self.parser = parser
        self.buffer = ""  # text not yet lexed: a suffix that may begin a marker
        self.state = "header"
        self.raw = ""  # the open header or call as written (markers included), for content
        self.before_channel = ""  # header text before <|channel|> (role, recipient)
        self.after_channel: str | None = None  # header text after it (channel, recipient, type)
        self.kind = ""  # the open body's: "reasoning", "content" or "call"
        self.function: str | None = None  # the open call's function
        self.body = ""  # the open call's text
        self.stray_end = ""  # an end marker between messages: content unless the output ends
        self.num_calls = 0

    def feed(self, text: str) -> list[ChatDelta]:
        pieces, self.buffer = lex(self.buffer + text, final=False)
        out: list[ChatDelta] = []
        for piece in pieces:
            self._piece(piece, out)
        return out

    def finish(self) -> list[ChatDelta]:
        pieces, self.buffer = lex(self.buffer, final=True)
        out: list[ChatDelta] = []
        for piece in pieces:
            self._piece(piece, out)
        if self.state == "header" or (self.state == "body" and self.kind == "call"):
            self._content(self.raw + self.body, out)  # a header or call cut short
        self.state, self.raw, self.body, self.stray_end = "outside", "", "", ""
        return out

    def feed_all(self, text: str) -> list[ChatDelta]:
        return [*self.feed(text), *self.finish()]

    # -- the state machine ----------------------------------------------------------------------

    def _piece(self, piece: str, out: list[ChatDelta]) -> None:
        if self.state == "header":
            self._header(piece, out)
        elif self.state == "body":
            self._body(piece, out)
        else:
            self._outside(piece, out)

    def _outside(self, piece: str, out: list[ChatDelta]) -> None:
        if self.stray_end:
            self._content(self.stray_end, out)
            self.stray_end = ""
        if piece in (START, CHANNEL):  # <|channel|> alone: the model left out <|start|>assistant
            self._open_header(START if piece == START else "")
            if piece == CHANNEL:
                self._header(piece, out)
        elif piece in ENDS:
            self.stray_end = piece
        else:
            self._content(piece, out)

    def _open_header(self, opener: str) -> None:
        self.state, self.raw, self.before_channel, self.after_channel = "header", opener, "", None

    def _header(self, piece: str, out: list[ChatDelta]) -> None:
        if piece == MESSAGE:
            self._open_body(out)
        elif piece == CHANNEL and self.after_channel is None and could_open_header(self.before_channel + " "):
            self.raw, self.after_channel = self.raw + piece, ""
        elif piece == CONSTRAIN and self.after_channel is not None:
            self.raw, self.after_channel = self.raw + piece, self.after_channel + " "
        elif piece in MARKERS:
            self._not_a_header(out)
            self._outside(piece, out)
        else:
            self.raw += piece
            if self.after_channel is None:
                self.before_channel += piece
                ok = could_open_header(self.before_channel)
            else:
                self.after_channel += piece
                ok = "\n" not in self.after_channel
            if not ok or len(self.raw) > MAX_HEADER:
                self._not_a_header(out)

    def _not_a_header(self, out: list[ChatDelta]) -> None:
        self._content(self.raw, out)
        self.state, self.raw = "outside", ""

    def _open_body(self, out: list[ChatDelta]) -> None:
        """At ``<|message|>``: what the header says the message is."""
        words = (self.after_channel or "").split()
        if not words or words[0] not in CHANNELS:
            self.raw += MESSAGE
            self._not_a_header(out)
            return
        words += self.before_channel.split()
        recipient = next((w[len(RECIPIENT) :] for w in words if w.startswith(RECIPIENT)), None)
        self.state, self.body, self.raw = "body", "", self.raw + MESSAGE
        if recipient is not None:
            self.kind, self.function = "call", recipient
        else:
            self.kind = "reasoning" if words[0] == "analysis" else "content"

    def _body(self, piece: str, out: list[ChatDelta]) -> None:
        if piece in ENDS or piece == START:
            if self.kind == "call":
                self._close_call(out, complete=piece != START)
            self.state, self.raw, self.body = "outside", "", ""
            if piece == START:  # the model left out the end marker
                self._outside(piece, out)
        elif self.kind == "call":
            self.body += piece
        elif self.kind == "reasoning":
            out.append(ChatDelta(reasoning_content=piece))
        else:
            self._content(piece, out)

    def _close_call(self, out: list[ChatDelta], complete: bool) -> None:
        arguments = self._arguments() if complete else None
        if arguments is None:
            self._content(self.raw + self.body, out)
            return
        name = self.function[len(FUNCTIONS) :]
        index, self.num_calls = self.num_calls, self.num_calls + 1
        out.append(ChatDelta(tool_call=ToolCallDelta(index, self.parser.id_factory(), name)))
        out.append(ChatDelta(tool_call=ToolCallDelta(index, arguments=arguments)))

    def _arguments(self) -> str | None:
        """The open call's arguments as compact JSON; None if it is not a call we know."""
        schemas, function = self.parser.schemas, self.function or ""
        name = function[len(FUNCTIONS) :]
        if not function.startswith(FUNCTIONS) or not name or (schemas is not None and name not in schemas):
            return None
        try:
            arguments = json.loads(self.body)
            return dump_arguments(arguments) if isinstance(arguments, dict) else None
        except ValueError:  # not JSON, or NaN/Infinity
            return None

    def _content(self, text: str, out: list[ChatDelta]) -> None:
        if text:
            out.append(ChatDelta(content=text))

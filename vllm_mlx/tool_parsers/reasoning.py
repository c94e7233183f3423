"""Reasoning parser: ``<think>...</think>`` into ``reasoning_content`` and ``content``.

- An output that starts with ``<think>`` (after whitespace) reasons until ``</think>``.
- ``starts_in_reasoning``: the prompt already opened ``<think>`` (DeepSeek-R1, Qwen3 thinking
  templates end the generation prompt with it), so the output starts inside; an opening tag the
  model repeats anyway is skipped.
- With no ``</think>`` (the output was cut short while thinking), everything is reasoning.
- Any other output is all content. The text after ``</think>`` is content, less its leading
  whitespace; reasoning is the text between the tags, as written.

Streaming gives exactly the non-streamed split in any chunking (``extract`` is the stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningResult:
    reasoning_content: str | None
    content: str | None


@dataclass(slots=True)
class ReasoningDelta:
    reasoning_content: str | None = None
    content: str | None = None


def prompt_opens_reasoning(prompt: str) -> bool:
    """True if a rendered prompt ends inside an open ``<think>`` block."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningParser:
    """Splits one kind of reasoning block; ``stream()`` gives one output's incremental parser."""

    def __init__(self, starts_in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.starts_in_reasoning = starts_in_reasoning
        self.start, self.end = start, end

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def extract(self, text: str) -> ReasoningResult:
        stream = self.stream()
        reasoning, content = "", ""
        for delta in [*stream.feed(text), *stream.finish()]:
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
        return ReasoningResult(reasoning or None, content or None)


class ReasoningStream:
    """States: ``opening`` (may still see ``<think>``), ``reasoning``, ``content``."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "opening"
        self.buffer = ""
        self.content_started = False  # leading whitespace after </think> is dropped

    def feed(self, text: str) -> list[ReasoningDelta]:
        self.buffer += text
        out: list[ReasoningDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ReasoningDelta]:
        out: list[ReasoningDelta] = []
        if self.state == "opening":  # the whole output was a prefix of "<think>", or spaces
            self.state = "reasoning" if self.parser.starts_in_reasoning else "content"
            self.content_started = not self.parser.starts_in_reasoning
        self._emit(self.buffer, out)
        self.buffer = ""
        return out

    def _step(self, out: list[ReasoningDelta]) -> bool:
        start, end = self.parser.start, self.parser.end
        if self.state == "opening":
            stripped = self.buffer.lstrip()
            if stripped.startswith(start):
                self.state, self.buffer = "reasoning", stripped[len(start) :]
                return True
            if start.startswith(stripped):  # could still become the opening tag
                return False
            self.state = "reasoning" if self.parser.starts_in_reasoning else "content"
            self.content_started = not self.parser.starts_in_reasoning
            return True
        if self.state == "reasoning":
            pos = self.buffer.find(end)
            if pos >= 0:
                self._emit(self.buffer[:pos], out)
                self.state, self.buffer = "content", self.buffer[pos + len(end) :]
                return True
            keep = held_back(self.buffer, [end])
            self._emit(self.buffer[: len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self._emit(self.buffer, out)
        self.buffer = ""
        return False

    def _emit(self, text: str, out: list[ReasoningDelta]) -> None:
        if self.state == "reasoning":
            if text:
                out.append(ReasoningDelta(reasoning_content=text))
            return
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        if text:
            out.append(ReasoningDelta(content=text))

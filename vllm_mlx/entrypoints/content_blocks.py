"""An assistant turn as ordered content blocks (reasoning, text, tool calls), whole or streamed.

Chat completions give one message with fields; the Anthropic Messages and OpenAI Responses APIs
give a list of blocks. ``blocks_of`` splits a whole message, ``BlockStream`` turns a chat chunk
stream into block starts, deltas and stops. A block opens on its first non-empty delta, so a
streamed turn has the same blocks as the whole one (in the parser's order: reasoning, text, calls).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm_mlx.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    DeltaToolCall,
    StopReason,
    UsageInfo,
)

BlockType = Literal["reasoning", "text", "tool_call"]


@dataclass(slots=True)
class Block:
    """One block of a turn; ``text`` is the reasoning, the text or a call's JSON arguments."""

    type: BlockType
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class BlockEvent:
    kind: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


def blocks_of(message: AssistantMessage) -> list[Block]:
    """The blocks of a whole message; empty reasoning or text make no block."""
    blocks: list[Block] = []
    for kind, text in (("reasoning", message.reasoning_content), ("text", message.content)):
        if text:
            blocks.append(Block(kind, len(blocks), text))
    for call in message.tool_calls or []:
        blocks.append(Block("tool_call", len(blocks), call.function.arguments, call.id, call.function.name))
    return blocks


@dataclass
class BlockStream:
    """The chunks of one choice (``n=1``) -> block events; keeps the finish and the latest usage."""

    blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: StopReason = None
    usage: UsageInfo | None = None
    _open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)

    def feed(self, chunk: ChatCompletionChunk) -> list[BlockEvent]:
        self.usage = chunk.usage or self.usage
        events: list[BlockEvent] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                events += self._text("reasoning", delta.reasoning_content)
            if delta.content:
                events += self._text("text", delta.content)
            for piece in delta.tool_calls or []:
                events += self._call(piece)
            if choice.finish_reason is not None:
                self.finish_reason, self.stop_reason = choice.finish_reason, choice.stop_reason
        return events

    def close(self) -> list[BlockEvent]:
        """Stop the open block (at the end of the stream)."""
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block)]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("start", block)]

    def _text(self, kind: BlockType, text: str) -> list[BlockEvent]:
        events = [] if self._open is not None and self._open.type == kind else self._start(Block(kind, len(self.blocks)))
        self._open.text += text
        return [*events, BlockEvent("delta", self._open, text)]

    def _call(self, piece: DeltaToolCall) -> list[BlockEvent]:
        """A call's first piece has its id and name (a block of its own); later ones add arguments."""
        events: list[BlockEvent] = []
        if piece.index not in self._calls:
            block = Block("tool_call", len(self.blocks), call_id=piece.id, name=piece.function.name)
            self._calls[piece.index] = block
            events = self._start(block)
        block = self._calls[piece.index]
        if piece.function.arguments:
            block.text += piece.function.arguments
            events.append(BlockEvent("delta", block, piece.function.arguments))
        return events

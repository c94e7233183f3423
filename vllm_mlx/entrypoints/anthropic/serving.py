"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, translated.

A Messages request becomes a ``ChatCompletionRequest`` run by ``ChatServing.generate``, so tools,
reasoning, images, constraints, limits, metrics, disconnects and the cache behave as on chat
completions; the answer is translated back. Block by block:

- ``system`` -> a system message; ``text``/``image`` blocks -> content parts (a base64 image is
  a ``data:`` URL; a URL source follows the server's media policy); an assistant's ``tool_use``
  -> ``tool_calls``; a user's ``tool_result`` -> a ``tool`` message; ``thinking`` is dropped.
- ``tool_choice`` ``auto``/``any``/``tool``/``none`` -> ``auto``/``required``/named/``none``.
- The answer: reasoning -> ``thinking``, content -> ``text``, calls -> ``tool_use`` blocks;
  the engine's matched stop string gives ``stop_sequence``. A forced call cut by ``max_tokens``
  is a ``tool_use`` with ``input: {}`` and ``stop_reason: "max_tokens"`` (as Anthropic answers;
  streamed, its ``partial_json`` deltas are what was written).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import ValidationError

from vllm_mlx.engine.input_processor import PreparedPrompt
from vllm_mlx.entrypoints.anthropic.protocol import (
    ContentBlock,
    CountTokensResponse,
    ImageBlock,
    Message,
    MessagesInput,
    MessagesRequest,
    MessagesResponse,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolChoice,
    ToolResultBlock,
    ToolUseContent,
    Usage,
    error_body,
)
from vllm_mlx.entrypoints.content_blocks import Block, BlockEvent, BlockStream, blocks_of
from vllm_mlx.entrypoints.openai.protocol import ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse
from vllm_mlx.entrypoints.openai.serving import OpenAIError, named_sse, new_id
from vllm_mlx.entrypoints.openai.serving_chat import ChatServing


class AnthropicServing:
    """The Messages API over the chat server's ``generate``."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, raw_request=None) -> MessagesResponse | AsyncIterator[str]:
        """A message, or (``stream=True``) its server-sent events."""
        message_id = new_id("msg").replace("-", "_")
        result = await self.chat.generate(chat_request(req), raw_request, request_id=message_id)
        if isinstance(result, ChatCompletionResponse):
            return self._message(result, message_id)
        return self._events(result, message_id)

    async def count_tokens(self, req: MessagesInput) -> CountTokensResponse:
        """The prompt's token count, rendered exactly as ``create`` would (tools, images)."""
        _, prompt = await self.chat.render(chat_request(req))
        token_ids = prompt.token_ids if isinstance(prompt, PreparedPrompt) else prompt
        return CountTokensResponse(input_tokens=len(token_ids))

    def _message(self, response: ChatCompletionResponse, message_id: str) -> MessagesResponse:
        choice = response.choices[0]
        content = [content_block(b) for b in blocks_of(choice.message)]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(choice.message.tool_calls))
        usage = Usage(input_tokens=response.usage.prompt_tokens, output_tokens=response.usage.completion_tokens)
        return MessagesResponse(
            id=message_id, model=response.model, content=content, stop_reason=reason, stop_sequence=sequence, usage=usage
        )

    async def _events(self, chunks: AsyncIterator[ChatCompletionChunk], message_id: str) -> AsyncIterator[str]:
        """Anthropic's event stream; an error after it started is an ``error`` event."""
        stream = BlockStream()
        try:
            async for chunk in chunks:
                events = stream.feed(chunk)
                if chunk.choices and chunk.choices[0].delta.role:  # the first chunk
                    yield self._message_start(message_id, stream, chunk.model)
                for event in events:
                    yield block_event(event)
            for event in stream.close():
                yield block_event(event)
            yield self._message_end(stream)
        except OpenAIError as exc:
            yield named_sse("error", error_body(exc.status, exc.message))
        finally:
            await chunks.aclose()

    def _message_start(self, message_id: str, stream: BlockStream, model: str) -> str:
        usage = Usage(input_tokens=stream.usage.prompt_tokens if stream.usage else 0, output_tokens=0)
        message = MessagesResponse(id=message_id, model=model, content=[], stop_reason=None, usage=usage)
        return named_sse("message_start", {"type": "message_start", "message": message.model_dump()})

    @staticmethod
    def _message_end(stream: BlockStream) -> str:
        has_calls = any(b.type == "tool_call" for b in stream.blocks)
        reason, sequence = stop_reason(stream.finish_reason, stream.stop_reason, has_calls)
        usage = stream.usage
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens} if usage else {},
        }
        return named_sse("message_delta", delta) + named_sse("message_stop", {"type": "message_stop"})


# -- the request ------------------------------------------------------------------------------


def chat_request(req: MessagesInput) -> ChatCompletionRequest:
    """The chat completion that answers ``req`` (streamed with usage on every chunk)."""
    fields: dict = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        fields["tools"] = [_function_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(req.tool_choice)
        fields["parallel_tool_calls"] = not req.tool_choice.disable_parallel_tool_use
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, stream=req.stream, structured_outputs=req.structured_outputs,
        )  # fmt: skip
        if req.stream:
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if (schema := req.json_schema()) is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # e.g. a string that is not valid Unicode
        error = exc.errors()[0]
        where = ".".join(str(x) for x in error.get("loc", ())) or "body"
        raise OpenAIError(400, f"Invalid request: {where}: {error.get('msg', 'invalid')}") from None


def chat_messages(req: MessagesInput) -> list[dict]:
    system = req.system if isinstance(req.system, str) or req.system is None else _joined(req.system)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for message in req.messages:
        messages += _user_messages(message) if message.role == "user" else [_assistant_message(message)]
    return messages


def _user_messages(message: Message) -> list[dict]:
    """A user turn: its ``tool_result`` blocks become ``tool`` messages, the rest user messages."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict] = []
    parts: list[dict] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_message(block))
        elif block.type == "tool_use":
            raise OpenAIError(400, "A tool_use block belongs in an assistant message.", param="messages")
        elif block.type != "thinking" and block.type != "redacted_thinking":
            parts.append(_content_part(block))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(message: Message) -> dict:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, calls = [], []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type in ("image", "tool_result"):
            raise OpenAIError(400, f"An assistant message cannot hold a {block.type} block.", param="messages")
    return {"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls or None}


def _tool_message(block: ToolResultBlock) -> dict:
    text = block.content if isinstance(block.content, str) else _joined(block.content)
    # Chat templates have no error flag for a tool's result: say it in the text.
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": f"Error: {text}" if block.is_error else text}


def _content_part(block) -> dict:
    if not isinstance(block, ImageBlock):
        return {"type": "text", "text": block.text}
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _joined(blocks) -> str:
    return "\n".join(block.text for block in blocks)


def _function_tool(tool) -> dict:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError(400, "tool_choice of type 'tool' needs the tool's name.", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# -- the answer -------------------------------------------------------------------------------


def stop_reason(finish: str | None, matched: str | int | None, has_calls: bool) -> tuple[StopReason | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's ending."""
    if finish is None:
        return None, None
    if finish == "length":
        return "max_tokens", None
    if has_calls:  # a forced named call ends with "stop" on chat completions
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def content_block(block: Block) -> ContentBlock:
    if block.type == "reasoning":
        return ThinkingContent(thinking=block.text)
    if block.type == "text":
        return TextContent(text=block.text)
    return ToolUseContent(id=block.call_id, name=block.name, input=tool_input(block.text))


def tool_input(arguments: str) -> dict:
    """A call's JSON arguments as a ``tool_use`` input: ``{}`` for arguments cut short."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def block_event(event: BlockEvent) -> str:
    """One block event as Anthropic's ``content_block_start/delta/stop``."""
    block = event.block
    if event.kind == "stop":
        return named_sse("content_block_stop", {"type": "content_block_stop", "index": block.index})
    if event.kind == "start":
        started = content_block(Block(block.type, block.index, "", block.call_id, block.name))
        return named_sse("content_block_start", {"type": "content_block_start", "index": block.index, "content_block": started.model_dump()})
    delta = {
        "reasoning": {"type": "thinking_delta", "thinking": event.delta},
        "text": {"type": "text_delta", "text": event.delta},
        "tool_call": {"type": "input_json_delta", "partial_json": event.delta},
    }[block.type]
    return named_sse("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})

"""``POST /v1/responses``: OpenAI's Responses API, translated to chat completions.

A Responses request becomes a ``ChatCompletionRequest`` run by ``ChatServing.generate`` (tools,
reasoning, images, constraints, limits, metrics and disconnects as on chat completions); its
answer comes back as output items: a ``reasoning`` item, a ``message`` with ``output_text``,
then one ``function_call`` per call. Streaming sends the typed events (``response.created``,
``response.output_item.added``, ``...delta``, ``...done``, ``response.completed`` or
``response.incomplete``), each with a ``sequence_number``.

Stateless: ``previous_response_id`` is refused (the client sends the whole conversation).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from pydantic import ValidationError

from vllm_mlx.entrypoints.content_blocks import Block, BlockEvent, BlockStream, blocks_of
from vllm_mlx.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    UsageInfo,
)
from vllm_mlx.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputImage,
    MessageItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from vllm_mlx.entrypoints.openai.serving import OpenAIError, named_sse, new_id
from vllm_mlx.entrypoints.openai.serving_chat import ChatServing

NO_STATE = (
    "previous_response_id is not supported: this server keeps no conversation state. "
    "Send the whole conversation in `input` (earlier output items included)."
)

ITEM_ID_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


class ResponsesServing:
    """The Responses API over the chat server's ``generate``."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: ResponsesRequest, raw_request=None) -> ResponseObject | AsyncIterator[str]:
        """A response, or (``stream=True``) its server-sent events."""
        shell = self._shell(req)
        result = await self.chat.generate(chat_request(req), raw_request, request_id=shell.id)
        if isinstance(result, ChatCompletionResponse):
            choice = result.choices[0]
            return finished(shell, blocks_of(choice.message), choice.finish_reason, result.usage)
        return _Events(shell).run(result)

    def _shell(self, req: ResponsesRequest) -> ResponseObject:
        """The response before any output: the request's settings echoed."""
        return ResponseObject(
            id=new_id("resp").replace("-", "_"), model=self.chat.served_name(req.model), instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []], tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls, text={"format": _format_echo(req)},
        )  # fmt: skip


def _format_echo(req: ResponsesRequest) -> dict:
    if req.text is None or req.text.format is None:
        return {"type": "text"}
    return req.text.format.model_dump(by_alias=True, exclude_none=True)


def finished(shell: ResponseObject, blocks: list[Block], finish: str | None, usage: UsageInfo | None) -> ResponseObject:
    """The completed (or, cut by ``max_output_tokens``, incomplete) response."""
    cut = finish == "length"
    return shell.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "output": [output_item(shell.id, b, cut=cut and b is blocks[-1]) for b in blocks],
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "usage": _usage(usage) if usage else None,
        }
    )


def output_item(response_id: str, block: Block, done: bool = True, cut: bool = False) -> OutputItem:
    """The item of ``block``; ``done=False``: as first announced (empty, in progress); ``cut``:
    the item ``max_output_tokens`` ended (``incomplete``: a call's arguments may be partial JSON)."""
    item_id = f"{ITEM_ID_PREFIX[block.type]}_{response_id.removeprefix('resp_')}_{block.index}"
    text = block.text if done else ""
    status = ("incomplete" if cut else "completed") if done else "in_progress"
    if block.type == "reasoning":
        return ReasoningItem(id=item_id, content=[ReasoningText(text=text)] if done else [])
    if block.type == "text":
        return OutputMessage(id=item_id, content=[OutputText(text=text)] if done else [], status=status)
    return FunctionCallOutput(id=item_id, call_id=block.call_id, name=block.name, arguments=text, status=status)


def _usage(usage: UsageInfo) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
    )


class _Events:
    """One response's event stream: block events -> the Responses API's typed events."""

    def __init__(self, shell: ResponseObject) -> None:
        self.shell = shell
        self.sequence = itertools.count()
        self.cut = False
        """The output ended at ``max_output_tokens``: the block closed last is incomplete."""

    def event(self, kind: str, **fields) -> str:
        return named_sse(kind, {"type": kind, "sequence_number": next(self.sequence), **fields})

    async def run(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
        stream = BlockStream()
        try:
            yield self.event("response.created", response=self.shell.model_dump(mode="json"))
            yield self.event("response.in_progress", response=self.shell.model_dump(mode="json"))
            async for chunk in chunks:
                for event in stream.feed(chunk):
                    for line in self.block_event(event):
                        yield line
            self.cut = stream.finish_reason == "length"
            for event in stream.close():
                for line in self.block_event(event):
                    yield line
            final = finished(self.shell, stream.blocks, stream.finish_reason, stream.usage)
            kind = "response.completed" if final.status == "completed" else "response.incomplete"
            yield self.event(kind, response=final.model_dump(mode="json"))
        except OpenAIError as exc:
            yield self.event("error", code=exc.code, message=exc.message, param=exc.param)
        finally:
            await chunks.aclose()

    def block_event(self, event: BlockEvent) -> list[str]:
        block = event.block
        where = {"item_id": output_item(self.shell.id, block).id, "output_index": block.index}
        part = {"reasoning": ReasoningText, "text": OutputText}.get(block.type)
        if event.kind == "start":
            item = output_item(self.shell.id, block, done=False).model_dump(mode="json")
            lines = [self.event("response.output_item.added", output_index=block.index, item=item)]
            if part is not None:
                lines.append(self.event("response.content_part.added", **where, content_index=0, part=part().model_dump()))
            return lines
        if event.kind == "delta":
            if block.type == "tool_call":
                return [self.event("response.function_call_arguments.delta", **where, delta=event.delta)]
            kind = "response.output_text.delta" if block.type == "text" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if block.type == "text" else {}
            return [self.event(kind, **where, content_index=0, delta=event.delta, **extra)]
        return self._block_done(block, where, part)

    def _block_done(self, block: Block, where: dict, part) -> list[str]:
        if block.type == "tool_call":
            lines = [self.event("response.function_call_arguments.done", **where, name=block.name, arguments=block.text)]
        else:
            kind = "response.output_text.done" if block.type == "text" else "response.reasoning_text.done"
            extra = {"logprobs": []} if block.type == "text" else {}
            lines = [
                self.event(kind, **where, content_index=0, text=block.text, **extra),
                self.event("response.content_part.done", **where, content_index=0, part=part(text=block.text).model_dump()),
            ]
        item = output_item(self.shell.id, block, cut=self.cut).model_dump(mode="json")
        return [*lines, self.event("response.output_item.done", output_index=block.index, item=item)]


# -- the request ------------------------------------------------------------------------------


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``req``."""
    if req.previous_response_id is not None:
        raise OpenAIError(400, NO_STATE, param="previous_response_id", code="unsupported_parameter")
    fields: dict = {
        "model": req.model, "messages": chat_messages(req), "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls, "structured_outputs": req.structured_outputs,
    }  # fmt: skip
    if req.tools:
        fields["tools"] = [_function_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.text is not None and req.text.format is not None:
        fields["response_format"] = _response_format(req.text.format)
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # e.g. a string that is not valid Unicode
        error = exc.errors()[0]
        raise OpenAIError(400, f"Invalid request: {error.get('msg', 'invalid')}", param="input") from None


def chat_messages(req: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _add_call(messages: list[dict], item: FunctionCallItem) -> None:
    """Calls join the assistant turn just before them (its text and its other calls)."""
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last["tool_calls"] = [*(last.get("tool_calls") or []), call]


def _content(content) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [_part(p) for p in content]


def _part(part) -> dict:
    if not isinstance(part, InputImage):
        return {"type": "text", "text": part.text}
    if not part.image_url:
        raise OpenAIError(400, "input_image needs an image_url (file ids are not supported).", param="input")
    return {"type": "image_url", "image_url": {"url": part.image_url}}


def _function_tool(tool) -> dict:
    function = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(
        400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.", param="tool_choice"
    )


def _response_format(fmt) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

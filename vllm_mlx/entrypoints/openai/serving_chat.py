"""``POST /v1/chat/completions``: messages -> chat template -> engine -> OpenAI's chat shapes.

One engine request per HTTP request; ``n`` choices come back in one ``RequestOutput``
(``outputs[i]``). Each choice's text goes through the request's ``ChatOutputParser``
(``tool_parsers.chat_output``): ``<think>`` reasoning into ``reasoning_content``, tool calls into
``tool_calls``; a forced ``tool_choice`` is a constraint on the output. A format whose markers
are special tokens (Harmony, Mistral's ``[TOOL_CALLS]``) needs them decoded: such requests decode
special tokens unless the client set ``skip_special_tokens`` (the stop token that ended an output
is never part of its text: the engine leaves it out). Streaming sends, per
choice, a first chunk with the role, then the parsed deltas of each new piece of text (content,
reasoning or a tool call's name and arguments), the finish reason once, an optional usage chunk
(``stream_options.include_usage``) and ``data: [DONE]``.

``generate`` returns response models (a ``ChatCompletionResponse``, or an async iterator of
``ChatCompletionChunk``): the Anthropic and Responses APIs translate those.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vllm_mlx.core.request import CompletionOutput
from vllm_mlx.engine.chat import ChatPrompt, split_chat_images, template_text, tool_parser_for
from vllm_mlx.engine.input_processor import PreparedPrompt
from vllm_mlx.engine.template_guard import TemplateOverrun
from vllm_mlx.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallInfo,
    TopLogprob,
)
from vllm_mlx.entrypoints.openai.serving import (
    OpenAIError,
    OpenAIServing,
    check_prompt_logprobs,
    new_id,
    sse,
    sse_error,
    top_entries,
)
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.tool_parsers.chat_output import (
    ChatDelta,
    ChatOutputParser,
    ChatOutputStream,
    ChatResult,
    ToolPlan,
    plan_chat_output,
)
from vllm_mlx.tool_parsers.harmony import HarmonyStream


class ChatServing(OpenAIServing):
    """Chat completions; images are loaded under ``media_policy`` (default: ``MediaPolicy.server()``,
    no local files and no URLs), never the engine's own policy."""

    def __init__(self, *args, media_policy: MediaPolicy | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.media_policy = media_policy or MediaPolicy.server()

    async def create(self, req: ChatCompletionRequest, raw_request=None) -> ChatCompletionResponse | AsyncIterator[str]:
        """A response model, or (``stream=True``) an async iterator of SSE lines."""
        result = await self.generate(req, raw_request)
        return result if isinstance(result, ChatCompletionResponse) else _sse_lines(result)

    async def generate(
        self, req: ChatCompletionRequest, raw_request=None, request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        """Run one chat request: the response, or (``stream=True``) its chunks. Errors before
        the first output raise ``OpenAIError``; the chunk iterator raises it for later ones.
        ``request_id``: the engine's id for it, which must be the id its client sees (the
        Anthropic and Responses APIs give theirs; ``/v1/cache/blocks`` finds requests by it);
        None = a new ``chatcmpl-...``."""
        plan, prompt = await self.render(req)
        token_ids = prompt.token_ids if isinstance(prompt, PreparedPrompt) else prompt
        parser = self._output_parser(plan, token_ids)
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, len(token_ids), top_k, plan.constraint)
        if parser.needs_special_tokens and "skip_special_tokens" not in req.model_fields_set:
            params = params.clone(skip_special_tokens=False)
        constraint = await self.compile_constraint(params, req)
        request_id = request_id or new_id("chatcmpl")
        lora = self.check_model(req.model)
        streams = self.submit([prompt], [params], request_id, req.cache_salt, constraint, lora)
        if req.stream:
            first, rest = await self.first_output(streams, raw_request)
            return self._chunks(req, request_id, top_k, parser, first, rest)
        [final] = await self.collect(streams, raw_request)
        choices = [self._choice(c, parser, top_k) for c in final.outputs]
        model = self.served_name(req.model)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage([final]))

    async def render(self, req: ChatCompletionRequest) -> tuple[ToolPlan, list[int] | PreparedPrompt]:
        """The request's tool plan and its prompt exactly as the engine gets it (template with
        the tools, images loaded), checked against the context limit; nothing is generated."""
        self.check_model(req.model)
        _check_supported(req)
        plan = _tool_plan(req)
        chat = self._split_images(req)
        token_ids = await self.run_tokenizer(
            self._apply_template, chat.messages, req.add_generation_prompt, plan.template_tools,
            chars=_text_chars(chat.messages),
        )  # fmt: skip
        prompt = await self._with_images(token_ids, chat.images) if chat.images else token_ids
        self.check_prompt(prompt.token_ids if isinstance(prompt, PreparedPrompt) else prompt, param="messages")
        return plan, prompt

    def _choice(self, c: CompletionOutput, parser: ChatOutputParser, top_k: int | None) -> ChatChoice:
        result = parser.extract(c.text) if parser.parses_anything else ChatResult(c.text)
        calls = [
            ToolCallInfo(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in result.tool_calls
        ]
        message = AssistantMessage(
            content=result.content if result.content or calls else "",
            reasoning_content=result.reasoning_content,
            tool_calls=calls or None,
        )
        finish = parser.finish_reason(c.finish_reason, len(calls))
        logprobs = self._logprobs(c, 0, top_k)
        return ChatChoice(index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason, logprobs=logprobs)

    def _output_parser(self, plan: ToolPlan, token_ids: list[int]) -> ChatOutputParser:
        template = getattr(self.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else str(template or "")
        try:
            tail = self.tokenizer.decode(token_ids[-16:])
            parser_name = tool_parser_for(self.tokenizer, self.options.tool_call_parser) if plan.template_tools else None
            return plan_chat_output(
                plan, template, tail, parser_name or self.options.tool_call_parser,
                constraints_follow_reasoning=self.info.thinks,
            )  # fmt: skip
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="tool_choice") from None

    def _split_images(self, req: ChatCompletionRequest) -> ChatPrompt:
        """The messages for the template and the images of their ``image_url`` parts."""
        try:
            chat = split_chat_images([m.model_dump(exclude_none=True) for m in req.messages])
        except ValueError as exc:  # e.g. an image_url part without a url
            raise OpenAIError(400, str(exc), param="messages") from None
        try:
            self.engine.check_images(chat.images)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages", code="unsupported_content") from None
        return chat

    async def _with_images(self, token_ids: list[int], images: list) -> PreparedPrompt:
        """Load and preprocess the images off the event loop (a URL fetch may take seconds)."""
        try:
            prepared = await asyncio.to_thread(
                self.engine.prepare_prompt, token_ids, images, media_policy=self.media_policy
            )
        except ValueError as exc:  # e.g. placeholders the template wrote vs images sent
            raise OpenAIError(400, str(exc), param="messages") from None
        if prepared.error is not None:
            raise OpenAIError(400, f"Invalid image: {prepared.error}", param="messages", code="invalid_image")
        return prepared

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        """The prompt's token ids; a rendered prompt too long to fit is refused untokenized."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "This model has no chat template; use /v1/completions.", param="messages")
        try:
            text = template_text(self.tokenizer, messages, add_generation_prompt, tools)
        except TemplateOverrun as exc:  # the template ran out of time or memory on these messages
            message = f"The chat template could not render the messages: {exc}"
            raise OpenAIError(400, message, param="messages") from None
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise OpenAIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
        self.check_text_fits(text, param="messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _chunks(self, req, request_id, top_k, parser, first, rest) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())
        choices = [_StreamedChoice(i, parser.stream()) for i in range(req.n)]

        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def chunk(choices, usage=None, output=None) -> ChatCompletionChunk:
            if usage is None and continuous and output is not None:
                usage = self.usage([output])
            return ChatCompletionChunk(id=request_id, created=created, model=self.served_name(req.model), choices=choices, usage=usage)

        try:
            roles = [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(req.n)]
            yield chunk(roles, output=first[1])
            item, final = first, None
            while item is not None:
                output = item[1]
                for c in output.outputs:
                    state = choices[c.index]
                    logprobs = self._logprobs(c, state.sent_tokens, top_k)
                    for piece in state.advance(c, parser, logprobs):
                        yield chunk([piece], output=output)
                final = output if output.finished else final
                item = await anext(rest, None)
            if req.stream_options and req.stream_options.include_usage and final is not None:
                yield chunk([], usage=self.usage([final]))
        finally:
            await rest.aclose()

    def _logprobs(self, c: CompletionOutput, start: int, top_k: int | None) -> ChatLogprobs | None:
        if top_k is None or c.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = self.token_text(token_id)
            tops = [_top(self.token_text(i), lp) for i, lp in top_entries(entry, top_k)]
            content.append(ChatLogprob(**_top(text, entry[token_id]).model_dump(), top_logprobs=tops))
        return ChatLogprobs(content=content)


@dataclass
class _StreamedChoice:
    """What one streamed choice has sent so far, and its parser."""

    index: int
    parser: ChatOutputStream | HarmonyStream
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput, parser: ChatOutputParser, logprobs: ChatLogprobs | None) -> list[ChatChunkChoice]:
        """The chunks for ``c``'s new text: one per parsed delta, the logprobs on the first, the
        finish reason on the last."""
        text = c.text[self.sent_chars :]
        self.sent_chars, self.sent_tokens = len(c.text), len(c.token_ids)
        deltas = self.parser.feed(text) if text else []
        finished = c.finish_reason is not None and not self.done
        if finished:
            deltas += self.parser.finish()
        self.done = self.done or finished
        pieces = [ChatChunkChoice(index=self.index, delta=_delta_message(d)) for d in deltas]
        if not pieces and (finished or (logprobs and logprobs.content)):
            pieces.append(ChatChunkChoice(index=self.index, delta=DeltaMessage()))
        if pieces:
            pieces[0].logprobs = logprobs
        if finished:
            pieces[-1].finish_reason = parser.finish_reason(c.finish_reason, self.parser.num_calls)
            pieces[-1].stop_reason = c.stop_reason
        return pieces


def _delta_message(delta: ChatDelta) -> DeltaMessage:
    call = delta.tool_call
    if call is None:
        return DeltaMessage(content=delta.content, reasoning_content=delta.reasoning_content)
    piece = DeltaToolCall(
        index=call.index, id=call.id, type="function" if call.id else None,
        function=DeltaFunction(name=call.name, arguments=call.arguments),
    )  # fmt: skip
    return DeltaMessage(tool_calls=[piece])


async def _sse_lines(chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
    """Chunks as server-sent events; an error after the stream started is an error event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except OpenAIError as exc:
        yield sse_error(exc)
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"


def _text_chars(messages: list[dict]) -> int:
    """The length of the messages' text (the template adds little): how long tokenizing takes."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return total


def _tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    try:
        return ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ValueError as exc:
        param = "tool_choice" if "tool_choice" in str(exc) else "tools"
        raise OpenAIError(400, str(exc), param=param) from None


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8")))


def _check_supported(req: ChatCompletionRequest) -> None:
    check_prompt_logprobs(req)
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs: true.", param="top_logprobs")

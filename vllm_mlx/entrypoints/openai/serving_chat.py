"""``POST /v1/chat/completions``: messages -> chat template -> engine -> OpenAI's chat shapes.

One engine request per HTTP request; ``n`` choices come back in one ``RequestOutput``
(``outputs[i]``). Streaming sends, per choice, a first chunk with the role, then content
deltas (each choice's text diffed against what was sent for it), the finish reason once, an
optional usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from vllm_mlx.chat import ChatPrompt, split_chat_images, template_token_ids
from vllm_mlx.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    DeltaMessage,
    TopLogprob,
)
from vllm_mlx.entrypoints.openai.serving import (
    OpenAIError,
    OpenAIServing,
    new_id,
    sse,
    sse_error,
    top_entries,
)
from vllm_mlx.input_processor import PreparedPrompt
from vllm_mlx.media_policy import MediaPolicy
from vllm_mlx.request import CompletionOutput


class ChatServing(OpenAIServing):
    """Chat completions; images are loaded under ``media_policy`` (default: ``MediaPolicy.server()``,
    no local files and no URLs), never the engine's own policy."""

    def __init__(self, *args, media_policy: MediaPolicy | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.media_policy = media_policy or MediaPolicy.server()

    async def create(self, req: ChatCompletionRequest, raw_request=None) -> ChatCompletionResponse | AsyncIterator[str]:
        """A response model, or (``stream=True``) an async iterator of SSE lines."""
        self.check_model(req.model)
        _check_supported(req)
        chat = self._split_images(req)
        token_ids = await self.run_tokenizer(self._apply_template, chat.messages, req.add_generation_prompt)
        prompt = await self._with_images(token_ids, chat.images) if chat.images else token_ids
        if isinstance(prompt, PreparedPrompt):
            token_ids = prompt.token_ids
        self.check_prompt(token_ids, param="messages")
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, len(token_ids), top_k)
        constraint = await self.compile_constraint(params, req)
        request_id = new_id("chatcmpl")
        streams = self.submit([prompt], [params], request_id, req.cache_salt, constraint)
        if req.stream:
            first, rest = await self.first_output(streams, raw_request)
            return self._stream(req, request_id, top_k, first, rest)
        [final] = await self.collect(streams, raw_request)
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(c, 0, top_k),
            )
            for c in final.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=self.usage([final]))

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

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "This model has no chat template; use /v1/completions.", param="messages")
        try:
            return template_token_ids(self.tokenizer, messages, add_generation_prompt)
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise OpenAIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None

    async def _stream(self, req, request_id, top_k, first, rest) -> AsyncIterator[str]:
        created = int(time.time())
        n = req.n
        sent_chars, sent_tokens, done = [0] * n, [0] * n, [False] * n

        def chunk(choices, usage=None) -> str:
            return sse(
                ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)
            )

        try:
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)])
            item, final = first, None
            while item is not None:
                output = item[1]
                for c in output.outputs:
                    i = c.index
                    delta, lp = c.text[sent_chars[i] :], self._logprobs(c, sent_tokens[i], top_k)
                    sent_chars[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    finish = c.finish_reason if not done[i] else None
                    done[i] = done[i] or finish is not None
                    if delta or finish or (lp and lp.content):
                        choice = ChatChunkChoice(
                            index=i, delta=DeltaMessage(content=delta), logprobs=lp, finish_reason=finish
                        )
                        yield chunk([choice])
                final = output if output.finished else final
                item = await anext(rest, None)
            if req.stream_options and req.stream_options.include_usage and final is not None:
                yield chunk([], usage=self.usage([final]))
        except OpenAIError as exc:
            yield sse_error(exc)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, start: int, top_k: int | None) -> ChatLogprobs | None:
        if top_k is None or c.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = self.token_text(token_id)
            tops = [_top(self.token_text(i), lp) for i, lp in top_entries(entry, top_k)]
            content.append(ChatLogprob(**_top(text, entry[token_id]).model_dump(), top_logprobs=tops))
        return ChatLogprobs(content=content)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8")))


def _check_supported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise OpenAIError(400, "Tool calling is not supported by this server.", param="tools")
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs: true.", param="top_logprobs")

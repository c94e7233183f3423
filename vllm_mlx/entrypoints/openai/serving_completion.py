"""``POST /v1/completions``: a prompt (text, token ids, or a batch of either) -> OpenAI's
legacy completion shapes.

Each prompt of a batch is its own engine request (they run together in the continuous batch);
choice ``index = prompt_index * n + i``. ``logprobs: k`` gives the legacy shape: ``tokens``,
``token_logprobs``, ``top_logprobs`` (the sampled token plus the ``k`` most likely) and
``text_offset`` (character offsets of the tokens in the generated text).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from vllm_mlx.core.request import CompletionOutput
from vllm_mlx.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from vllm_mlx.entrypoints.openai.serving import (
    OpenAIError,
    OpenAIServing,
    check_prompt_logprobs,
    new_id,
    sse,
    sse_error,
)


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request=None) -> CompletionResponse | AsyncIterator[str]:
        """A response model, or (``stream=True``) an async iterator of SSE lines."""
        lora = self.check_model(req.model)
        _check_supported(req)
        prompts = await self._prompts(req.prompt)
        for prompt in prompts:
            self.check_prompt(prompt)
        params = [self.sampling_params(req, req.max_tokens, len(p), req.logprobs) for p in prompts]
        constraint = await self.compile_constraint(params[0], req)  # the prompts share one constraint
        request_id = new_id("cmpl")
        streams = self.submit(prompts, params, request_id, req.cache_salt, constraint, lora)
        if req.stream:
            first, rest = await self.first_output(streams, raw_request)
            return self._stream(req, request_id, first, rest)
        finals = await self.collect(streams, raw_request)
        choices = [
            CompletionChoice(
                index=p * req.n + c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=self._logprobs(c, 0, 0, req.logprobs),
            )
            for p, final in enumerate(finals)
            for c in final.outputs
        ]
        return CompletionResponse(id=request_id, model=self.served_name(req.model), choices=choices, usage=self.usage(finals))

    async def _prompts(self, prompt) -> list[list[int]]:
        """Token ids of each prompt: a str, a list of str, a list of ids, a list of id lists."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "The prompt is empty.", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        self.check_num_prompts(len(prompt))
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        for i, text in enumerate(prompt):
            self.check_text_fits(text, param="prompt" if len(prompt) == 1 else f"prompt.{i}")
        return await self.run_tokenizer(
            lambda texts: [list(self.tokenizer.encode(t, add_special_tokens=True)) for t in texts],
            prompt,
            chars=sum(map(len, prompt)),
        )

    async def _stream(self, req, request_id, first, rest) -> AsyncIterator[str]:
        created, n = int(time.time()), req.n
        sent: dict[int, list[int]] = {}  # choice index -> [chars sent, tokens sent, text offset]
        done: set[int] = set()
        finals = {}
        try:
            item = first
            while item is not None:
                p, output = item
                for c in output.outputs:
                    index = p * n + c.index
                    chars, tokens, offset = sent.setdefault(index, [0, 0, 0])
                    delta, lp = c.text[chars:], self._logprobs(c, tokens, offset, req.logprobs)
                    finish = c.finish_reason if index not in done else None
                    sent[index] = [
                        len(c.text),
                        len(c.token_ids),
                        offset + sum(len(t) for t in (lp.tokens if lp else [])),
                    ]
                    if finish:
                        done.add(index)
                    if delta or finish or (lp and lp.tokens):
                        choice = CompletionChoice(index=index, text=delta, logprobs=lp, finish_reason=finish)
                        yield sse(
                            CompletionResponse(id=request_id, created=created, model=self.served_name(req.model), choices=[choice])
                        )
                if output.finished:
                    finals[p] = output
                item = await anext(rest, None)
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage([finals[p] for p in sorted(finals)])
                yield sse(
                    CompletionResponse(id=request_id, created=created, model=self.served_name(req.model), choices=[], usage=usage)
                )
        except OpenAIError as exc:
            yield sse_error(exc)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"

    def _logprobs(self, c: CompletionOutput, start: int, offset: int, k: int | None) -> CompletionLogprobs | None:
        if k is None or c.logprobs is None:
            return None
        out = CompletionLogprobs()
        for token_id, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(max(entry[token_id], -9999.0))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])  # the sampled token + the top k
            out.top_logprobs.append({self.token_text(i): max(lp, -9999.0) for i, lp in ranked})
            out.text_offset.append(offset)
            offset += len(text)
        return out


def _check_supported(req: CompletionRequest) -> None:
    check_prompt_logprobs(req)
    for name, unsupported in (
        ("echo", req.echo),
        ("suffix", req.suffix is not None),
        ("best_of", req.best_of not in (None, req.n)),
    ):
        if unsupported:
            raise OpenAIError(400, f"{name} is not supported by this server.", param=name)

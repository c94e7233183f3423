"""Translation between OpenAI requests and the engine: the part chat and completions share.

``OpenAIServing`` holds one ``AsyncEngineCore`` and what the server needs to know about its
model (tokenizer, context limit, vocabulary), read once at startup through ``engine.call``: the
server never reaches into the scheduler or the cache. It turns requests into token ids and
``SamplingParams`` (every bad value is an ``OpenAIError`` with a status), submits them, and
iterates their outputs as one merged stream, watching for the client going away: leaving the
iteration (a disconnect, an error, a cancelled task) aborts every engine request it started,
which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace
from functools import lru_cache

from pydantic import BaseModel

from vllm_mlx.config import ServingOptions  # noqa: F401 (re-exported: the server's options, declared in config)
from vllm_mlx.core.request import RequestOutput, SamplingParams
from vllm_mlx.distributed.watchdog import RankLostError
from vllm_mlx.engine.async_engine import AsyncEngineCore, EngineDeadError, RequestStream
from vllm_mlx.engine.input_processor import PreparedPrompt
from vllm_mlx.engine.token_bound import TokenBound, token_bound
from vllm_mlx.entrypoints.openai.metrics import ServerMetrics
from vllm_mlx.entrypoints.openai.protocol import CompletionTokensDetails, PromptTokensDetails, SamplingFields, UsageInfo
from vllm_mlx.entrypoints.openai.tokenize_pool import TokenizePool
from vllm_mlx.lora.request import LoRARequest
from vllm_mlx.platform.validation import LimitExceeded
from vllm_mlx.structured.grammar import CompiledGrammar, ConstraintError, ConstraintTooLarge
from vllm_mlx.structured.matcher import ERROR_PREFIX as CONSTRAINT_ERROR_PREFIX
from vllm_mlx.structured.params import StructuredOutputsParams

DISCONNECT_POLL_S = 0.25
DEFAULT_MODEL_ALIAS = "default"
"""Another name of the served base model (the CLI's and the docs' name for it)."""
ENGINE_DEAD_MESSAGE = "The engine is not running; see the server log."

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error the client sees as ``{"error": {message, type, param, code}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass(frozen=True)
class ModelInfo:
    """What the server knows about the engine's model, read once at startup."""

    tokenizer: object
    max_model_len: int
    vocab_size: int | None
    path: str
    thinks: bool = False
    """The tokenizer has single-token ``<think>``/``</think>``: constraints start after the reasoning."""
    token_bound: TokenBound = TokenBound()
    """The fewest tokens a text's length allows: a text too long to fit is refused untokenized."""

    @classmethod
    def read(cls, engine: AsyncEngineCore) -> ModelInfo:
        def info(core) -> ModelInfo:
            return cls(
                core.tokenizer, core.max_model_len, core.vocab_size, str(core.model_path),
                core.think_tokens is not None,
            )  # fmt: skip

        read = engine.call(info)
        return replace(read, token_bound=token_bound(read.tokenizer))  # off the engine thread


class OpenAIServing:
    """Shared request plumbing for ``ChatServing`` and ``CompletionServing``."""

    def __init__(
        self,
        engine: AsyncEngineCore,
        model_name: str,
        metrics: ServerMetrics,
        info: ModelInfo | None = None,
        tokenize_pool: TokenizePool | None = None,
        options: ServingOptions | None = None,
        adapters: dict[str, LoRARequest] | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.adapters = adapters if adapters is not None else {}  # shared: runtime loading adds to it
        """LoRA adapters by the ``model`` name that picks them (``--lora-modules``)."""
        self.metrics = metrics
        self.options = options or ServingOptions()
        self.info = info or ModelInfo.read(engine)
        self.tokenizer = self.info.tokenizer
        # Tokenizing runs off the event loop, in a pool the servings of one app share.
        self.tokenize_pool = tokenize_pool or TokenizePool(self.options.tokenizer_threads)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def close(self) -> None:
        self.tokenize_pool.shutdown()

    # -- checks and translation ---------------------------------------------------------------

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` picks (None: the base model, also named ``default``
        as the CLI names it); 404 for an unknown name."""
        if name is None or name == self.model_name or name == DEFAULT_MODEL_ALIAS:
            return None
        if name in self.adapters:
            return self.adapters[name]
        served = ", ".join(f"`{n}`" for n in [self.model_name, *self.adapters])
        raise OpenAIError(
            404,
            f"The model `{name}` does not exist (this server serves {served}).",
            param="model",
            code="model_not_found",
        )

    def served_name(self, name: str | None) -> str:
        """The name a response carries: the adapter's when the request picked one, else the model's."""
        return name if name is not None and name in self.adapters else self.model_name

    async def run_tokenizer(self, fn, *args, chars: int = 0):
        """``fn(*args)`` off the event loop; ``chars``: the length of the text it tokenizes."""
        return await self.tokenize_pool.run(fn, *args, chars=chars)

    def check_num_prompts(self, num_prompts: int) -> None:
        try:
            self.options.limits.check_num_prompts(num_prompts)
        except LimitExceeded as exc:
            raise limit_exceeded(exc) from None

    def check_text_fits(self, text: str, param: str = "prompt") -> None:
        """Refuse, from its length alone, a text that cannot fit the context (before it is
        tokenized: megabytes take a tokenizer thread seconds)."""
        limit, at_least = self.info.max_model_len, self.info.token_bound.min_tokens(text)
        if at_least >= limit:
            raise OpenAIError(
                400,
                f"The prompt has at least {at_least} tokens ({len(text)} characters) but the limit is {limit} "
                f"(prompt + completion must fit the context length / KV cache capacity of {limit} tokens).",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        limit = self.info.max_model_len
        if not token_ids:
            raise OpenAIError(400, "The prompt is empty.", param=param)
        if len(token_ids) >= limit:
            raise OpenAIError(
                400,
                f"The prompt has {len(token_ids)} tokens but the limit is {limit} "
                f"(prompt + completion must fit the context length / KV cache capacity of {limit} tokens).",
                param=param,
                code="context_length_exceeded",
            )
        vocab = self.info.vocab_size
        if vocab and any(t < 0 or t >= vocab for t in token_ids):
            raise OpenAIError(400, f"Prompt token ids must be in [0, {vocab}).", param=param)

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        prompt_len: int,
        logprobs: int | None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` for one prompt; ``max_tokens=None`` means "up to the limit".
        ``tool_constraint``: what ``tool_choice`` enforces (``required`` or a named function)."""
        if req.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported.", param="logit_bias")
        limit = self.info.max_model_len
        room = limit - prompt_len
        constraint = self.structured_outputs(req)
        if tool_constraint is not None and constraint is not None:
            raise OpenAIError(
                400, "A forced tool_choice cannot be combined with response_format or structured_outputs.",
                param="tool_choice",
            )  # fmt: skip
        fields = {
            "structured_outputs": constraint or tool_constraint,
            "max_tokens": room if max_tokens is None else max_tokens,
            "min_tokens": req.min_tokens,
            "n": req.n,
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens,
            "logprobs": logprobs,
            "max_thinking_tokens": req.max_thinking_tokens,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        try:
            params = SamplingParams(**fields)
            self.options.limits.check_sampling(params)
        except LimitExceeded as exc:
            raise limit_exceeded(exc) from None
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            raise OpenAIError(400, str(exc), param=name if name in fields else None) from None
        if params.max_thinking_tokens is not None and not self.info.thinks:
            raise OpenAIError(
                400, "max_thinking_tokens needs a thinking model (single-token <think> and </think>); this one has none.",
                param="max_thinking_tokens",
            )  # fmt: skip
        if params.max_tokens > room:
            raise OpenAIError(
                400,
                f"This model's context limit is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} in the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return params

    def structured_outputs(self, req: SamplingFields) -> StructuredOutputsParams | None:
        """The request's constraint: OpenAI's ``response_format`` or vLLM's ``structured_outputs``
        (JSON ones compact unless the request or ``allow_json_whitespace`` says otherwise)."""
        fmt, extra, guided = req.response_format, req.structured_outputs, req.guided_outputs()
        if guided is not None:
            if extra is not None:
                raise OpenAIError(400, "Give either guided_* fields or structured_outputs, not both.", param="structured_outputs")
            extra = guided
        compact = not self.options.allow_json_whitespace
        if fmt is not None and fmt.type != "text" and extra is not None:
            raise OpenAIError(400, "Give either response_format or structured_outputs, not both.", param="structured_outputs")
        if extra is not None:
            if compact and _json_without_whitespace_choice(extra):
                extra = {**extra, "disable_any_whitespace": True}
            try:
                return StructuredOutputsParams.from_dict(extra)
            except (TypeError, ValueError) as exc:
                raise OpenAIError(400, str(exc), param="structured_outputs") from None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
        if fmt.type != "json_schema":
            raise OpenAIError(
                400,
                f"response_format {fmt.type!r} is not supported (only 'text', 'json_object' and 'json_schema').",
                param="response_format",
            )
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format.json_schema.schema is required.", param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_, disable_any_whitespace=compact)

    async def compile_constraint(self, params: SamplingParams, req: SamplingFields) -> CompiledGrammar | None:
        """Compile the request's constraint in a worker thread (never on the event loop or the
        engine thread); an invalid schema, regex or grammar is a 400."""
        if params.structured_outputs is None:
            return None
        try:
            return await asyncio.to_thread(
                self.engine.compile_constraint, params, self.options.limits.max_constraint_bound
            )
        except ConstraintError as exc:
            param = "structured_outputs" if req.structured_outputs is not None else "response_format"
            if req.structured_outputs is None and (req.response_format is None or req.response_format.type == "text"):
                param = "tools"  # the constraint is the one tool_choice made from the tools' schemas
            code = "constraint_too_large" if isinstance(exc, ConstraintTooLarge) else "invalid_constraint"
            raise OpenAIError(400, f"Invalid {param}: {exc}", param=param, code=code) from None
        except EngineDeadError as exc:
            raise engine_dead(exc.__cause__) from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- running requests ---------------------------------------------------------------------

    def submit(
        self,
        prompts: list[list[int] | PreparedPrompt],
        params: list[SamplingParams],
        prefix: str,
        cache_salt: str | None,
        constraint: CompiledGrammar | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Submit one engine request per prompt; ids are ``prefix`` (+ ``-i`` for a batch).
        ``constraint``: the compiled ``structured_outputs`` all the prompts share.

        All prompts of one HTTP request share a fairness key: the scheduler admits them in
        turn with other clients' requests, so a large batch cannot starve a small request.
        """
        streams: list[RequestStream] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                request_id = prefix if len(prompts) == 1 else f"{prefix}-{i}"
                stream = self.engine.add_request(
                    prompt, sp, request_id, cache_salt=cache_salt, fairness_key=prefix, constraint=constraint,
                    lora_request=lora_request,
                )  # fmt: skip
                streams.append(stream)
        except EngineDeadError as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise engine_dead(exc.__cause__) from None
        return streams

    def usage(self, finals: list[RequestOutput]) -> UsageInfo:
        """Token counts of a response; cached prompt tokens only where the operator allows."""
        prompt = sum(f.num_prompt_tokens for f in finals)
        completion = sum(f.num_completion_tokens for f in finals)
        details = None
        if self.options.enable_prompt_tokens_details:
            details = PromptTokensDetails(cached_tokens=sum(f.num_cached_tokens for f in finals))
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
            completion_tokens_details=speculation_details(finals),
        )

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the streams: ``(prompt index, output)`` as they come; metrics recorded.

        Raises ``OpenAIError`` for a request that failed (before or after it started). Closing
        the iterator early aborts the requests still running.

        Bounded whatever the consumer does: the queue holds at most one item per stream and a
        pump waits for room before reading its stream again, so while the consumer lags each
        stream coalesces its outputs into its latest snapshot (``RequestStream``).
        """
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
        trackers = [self.metrics.track() for _ in streams]

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await queue.put((index, output))
            except Exception as exc:  # delivered to the consumer, in order
                await queue.put((index, exc))
            await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise engine_error(item)
                trackers[index].observe(item)
                if item.finished:
                    check_finished(item)
                yield index, item
        finally:
            for task, tracker in zip(tasks, trackers):
                task.cancel()  # unwinding a stream's iteration aborts its request
                tracker.abandon()

    async def until_disconnected(self, awaitable: Awaitable, raw_request) -> object:
        """Await ``awaitable``; cancel it (aborting its requests) if the client disconnects."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if raw_request is not None and await raw_request.is_disconnected():
                    raise ClientDisconnected()
        finally:
            if not task.done():
                task.cancel()

    async def collect(self, streams: list[RequestStream], raw_request) -> list[RequestOutput]:
        """The final output of every stream (non-streaming responses)."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def run() -> None:
            async for index, output in self.outputs(streams):
                if output.finished:
                    finals[index] = output

        await self.until_disconnected(run(), raw_request)
        return finals

    async def first_output(self, streams: list[RequestStream], raw_request):
        """Start a streaming response: wait for the first output so that errors (a refused
        prompt, a dead engine) are still HTTP statuses; return it and the rest of the stream."""
        merged = self.outputs(streams)
        first = await self.until_disconnected(anext(merged), raw_request)
        return first, merged


def _json_without_whitespace_choice(extra: object) -> bool:
    """A ``structured_outputs`` body asking for JSON without saying what whitespace it allows."""
    return (
        isinstance(extra, dict)
        and ("json" in extra or "json_object" in extra)
        and not {"disable_any_whitespace", "whitespace_pattern"} & set(extra)
    )


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def named_sse(event: str, data: dict) -> str:
    """A server-sent event with an ``event:`` line (the Anthropic and Responses streams)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(exc: OpenAIError) -> str:
    """An error after the stream started (the status is already 200): an error event."""
    return f"data: {json.dumps(exc.to_dict())}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_finished(output: RequestOutput) -> None:
    """Map the engine's non-success endings to errors; never report "abort" as a success."""
    reasons = {c.finish_reason for c in output.outputs}
    if "error" in reasons:
        message = output.error or "the request failed"
        if message.startswith(CONSTRAINT_ERROR_PREFIX):  # the client's constraint, not our fault
            raise OpenAIError(400, message, code="structured_output_failed")
        status = 400 if "limit" in message else 500
        raise OpenAIError(status, message, code="context_length_exceeded" if status == 400 else None)
    if "abort" in reasons:
        raise OpenAIError(503, "The request was aborted: the engine is shutting down.", code="aborted")


def limit_exceeded(exc: LimitExceeded) -> OpenAIError:
    return OpenAIError(400, str(exc), param=exc.param, code="limit_exceeded")


def engine_dead(cause: BaseException | None = None) -> OpenAIError:
    """The 503 for a request the engine can no longer serve. The reason is in the log, except a
    lost tensor-parallel rank (``RankLostError``), whose message names only ranks and steps:
    clients see it, so they know a retry waits for the operator."""
    if isinstance(cause, RankLostError):
        return OpenAIError(503, f"The engine is not running: {cause}", code="engine_dead")
    return OpenAIError(503, ENGINE_DEAD_MESSAGE, code="engine_dead")


def engine_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead(exc.__cause__)
    if isinstance(exc, ValueError):  # the engine refused the request itself
        return OpenAIError(400, str(exc))
    logger.error("a request failed", exc_info=exc)
    return OpenAIError(500, "Internal server error; see the server log.")


def top_entries(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) of one position (the sampled one may be extra)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def speculation_details(finals: list[RequestOutput]) -> CompletionTokensDetails | None:
    """Speculative decoding's kept and rejected proposals of a response (None: none proposed,
    e.g. the engine does not speculate)."""
    proposed = sum(f.metrics.num_draft_tokens for f in finals)
    if not proposed:
        return None
    accepted = sum(f.metrics.num_accepted_tokens for f in finals)
    return CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=proposed - accepted)


def check_prompt_logprobs(req: SamplingFields) -> None:
    """``prompt_logprobs`` is refused, not ignored: a client that asked for it must not take
    an answer without it for one with it."""
    if req.prompt_logprobs is not None:
        raise OpenAIError(400, "prompt_logprobs is not supported by this server yet.", param="prompt_logprobs")

"""The OpenAI wire format: request and response models (pydantic) and the error shape.

Requests are validated strictly, and every string must encode (``request_model.RequestBody``);
unknown fields are ignored, as OpenAI does. Value ranges that ``SamplingParams``
already checks (temperature, top_p, penalties, ...) are left to it, so one place owns them.
Fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``, ``cache_salt``,
``structured_outputs``) follow vLLM.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from vllm_mlx.entrypoints.request_model import RequestBody
from vllm_mlx.entrypoints.request_model import StrictModel as _Strict

MAX_LOGPROBS = 20


# -- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (the Anthropic stream needs the prompt's
    token count in its first event)."""


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``. The schema is always enforced: ``strict``
    is accepted and changes nothing."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str
    """"text", "json_object" or "json_schema" (others are refused by the server)."""
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestBody):
    """Fields shared by chat and text completions (vLLM's names where OpenAI has none).

    The operator's caps (``n``, stop strings, prompts) are checked by the server (``RequestLimits``).
    """

    model: str | None = None
    """The served model's name; None means the one model this server serves."""
    n: Annotated[int, Field(ge=1)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    """Folded into prefix-cache hashes: requests with different salts never share KV blocks."""
    response_format: ResponseFormat | None = None
    max_thinking_tokens: int | None = None
    """A thinking model's reasoning budget: ``</think>`` is forced after this many tokens."""
    structured_outputs: dict | None = None
    """vLLM's constraint object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
    ...); checked by ``StructuredOutputsParams.from_dict``."""
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older names of ``structured_outputs``' fields, still sent by many clients."""
    prompt_logprobs: int | None = None
    """vLLM's; refused with a 400 until the engine computes prompt logprobs."""

    def guided_outputs(self) -> dict | None:
        """The ``guided_*`` fields as a ``structured_outputs`` object (None: none given)."""
        fields = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}  # fmt: skip
        return {name: value for name, value in fields.items() if value is not None} or None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL | str


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    """An assistant turn's calls (OpenAI's shape; the template gets each ``arguments`` as a mapping)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call this is the result of."""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict] | None = None
    """OpenAI function tools, rendered by the chat template (checked by ``ToolPlan.of``)."""
    tool_choice: str | dict | None = None
    """"none", "auto" (the default with tools), "required" or a named function."""
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# -- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's counts of predicted tokens (its Predicted Outputs): here, speculative decoding's."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    """Only with `--enable-prompt-tokens-details` (cached tokens tell of other tenants' prompts)."""
    completion_tokens_details: CompletionTokensDetails | None = None
    """With speculative decoding: the proposed tokens kept and rejected for this response."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls"] | None
StopReason = str | int | None
"""vLLM's ``stop_reason``: the stop string or stop token id that ended a choice (None for
the model's end-of-sequence token or any other ending)."""


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """A JSON object, as text (OpenAI's shape)."""


class ToolCallInfo(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """``content`` is null when the turn is only tool calls; ``reasoning_content`` (a model's
    ``<think>`` text, vLLM's field) and ``tool_calls`` appear only when there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCallInfo] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_extras(self, handler) -> dict:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _WithoutNulls(BaseModel):
    """Serialized without its null fields: a delta carries only what changed."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(_WithoutNulls):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(_WithoutNulls):
    """A piece of call ``index``: its first piece has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(_WithoutNulls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm-mlx"
    root: str | None = None
    parent: str | None = None
    """An adapter's base model (vLLM's field); None for the base model itself."""
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

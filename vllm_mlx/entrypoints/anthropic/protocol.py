"""The Anthropic Messages wire format: request and response models (pydantic) and the error shape.

Requests are validated as strictly as the OpenAI ones (``request_model.RequestBody``: strict types,
strings that encode; unknown fields are ignored, as Anthropic's clients send beta fields freely).
A tool's ``input_schema`` must be an object schema (``"type": "object"``), as Anthropic requires:
a ``tool_use`` block's ``input`` is always an object. Value ranges are left to ``SamplingParams``.
Beyond Anthropic's fields, vLLM's ``structured_outputs`` (a constraint object) is accepted, as on chat completions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_mlx.entrypoints.request_model import RequestBody
from vllm_mlx.entrypoints.request_model import StrictModel as _Strict

MESSAGES_PATH = "/v1/messages"


# -- requests ---------------------------------------------------------------------------------


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Strict):
    """Earlier reasoning sent back by a client: accepted, and left out of the prompt (as the
    chat templates drop earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


InputBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Tool(_Strict):
    """A client tool; Anthropic's server tools (``bash_...``, ``web_search_...``) are not offered."""

    name: str
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict) -> dict:
        if schema.get("type") != "object":
            raise ValueError(f"must be a JSON Schema with \"type\": \"object\" (got type {schema.get('type')!r})")
        return schema


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(_Strict):
    """Anthropic's ``output_config.format``: a JSON schema the answer follows."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict | bool = Field(alias="schema")


class OutputConfig(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: OutputFormat | None = None


class MessagesInput(RequestBody):
    """What a prompt is made of: the body of ``count_tokens``, and of ``messages`` with more."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(MessagesInput):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None
    """Accepted and ignored (Anthropic's ``user_id`` is for abuse tracking)."""
    structured_outputs: dict | None = None
    """vLLM's constraint object (``regex``, ``json``, ``choice``, ...), as on chat completions."""
    output_config: OutputConfig | None = None
    """Anthropic's structured outputs: ``{"format": {"type": "json_schema", "schema": ...}}``
    (its other settings, such as ``effort``, change nothing here)."""
    output_format: OutputFormat | None = None
    """The same format under its beta name (``output_format``)."""

    def json_schema(self) -> dict | bool | None:
        """The schema the answer must follow, from either field (None: free text)."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format.schema_
        return self.output_format.schema_ if self.output_format is not None else None


# -- responses --------------------------------------------------------------------------------


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    """Anthropic signs its reasoning; ours is unsigned (clients keep it as it is)."""


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


ContentBlock = TextContent | ThinkingContent | ToolUseContent
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# -- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape for an HTTP ``status``."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    """The routes that answer in Anthropic's shapes (errors included)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")

"""The OpenAI Responses wire format (``POST /v1/responses``): request, response and item models.

Only what a stateless server can honour: function tools, text/image input, ``text.format``.
Input messages may omit ``"type": "message"`` (the SDK's "easy" input messages). Requests are
checked as the other APIs' (``request_model.RequestBody``): the response echoes ``text.format``,
``tool_choice`` and the tools, so a string that cannot encode is a 400 before anything runs.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from vllm_mlx.entrypoints.request_model import RequestBody
from vllm_mlx.entrypoints.request_model import StrictModel as _Strict

# -- requests ---------------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    """A URL or a ``data:`` URL (uploaded ``file_id``s need OpenAI's file store)."""
    detail: str | None = None


InputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningInputItem(_Strict):
    """Earlier reasoning sent back: accepted and left out of the prompt."""

    type: Literal["reasoning"]


def _item_type(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    """Refused: this server keeps no conversation state."""
    store: bool | None = None
    """Accepted; nothing is stored either way."""
    metadata: dict | None = None
    user: str | None = None
    structured_outputs: dict | None = None
    """vLLM's constraint object (``regex``, ``json``, ``choice``, ...), as on chat completions."""


# -- responses --------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | ReasoningItem | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response; the request's settings are echoed, as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] = Field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict = Field(default_factory=dict)
    store: bool = False

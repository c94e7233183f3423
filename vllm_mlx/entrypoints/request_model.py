"""The base of every request body the server accepts (OpenAI chat and text completions, OpenAI
Responses, Anthropic Messages): one place for what holds for all of them.

- Strict types (``"stream": "yes"`` or ``"n": 1.5`` is a 400, not a silent coercion); unknown
  fields are ignored, as OpenAI and Anthropic do.
- Every string of the body encodes as UTF-8. JSON may carry unpaired surrogates (``"\\ud800"``);
  the tokenizer, the block hashes and every response that echoes a field (a Responses ``text.format``,
  a ``tool_choice``, tools) would fail on one, so a body holding one is refused whole, with the
  field's path, before any work: a 400 before a stream starts, never a 500 or a dropped
  connection. The raw body is checked, so a field added later is covered without a line here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from vllm_mlx.platform.validation import unencodable_path

UNENCODABLE = "unencodable_string"
"""The pydantic error type of a string that is not valid Unicode (``ctx["path"]`` names it)."""


class StrictModel(BaseModel):
    """Strict types, unknown fields ignored: every part of a request body."""

    model_config = ConfigDict(strict=True, extra="ignore")


class RequestBody(StrictModel):
    """A whole request body (the top-level model of a route)."""

    @model_validator(mode="before")
    @classmethod
    def _strings_encode(cls, data: object) -> object:
        path = unencodable_path(data) if isinstance(data, dict) else None
        if path is not None:
            raise PydanticCustomError(
                UNENCODABLE, "{path} is not valid Unicode (it contains an unpaired surrogate)", {"path": path}
            )
        return data

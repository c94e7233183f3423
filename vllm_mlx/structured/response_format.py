"""``response_format`` for the Python API: a Pydantic model or a JSON Schema in, ``.parsed`` out.

    llm.chat(messages, params, response_format=City)   # outputs[0].parsed is a City

The constraint makes the text a prefix of a valid document; ``parse`` validates the whole text
(a completion cut short by ``max_tokens`` does not parse, and its ``parsed`` stays None). The
JSON is compact (``disable_any_whitespace``): with free whitespace a sampling model often fills
``max_tokens`` with newlines; for whitespace, give ``SamplingParams(structured_outputs=
StructuredOutputsParams(json=..., disable_any_whitespace=False))`` instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mlx.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint and the parser that turns a completed output into its object."""

    params: StructuredOutputsParams
    parse: Callable[[str], object]
    """Raises ``ValueError`` (Pydantic's ``ValidationError`` is one) when the text does not parse
    or validate."""

    @classmethod
    def of(cls, response_format: object) -> ResponseFormat:
        """From a Pydantic model class, a JSON Schema dict, or OpenAI's response_format dict
        (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``).

        Raises:
            ValueError: Something else, or a schema that is not a dict.
        """
        if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
            schema = response_format.model_json_schema()
            return cls(StructuredOutputsParams(json=schema, disable_any_whitespace=True), response_format.model_validate_json)
        if not isinstance(response_format, dict):
            raise ValueError(
                "response_format must be a Pydantic model class or a JSON Schema dict, got "
                f"{type(response_format).__name__}"
            )
        kind = response_format.get("type")
        if kind == "json_object":
            return cls(StructuredOutputsParams(json_object=True, disable_any_whitespace=True), _json_parser({"type": "object"}))
        if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
            schema = response_format["json_schema"].get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
            return cls(StructuredOutputsParams(json=schema, disable_any_whitespace=True), _json_parser(schema))
        return cls(StructuredOutputsParams(json=response_format, disable_any_whitespace=True), _json_parser(response_format))

    def parsed(self, text: str) -> object:
        """The validated object of ``text``, or None when it does not parse or validate."""
        try:
            return self.parse(text)
        except ValueError:
            return None


def _json_parser(schema: dict) -> Callable[[str], object]:
    def parse(text: str) -> object:
        import jsonschema

        value = json.loads(text)
        try:
            jsonschema.validate(value, schema)
        except (jsonschema.ValidationError, jsonschema.SchemaError) as exc:
            raise ValueError(f"the output does not match the schema: {exc.message}") from None
        return value

    return parse

"""``StructuredOutputsParams``: what a request's output must match (vLLM's shape).

Pure Python (no llguidance, no MLX): ``SamplingParams`` holds one, and ``import vllm_mlx`` stays
light. Compiling it into a grammar is ``structured/grammar.py``'s job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from vllm_mlx.platform.validation import check_encodable

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""The fields of which exactly one is set."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output: exactly one of ``json``, ``json_object``, ``regex``,
    ``choice`` or ``grammar`` (vLLM's ``StructuredOutputsParams``).

    The model can only sample tokens that keep the output a prefix of something the constraint
    accepts, and it can end (EOS) only where the output is complete. A completion cut short by
    ``max_tokens`` or a stop string is a prefix, not a whole match.

    Frozen: ``SamplingParams`` copies share it, and compiled grammars are cached by its content.

    Raises:
        ValueError: None or several kinds set, or a field of the wrong type.
    """

    json: str | dict | bool | None = None
    """A JSON Schema (a dict, or its JSON text): the output is one JSON value matching it."""
    regex: str | None = None
    """A regular expression (Rust ``regex`` syntax) the whole output must match."""
    choice: list[str] | tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: llguidance's Lark dialect or llama.cpp's GBNF (``root ::= ...``)."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's ``response_format: json_object``)."""
    disable_any_whitespace: bool = False
    """JSON only: no whitespace between tokens (compact output, fewer tokens)."""
    disable_additional_properties: bool = False
    """JSON only: objects without ``additionalProperties`` get ``false`` (no extra keys)."""
    whitespace_pattern: str | None = None
    """JSON only: a regex for the whitespace allowed between tokens."""

    def __post_init__(self) -> None:
        chosen = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
        if len(chosen) != 1:
            what = "none is" if not chosen else f"several are ({', '.join(chosen)})"
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}, but {what} set"
            )
        self._check_kind(chosen[0])
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None:
            _check_text("whitespace_pattern", self.whitespace_pattern)
        if self.choice is not None:  # a tuple: hashable, and nobody edits it behind our back
            object.__setattr__(self, "choice", tuple(self.choice))

    def _check_kind(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                _check_text("json", value)
                try:
                    json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            elif not isinstance(value, (dict, bool)):
                raise ValueError(
                    f"structured_outputs.json must be a JSON Schema (a dict or JSON text), got {type(value).__name__}"
                )
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be True when set, got {value!r}")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r}")
            for c in value:
                check_encodable("structured_outputs.choice", c)
        else:
            _check_text(kind, value)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``CONSTRAINT_KINDS``."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) is not None)

    def to_dict(self) -> dict:
        """The set fields, for logs and error messages."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}

    @classmethod
    def from_dict(cls, data: object) -> StructuredOutputsParams:
        """From a request body's ``structured_outputs`` object; unknown keys are a ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields: {', '.join(unknown)}")
        return cls(**data)


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
    check_encodable(f"structured_outputs.{name}", value)

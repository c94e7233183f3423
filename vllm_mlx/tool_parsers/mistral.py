"""Mistral: ``[TOOL_CALLS]`` then a JSON list of calls, or the newer per-call form.

- Older tokenizers (v2/v3, Mistral 7B v0.3, Mixtral, Nemo):
  ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` up to the end of the output.
- Newer ones (v11+, Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}``, one
  ``[TOOL_CALLS]`` per call (``[TOOL_CALLS]f[CALL_ID]abc123def[ARGS]{...}`` is accepted too).

A list that is not valid JSON is content. Of a list that parses, items that are not calls (or
name a function not in ``tools``) are dropped and the valid ones kept; with none valid, it is all
content. A per-call region is all or nothing. Call ids are Mistral's 9 letters and digits.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence

from vllm_mlx.tool_parsers.base import IdFactory, ParsedCall, ToolParser, call_from_object

_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's chat templates require ids of exactly 9 letters and digits."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(9))


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    end_marker = None
    start_closes_region = True
    needs_special_tokens = True  # [TOOL_CALLS] is a control token in v3+ tokenizers

    def __init__(self, tools: Sequence[dict] | None = None, id_factory: IdFactory | None = None):
        super().__init__(tools, id_factory or mistral_call_id)

    def parse_region(self, body: str) -> list[ParsedCall] | None:
        if body.lstrip().startswith("["):
            return self._parse_list(body)
        return self._parse_named(body)

    def _parse_list(self, body: str) -> list[ParsedCall] | None:
        try:
            items = json.loads(body)
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        calls = [call_from_object(item) for item in items]
        return [c for c in calls if c is not None and self.known(c)] or None

    def _parse_named(self, body: str) -> list[ParsedCall] | None:
        name, sep, arguments = body.partition("[ARGS]")
        name = name.split("[CALL_ID]", 1)[0].strip()
        if not sep or not name or any(c.isspace() for c in name):
            return None
        try:
            obj = json.loads(arguments)
        except ValueError:
            return None
        call = ParsedCall(name, obj) if isinstance(obj, dict) else None
        return [call] if call is not None and self.known(call) else None

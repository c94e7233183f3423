"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``.

The calls are the whole rest of the output: after ``<|python_tag|>`` (text before it is content),
or from the output's start when it begins with ``{``. Several calls are separated by ``;``.

The region must be a ``;``-separated sequence of JSON objects, else it is all content. Of a
sequence that parses, objects that are not calls (no name, arguments not an object, a function
not in ``tools``) are dropped and the valid ones kept; with no valid one, it is all content.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_mlx.tool_parsers.base import ParsedCall, ToolParser, call_from_object

_DECODER = json.JSONDecoder()


def json_sequence(text: str, separator: str) -> list[Any] | None:
    """``text`` as JSON values separated by ``separator`` (whitespace around allowed), or None."""
    values, pos, text = [], 0, text.strip()
    while pos < len(text):
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        rest = text[pos:].lstrip()
        if rest and not rest.startswith(separator):
            return None
        pos = len(text) - len(rest) + len(separator)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return values or None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    end_marker = None

    def region_start_at_beginning(self) -> str | None:
        return "{"

    def parse_region(self, body: str) -> list[ParsedCall] | None:
        values = json_sequence(body, ";")
        if values is None:
            return None
        calls = [call_from_object(v, ("parameters", "arguments")) for v in values]
        return [c for c in calls if c is not None and self.known(c)] or None

"""Qwen3-Coder XML tool calls.

As the model writes them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One function per ``<tool_call>`` block; each block is parsed on its own, a valid one is a call and
an invalid one (no ``<function=...>``, text outside the tags, an unknown function) is content.
Parameter values lose one newline on each side and are converted by the type the tool's JSON
Schema gives the parameter (``integer``, ``number``, ``boolean``, ``null``, ``object``, ``array``);
a value that does not convert, a parameter without a type and calls without ``tools`` keep the
string.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from vllm_mlx.tool_parsers.base import ParsedCall, ToolParser

_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def schema_types(schema: dict | None) -> list[str]:
    kind = (schema or {}).get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):  # e.g. Optional[int] from Pydantic
        if isinstance((schema or {}).get(key), list):
            return [t for option in schema[key] if isinstance(option, dict) for t in schema_types(option)]
    return []


def convert_value(value: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON type its schema names; the string if none fits."""
    for kind in schema_types(schema):
        if kind == "string":
            return value
        converted = _convert(value.strip(), kind)
        if converted is not _NO:
            return converted
    return value


_NO = object()


def _convert(text: str, kind: str) -> Any:
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            if not math.isfinite(number):  # NaN is not JSON
                return _NO
            return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", text) else number
        if kind == "boolean":
            return {"true": True, "false": False}.get(text.lower(), _NO)
        if kind == "null":
            return None if text.lower() in ("null", "none") else _NO
        if kind in ("object", "array"):
            value = json.loads(text)
            return value if isinstance(value, dict if kind == "object" else list) else _NO
    except ValueError:
        return _NO
    return _NO


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def parse_region(self, body: str) -> list[ParsedCall] | None:
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.groups()
        call = ParsedCall(name, {})
        if not self.known(call) or "<function=" in inner:
            return None
        properties = ((self.schemas or {}).get(name) or {}).get("properties") or {}
        for param, value in _PARAMETER.findall(inner):
            call.arguments[param] = convert_value(strip_one_newline(value), properties.get(param))
        if _PARAMETER.sub("", inner).strip():  # stray text between parameters
            return None
        return [call]

"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Each ``<tool_call>`` block is parsed on its own: a valid block is a call, an invalid one (broken
JSON, no name, an unknown function) is content, verbatim; an unclosed block at the end is content.
``"parameters"`` is accepted for ``"arguments"`` (some fine-tunes write it), and arguments sent as a
JSON string are decoded.
"""

from __future__ import annotations

import json

from vllm_mlx.tool_parsers.base import ParsedCall, ToolParser, call_from_object


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def parse_region(self, body: str) -> list[ParsedCall] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = call_from_object(obj, ("arguments", "parameters"))
        return [call] if call is not None and self.known(call) else None

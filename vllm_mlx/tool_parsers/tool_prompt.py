"""Tools for a chat template that has no place for them: written into the conversation itself.

Many chat templates (the default model's among them) render no ``tools``: passed to them, the
tools never reach the prompt, and an agent gets a model that never calls. For such a template
(``renders_tools`` says which: the same conversation rendered with and without a probe tool gives
the same text), the tools go into the system message, in the ``<tool_call>`` format the Hermes
parser reads, and the conversation's earlier calls and results are written out in that format
too (the template would drop an assistant turn's ``tool_calls`` and may refuse a ``tool`` role).
The request's output is then parsed with ``FALLBACK_PARSER``.

Pure Python, no MLX: every front door renders templates off the engine thread.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

FALLBACK_PARSER = "hermes"
"""The parser of the format the tools are described in."""

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "vllm_mlx_probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]
_RENDERS: dict[str, bool] = {}  # by template text: whether it renders tools


def renders_tools(template: str | None, render: Callable[[list[dict], list[dict] | None], str]) -> bool:
    """Whether the chat template ``template`` puts tools in its prompt: ``render(messages,
    tools)`` of a probe conversation differs with a tool and without (a template that fails with
    tools renders none). Remembered per template text."""
    if not template:
        return False
    if template not in _RENDERS:
        try:
            _RENDERS[template] = render(_PROBE_MESSAGES, [_PROBE_TOOL]) != render(_PROBE_MESSAGES, None)
        except Exception:  # a template that cannot take tools (or this probe) renders none
            _RENDERS[template] = False
    return _RENDERS[template]


def with_tools_in_messages(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
    """``messages`` with ``tools`` described in the system message (prepended to the caller's
    system message, or a new first message) and earlier calls and results written out."""
    described = tools_instructions(tools)
    out = written_out(messages)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{described}\n\n{_text(out[0].get('content'))}".rstrip()}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def tools_instructions(tools: Sequence[dict]) -> str:
    """The system message's part that lists the tools and says how to call them."""
    listed = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help answer. These are the functions, one JSON description per line, "
        f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call one, write a JSON object with its name and its arguments inside <tool_call></tool_call>, "
        "one call per block, and nothing after the last block:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
        "A function's result comes back to you inside <tool_response></tool_response>. "
        "When no function helps, answer directly."
    )


def written_out(messages: Sequence[dict]) -> list[dict]:
    """Earlier calls and results written out (a conversation that carries them but no tools)."""
    return [_written_out(message) for message in messages]


def _written_out(message: dict) -> dict:
    """An assistant turn's calls as ``<tool_call>`` blocks in its text; a tool result as a user
    turn with ``<tool_response>`` (templates without tools know no ``tool`` role)."""
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        blocks = [_call_block(call) for call in message["tool_calls"]]
        text = "\n".join([_text(message.get("content")), *blocks]).strip()
        return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
    return message


def _call_block(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments if arguments is not None else {}},
                      ensure_ascii=False)  # fmt: skip
    return f"<tool_call>\n{body}\n</tool_call>"


def _text(content) -> str:
    """A message's text: a string, or the text of its parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")

"""Turning a ``%%generate`` cell into a prompt: variable interpolation and chat messages.

Interpolation is deliberately narrow: ``{name}`` is replaced only when ``name`` is a plain
identifier bound to a *value* in the user namespace. Everything else in braces stays as
written — code, JSON, dict literals, f-string fields with format specs (``{x:>10}``), Jinja's
``{{ x }}``, names that do not exist, modules, functions and classes (whose repr is never
what a prompt means), and IPython's own variables: the history (``In``, ``Out``, ``_``,
``_i3``, ``_oh``, ...), ``exit``/``quit``/``get_ipython``, and any name starting with ``_``,
which would put earlier cells' inputs and outputs into a prompt unasked.
"""

from __future__ import annotations

import json
import re
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_mlx.tool_parsers import ToolCall
    from vllm_mlx_jupyter.session.tools import ToolSet

_FIELD = re.compile(r"(?<!\{)\{([A-Za-z_][A-Za-z0-9_]*)\}(?!\})")
_NOT_VALUES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)
_IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})  # the rest start with "_"


def interpolate(text: str, namespace: dict) -> str:
    """Replace ``{name}`` with ``str(namespace[name])`` where that is a value; keep the rest."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        return str(namespace[name]) if _is_value(name, namespace) else match.group(0)

    return _FIELD.sub(replace, text)


def _is_value(name: str, namespace: dict) -> bool:
    """True when ``{name}`` may be replaced: a user's value, not IPython's or a callable."""
    if name.startswith("_") or name in _IPYTHON_NAMES or name not in namespace:
        return False
    return not isinstance(namespace[name], _NOT_VALUES)


@dataclass
class ChatSession:
    """The completed turns of one ``--chat`` session.

    Invariants: ``messages`` holds only finished turns, so the next turn's prompt starts with the
    previous turn's prompt (the prefix cache serves it). A turn is a user message (none when it
    answers tool results), then the assistant's message with its ``tool_calls`` (OpenAI's shape),
    then one ``tool`` message per result added. A turn that is aborted or fails leaves the history
    unchanged. ``system`` and ``tools`` stay for later turns until a turn gives new ones.
    """

    name: str
    system: str | None = None
    tools: ToolSet | None = None
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    pending: object = field(default=None, repr=False)
    """The latest turn's ``Generation``: the next turn waits for it."""
    recorded: object = field(default=None, repr=False)
    """The ``Generation`` whose turn ends ``messages``: only it may add tool results."""

    @property
    def awaits_answer(self) -> bool:
        """The history ends with tool results: the next turn may have no user message."""
        return bool(self.messages) and self.messages[-1]["role"] == "tool"

    def conversation(self, user: str | list[dict] | None) -> list[dict]:
        """The messages of the next turn: system (if any), history, then ``user`` (text, or
        content parts with images; a turn's images stay in the history; None: no user message)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.messages, *_user_message(user)]

    def record(self, user: str | list[dict] | None, gen) -> None:
        """Append a finished turn: ``user`` and ``gen``'s answer (content and tool calls)."""
        assistant = {"role": "assistant", "content": gen.content}
        if gen.tool_calls:
            assistant["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
                for c in gen.tool_calls
            ]
        self.messages += [*_user_message(user), assistant]
        self.recorded = gen

    def add_tool_result(self, gen, call: ToolCall | str, content: object) -> None:
        """Append the result of ``gen``'s call (a ``ToolCall`` or its id).

        Raises:
            ValueError: ``gen`` is not the latest finished turn, or the call is not one of its
                calls, or it has a result already.
        """
        call_id = getattr(call, "id", call)
        self._check_latest(gen)
        if call_id not in {c.id for c in gen.tool_calls}:
            known = [c.id for c in gen.tool_calls]
            raise ValueError(f"{gen.name!r} made no tool call {call_id!r} (its calls: {known})")
        if call_id in _answered(self.messages):
            raise ValueError(f"tool call {call_id!r} has a result already")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, default=str)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def run_tools(self, gen) -> list[object]:
        """Run ``gen``'s calls with the Python functions of ``tools``; add and return the results."""
        self._check_latest(gen)
        functions = self.tools.functions if self.tools is not None else {}
        missing = [c.name for c in gen.tool_calls if c.name not in functions]
        if missing:
            raise ValueError(f"no Python function for the tool call(s) {missing} (give functions in --tools)")
        results = []
        for call in gen.tool_calls:
            results.append(functions[call.name](**json.loads(call.arguments)))
            self.add_tool_result(gen, call, results[-1])
        return results

    def _check_latest(self, gen) -> None:
        """Results belong right after their turn: ``gen`` must be the last one, and finished."""
        if self.recorded is not gen or self.pending is not gen:
            raise ValueError(f"{gen.name!r} is not the latest finished turn of chat {self.name!r}")

    def transcript(self) -> str:
        lines = [f"[system] {self.system}"] if self.system else []
        lines += [f"[{m['role']}] {_message_text(m)}" for m in self.messages]
        return "\n".join(lines) if lines else f"(chat session {self.name!r} has no turns yet)"


def _user_message(user: str | list[dict] | None) -> list[dict]:
    return [] if user is None else [{"role": "user", "content": user}]


def _answered(messages: list[dict]) -> set[str]:
    """The call ids that have a result since the last assistant message."""
    ids = set()
    for message in reversed(messages):
        if message["role"] != "tool":
            break
        ids.add(message["tool_call_id"])
    return ids


def user_content(prompt: str, images: list) -> str | list[dict]:
    """A user turn: the text, or (with images) image parts first, then the text."""
    if not images:
        return prompt
    return [*({"type": "image", "image": image} for image in images), {"type": "text", "text": prompt}]


def _message_text(message: dict) -> str:
    """One line of the transcript: the content, the calls an assistant made, a result's call id."""
    text = _content_text(message["content"])
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls", [])]
    if "tool_call_id" in message:
        text = f"({message['tool_call_id']}) {text}"
    return " ".join(filter(None, [text, *(f"-> {call}" for call in calls)]))


def _content_text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return " ".join("[image]" if part["type"] == "image" else part["text"] for part in content)

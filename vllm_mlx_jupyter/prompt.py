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

import re
import types
from dataclasses import dataclass, field

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

    Invariant: ``messages`` alternates user/assistant and holds only finished turns, so the
    next turn's prompt starts with the previous turn's prompt (the prefix cache serves it).
    A turn that is aborted or fails leaves the history unchanged.
    """

    name: str
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    pending: object = field(default=None, repr=False)
    """The latest turn's ``Generation``: the next turn waits for it."""

    def conversation(self, user: str | list[dict]) -> list[dict]:
        """The messages of the next turn: system (if any), history, then ``user`` (text, or
        content parts with images; a turn's images stay in the history)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.messages, {"role": "user", "content": user}]

    def record(self, user: str | list[dict], assistant: str) -> None:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    def transcript(self) -> str:
        lines = [f"[system] {self.system}"] if self.system else []
        lines += [f"[{m['role']}] {_content_text(m['content'])}" for m in self.messages]
        return "\n".join(lines) if lines else f"(chat session {self.name!r} has no turns yet)"


def user_content(prompt: str, images: list) -> str | list[dict]:
    """A user turn: the text, or (with images) image parts first, then the text."""
    if not images:
        return prompt
    return [*({"type": "image", "image": image} for image in images), {"type": "text", "text": prompt}]


def _content_text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return " ".join("[image]" if part["type"] == "image" else part["text"] for part in content)

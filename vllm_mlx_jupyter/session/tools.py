"""``%%generate --tools VAR``: OpenAI tool dicts or plain Python functions -> the tools the chat
template renders, and the functions a finished call can run (``Generation.run_tools``).

A function's tool is built from its signature and docstring: the name, the docstring's first
paragraph as the description, one property per parameter (JSON type from the annotation:
``str``, ``int``, ``float``, ``bool``, ``list``/``list[X]``, ``dict``, ``Literal[...]``; anything
else is left untyped), required unless it has a default; no other property unless it takes
``**kwargs``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class ToolSet:
    """The tools of a request: ``specs`` in OpenAI's shape, ``functions`` by tool name (only the
    tools that were given as Python functions)."""

    specs: list[dict]
    functions: dict[str, Callable] = field(default_factory=dict)


def tool_set(value: object) -> ToolSet:
    """From one tool or a list of them (OpenAI tool dicts or functions).

    Raises:
        ValueError: Something else, or tools the server would refuse too (the message says which).
    """
    from vllm_mlx.tool_parsers.tool_choice import check_tools

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError("the list of tools is empty")
    specs = [function_tool(item) if callable(item) else item for item in items]
    functions = {spec["function"]["name"]: item for spec, item in zip(specs, items) if callable(item)}
    return ToolSet(check_tools(specs), functions)


def function_tool(function: Callable) -> dict:
    """An OpenAI function tool describing ``function``."""
    hints = typing.get_type_hints(function)
    properties, required, takes_any = {}, [], False
    for name, param in inspect.signature(function).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            takes_any = takes_any or param.kind == param.VAR_KEYWORD
            continue
        properties[name] = _json_schema(hints.get(name))
        if param.default is param.empty:
            required.append(name)
    doc = inspect.getdoc(function) or ""
    parameters = {"type": "object", "properties": properties, "required": required}
    if not takes_any:  # a forced call must not invent an argument the function cannot take
        parameters["additionalProperties"] = False
    spec = {"name": function.__name__, "parameters": parameters}
    if doc:
        spec["description"] = doc.split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": spec}


def _json_schema(hint: object) -> dict:
    """The JSON Schema of a simple annotation; ``{}`` (any value) for what we do not map."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is list and args:
        return {"type": "array", "items": _json_schema(args[0])}
    kind = _JSON_TYPES.get(origin or hint)
    return {"type": kind} if kind else {}

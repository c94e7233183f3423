"""``tools`` + ``tool_choice`` -> what to render, what to enforce and how to parse (any API).

- ``none``: the tools are not rendered and nothing is parsed: the answer is a message.
- ``auto`` (the default when tools are given): the chat template renders the tools and the
  model's own call format is parsed (``tool_parsers.registry``); nothing is enforced.
- ``required`` and a named function are *enforced* by a JSON Schema constraint, in the form vLLM
  uses for them on every model: a named function's output is its arguments object; ``required``
  outputs a JSON array of ``{"name": ..., "parameters": {...}}`` with at least one call (exactly
  one when parallel calls are off). ``ForcedCallStream`` turns that output into calls.

Pure Python, no MLX: the server and the notebooks run it off the engine thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_mlx.structured.params import StructuredOutputsParams
from vllm_mlx.tool_parsers.base import IdFactory, StreamDelta, ToolCallDelta, dump_arguments, random_call_id

MODES = ("none", "auto", "required")
_CUT_CALL = re.compile(r'^\{"name":"(?P<name>(?:[^"\\]|\\.)*)","parameters":(?P<arguments>.*)$', re.S)
"""A ``required`` output's first call cut short after its name (compact JSON, as constrained)."""


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``: a mode, and the function's name when one is forced."""

    mode: str
    """"none", "auto", "required" or "function" (one named function is forced)."""
    function: str | None = None

    @property
    def forced(self) -> bool:
        """The output is a call, enforced by a constraint."""
        return self.mode in ("required", "function")


def check_tools(tools: object) -> list[dict]:
    """OpenAI function tools, checked: a list of ``{"type": "function", "function": {"name": ...}}``
    with distinct names and ``parameters`` that describe an object (a call's arguments are one:
    a schema of another ``type`` is refused, as OpenAI and Anthropic refuse it).

    Raises:
        ValueError: The first problem, naming the tool.
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        name = function["name"]
        if name in names:
            raise ValueError(f"tools[{i}]: the function name {name!r} is given twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
        if parameters and parameters.get("type", "object") != "object":
            raise ValueError(
                f"tools[{i}].function.parameters must be a JSON Schema of type 'object', got {parameters['type']!r}"
            )
        names.add(name)
    return tools


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def parse_tool_choice(value: object, tools: Sequence[dict] | None) -> ToolChoice:
    """``tool_choice`` as OpenAI takes it: a mode string or
    ``{"type": "function", "function": {"name": ...}}``; None means ``auto`` with tools, else ``none``.

    Raises:
        ValueError: An unknown mode, a function that is not in ``tools``, or a choice that
            needs tools when none are given.
    """
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(MODES)} or a named function, got {value!r}")
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type", "function") == "function":
        name = (value.get("function") or {}).get("name") if isinstance(value.get("function"), dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice.function.name must be a non-empty string")
        choice = ToolChoice("function", name)
    else:
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if choice.mode != "none" and not tools:
        raise ValueError(f"tool_choice {value!r} needs tools")
    if choice.function is not None and choice.function not in tool_names(tools):
        raise ValueError(f"tool_choice names the function {choice.function!r}, which is not in tools")
    return choice


def forced_call_constraint(
    tools: Sequence[dict], choice: ToolChoice, parallel_tool_calls: bool = True
) -> StructuredOutputsParams | None:
    """The constraint that makes the output a call (``required`` / named); None otherwise.

    The JSON is compact (no whitespace between tokens): free whitespace lets a weak model fill
    ``max_tokens`` with newlines and never make the call (llguidance repeats a
    ``whitespace_pattern``, so it cannot bound the whitespace either)."""
    if not choice.forced:
        return None
    schemas = {tool["function"]["name"]: _parameters(tool) for tool in tools}
    if choice.mode == "function":
        return StructuredOutputsParams(json=schemas[choice.function], disable_any_whitespace=True)
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, disable_any_whitespace=True)


def _parameters(tool: dict) -> dict:
    """A function's parameters schema, always of an object (a schema without ``type``, such as
    ``{"enum": [...]}``, could otherwise force a string); a function without one takes any object.
    A schema that lists its properties and says nothing of others takes only those, as OpenAI's
    strict mode does: left open (LangChain's ``@tool`` writes such schemas), a model may add keys
    until ``max_tokens`` and never finish the call."""
    schema = {"type": "object", **(tool["function"].get("parameters") or {})}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


class ForcedCallStream:
    """One forced output -> call deltas, as ``ToolCallStream`` gives for a model's own format.

    A named function's output *is* the arguments: its call (id, name) is sent at once and the
    arguments stream as the model writes them. A ``required`` output is a JSON array: each call
    is sent when its array element is complete. An output that stops early (``max_tokens``) has
    its arguments cut short: a named call's, or a ``required`` output's first call once its name
    is written (it is sent at the end, with what was written of its arguments: a forced call
    always answers with a call when it can name one); a later unfinished call is left unsent.
    """

    def __init__(self, choice: ToolChoice, id_factory: IdFactory | None = None) -> None:
        self.choice = choice
        self.id_factory = id_factory or random_call_id
        self.num_calls = 0
        self.array = _ArrayElements()

    def feed(self, text: str) -> list[StreamDelta]:
        if self.choice.mode == "function":
            return self._named(text)
        return [delta for element in self.array.feed(text) for delta in self._element(element)]

    def finish(self) -> list[StreamDelta]:
        if self.choice.mode == "function" or self.num_calls:
            return []
        cut = _CUT_CALL.match(self.array.partial)
        if cut is None:  # not even a name: no call to give
            return []
        self.num_calls = 1
        return [
            StreamDelta(tool_call=ToolCallDelta(0, self.id_factory(), json.loads(f'"{cut["name"]}"'))),
            StreamDelta(tool_call=ToolCallDelta(0, arguments=cut["arguments"])),
        ]

    def _named(self, text: str) -> list[StreamDelta]:
        out = []
        if self.num_calls == 0:
            self.num_calls = 1
            out.append(StreamDelta(tool_call=ToolCallDelta(0, self.id_factory(), self.choice.function)))
        if text:
            out.append(StreamDelta(tool_call=ToolCallDelta(0, arguments=text)))
        return out

    def _element(self, text: str) -> list[StreamDelta]:
        try:
            call = json.loads(text)
            name, arguments = call["name"], dump_arguments(call["parameters"])
        except (ValueError, KeyError, TypeError):  # the grammar admits no such element
            return []
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [
            StreamDelta(tool_call=ToolCallDelta(index, self.id_factory(), name)),
            StreamDelta(tool_call=ToolCallDelta(index, arguments=arguments)),
        ]


class _ArrayElements:
    """Splits a streamed JSON array of objects into each object's text as it completes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.element: list[str] = []

    @property
    def partial(self) -> str:
        """The text of the element begun and not yet complete ("" between elements)."""
        return "".join(self.element)

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.element.append(ch)
            if self.in_string:
                self.in_string = self.escaped or ch != '"'
                self.escaped = not self.escaped and ch == "\\"
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    done.append("".join(self.element))
                    self.element = []
        return done

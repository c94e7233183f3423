"""``%%generate`` constraint flags -> a ``ResponseFormat``: what the output must match, and how
the finished text becomes ``.parsed``.

    --schema VAR         a Pydantic model class or a JSON Schema dict   (.parsed: the object)
    --json               any JSON object                                (.parsed: a dict)
    --regex PATTERN      the whole output matches                       (.parsed: None)
    --choice TEXT ...    exactly one of these (repeatable, or one VAR holding a list)
    --grammar VAR|TEXT   a Lark or GBNF grammar (a variable holding it, or the text itself)
    --compact-json       with --schema/--json: no whitespace between JSON tokens (the default
                         now: ``ResponseFormat.of`` is compact; kept for existing cells)

At most one per cell. Everything here runs on the kernel thread, before the request is queued:
a constraint that cannot be compiled is the cell's ``UsageError``, never the engine's error.
"""

from __future__ import annotations

import dataclasses

from IPython.core.error import UsageError

from vllm_mlx.structured.params import StructuredOutputsParams
from vllm_mlx.structured.response_format import ResponseFormat

FLAGS = ("schema", "json", "regex", "choice", "grammar")


def response_format(args, namespace: dict) -> ResponseFormat | None:
    """The cell's constraint, or None without one.

    Raises:
        UsageError: Two constraints, a name that is not a variable, or a value of the wrong kind.
    """
    given = [flag for flag in FLAGS if getattr(args, flag) not in (None, False)]
    if len(given) > 1:
        raise UsageError(f"%%generate: give one constraint, not {' and '.join('--' + f for f in given)}")
    if args.compact_json and given not in (["schema"], ["json"]):
        raise UsageError("%%generate: --compact-json goes with --schema or --json")
    if not given:
        return None
    flag = given[0]
    try:
        fmt = _format(flag, args, namespace)
    except ValueError as exc:
        raise UsageError(f"%%generate --{flag}: {exc}") from None
    if args.compact_json:  # whitespace is the one free choice a small model can loop on
        return ResponseFormat(dataclasses.replace(fmt.params, disable_any_whitespace=True), fmt.parse)
    return fmt


def _format(flag: str, args, namespace: dict) -> ResponseFormat:
    if flag == "schema":
        return ResponseFormat.of(variable("--schema", args.schema, namespace))
    if flag == "json":
        return ResponseFormat.of({"type": "json_object"})
    return ResponseFormat(StructuredOutputsParams(**{flag: _value(flag, args, namespace)}), _no_parse)


def compile_check(engine, fmt: ResponseFormat) -> None:
    """Compile the constraint now (on this thread; the engine caches it by content for the
    request), so that a bad schema, regex or grammar is the cell's error, named."""
    from vllm_mlx.core.request import SamplingParams

    try:
        engine.compile_constraint(SamplingParams(structured_outputs=fmt.params))
    except ValueError as exc:  # ConstraintError: one line saying what is wrong
        raise UsageError(f"%%generate --{_flag_of(fmt.params)}: {exc}") from None


def _value(flag: str, args, namespace: dict) -> str | list[str]:
    value = getattr(args, flag)
    if flag == "choice" and len(value) == 1 and _is_variable(value[0], namespace, (list, tuple)):
        return list(namespace[value[0]])
    if flag == "grammar" and _is_variable(value, namespace, str):
        return namespace[value]
    return value


def variable(flag: str, name: str, namespace: dict) -> object:
    """The notebook variable a flag names; a ``UsageError`` when there is none."""
    if name not in namespace:
        raise UsageError(f"%%generate {flag} {name}: no variable of that name in the notebook")
    return namespace[name]


def _is_variable(name: str, namespace: dict, kinds) -> bool:
    return name.isidentifier() and isinstance(namespace.get(name), kinds)


def _flag_of(params: StructuredOutputsParams) -> str:
    return {"json": "schema", "json_object": "json"}.get(params.kind, params.kind)


def _no_parse(text: str) -> None:
    """A regex, choice or grammar output is its text: nothing to parse."""
    return None

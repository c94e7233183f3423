"""Refuse constraints whose repetition bounds would cost unbounded memory or time to compile.

llguidance 1.7 unrolls a JSON Schema's ``maxItems`` into grammar rules while it builds a
matcher: ~9 us and ~0.7-1.2 KB per item (``maxItems: 1000000`` takes 9 s and 1.2 GB before it is
refused as "too big"; ``1e9`` would take ~1 TB). ``minItems`` costs ~0.4 us and ~50 bytes per
item, and a regex repetition (``a{1000000}`` in a ``pattern``, a regex constraint or a Lark
``/.../``) costs ~0.4 s and ~100 MB later, at the first mask, on the engine thread
(docs/structured_outputs.md has the table). Nesting does not multiply the cost (every array
node is its own rule), but every node adds its own, so the walk caps both:

- each bound (``minItems``, ``maxItems``, ``minContains``, ``maxContains``, ``minLength``,
  ``maxLength``, ``minProperties``, ``maxProperties``, the length of ``prefixItems``, and every
  ``{n}``/``{n,m}`` count in a regex, ``pattern`` or Lark/GBNF grammar) at ``max_bound``;
- their sum over the whole constraint at ``TOTAL_FACTOR * max_bound``.

Pure Python and linear in the constraint's size; it runs before anything is compiled. What it
misses is still contained by ``compile_guard.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from vllm_mlx.structured.params import StructuredOutputsParams

DEFAULT_MAX_CONSTRAINT_BOUND = 10_000
"""The largest repetition bound one constraint may hold (``--max-constraint-bound``):
``maxItems: 10000`` compiles in ~70 ms and ~10 MB."""

TOTAL_FACTOR = 10
"""All the bounds of one constraint may add up to this many times the per-bound limit."""

FLAG = "--max-constraint-bound"

_COUNT_KEYWORDS = (
    "minItems", "maxItems", "minContains", "maxContains",
    "minLength", "maxLength", "minProperties", "maxProperties",
)  # fmt: skip
_PATTERN_KEYWORDS = ("pattern",)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Values that are data, not schemas: a ``maxItems`` key inside them bounds nothing."""

# ``{n}``, ``{n,}`` or ``{n,m}`` not escaped (an even run of backslashes before the brace).
_REPETITION = re.compile(r"(?<!\\)(?:\\\\)*\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_JSON_IN_LARK = re.compile(r"%json\s*(?=\{)")


class BoundExceeded(ValueError):
    """A bound over the limit; the message names it, the limit and the flag that raises it."""


@dataclass
class _Tally:
    """The bounds seen so far in one constraint."""

    max_bound: int
    total: int = 0

    def add(self, where: str, value: int) -> None:
        if value > self.max_bound:
            raise BoundExceeded(
                f"{where} is {value}, over the limit of {self.max_bound} on repetition bounds in a "
                f"constraint ({FLAG}; large bounds cost the server memory and time to compile)"
            )
        self.total += value
        limit = TOTAL_FACTOR * self.max_bound
        if self.total > limit:
            raise BoundExceeded(
                f"the repetition bounds of this constraint add up to more than {limit} "
                f"({TOTAL_FACTOR} x {FLAG}={self.max_bound}; each costs the server memory and time to compile)"
            )


def check_bounds(params: StructuredOutputsParams, max_bound: int = DEFAULT_MAX_CONSTRAINT_BOUND) -> None:
    """Raise ``BoundExceeded`` when ``params`` holds a bound over ``max_bound`` (or its
    bounds add up to more than ``TOTAL_FACTOR * max_bound``)."""
    tally = _Tally(max_bound)
    kind = params.kind
    if kind == "json":
        value = params.json
        _walk_schema(json.loads(value) if isinstance(value, str) else value, tally)
    elif kind == "regex":
        _scan_repetitions("regex", params.regex, tally)
    elif kind == "grammar":
        _scan_grammar(params.grammar, tally)
    if params.whitespace_pattern is not None:
        _scan_repetitions("whitespace_pattern", params.whitespace_pattern, tally)


def _walk_schema(node: object, tally: _Tally) -> None:
    # Iterative: a deeply nested schema must not hit Python's recursion limit here.
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in _COUNT_KEYWORDS:
            count = node.get(key)
            if isinstance(count, (int, float)) and not isinstance(count, bool):
                tally.add(key, _as_count(count))
        for key in ("prefixItems", "items"):
            if isinstance(node.get(key), list):  # a tuple: one rule per position
                tally.add(f"{key} (length)", len(node[key]))
        for key in _PATTERN_KEYWORDS:
            if isinstance(node.get(key), str):
                _scan_repetitions(key, node[key], tally)
        if isinstance(node.get("patternProperties"), dict):
            for pattern in node["patternProperties"]:
                _scan_repetitions("patternProperties", pattern, tally)
        stack.extend(value for key, value in node.items() if key not in _DATA_KEYWORDS)


def _as_count(value: int | float) -> int:
    """A bound as an int; infinities and NaN count as over any limit."""
    if isinstance(value, float) and not value < float("inf"):
        return 1 << 62
    return max(0, int(value))


def _scan_repetitions(where: str, text: str, tally: _Tally) -> None:
    """Every ``{n}`` / ``{n,m}`` count in a regex (or a grammar's text)."""
    for match in _REPETITION.finditer(text):
        for digits in match.groups():
            if digits:
                # Digits past the limit's length are over it: int() of a huge string is slow.
                value = int(digits) if len(digits) <= 18 else 1 << 62
                tally.add(f"a {{n,m}} count in {where}", value)


def _scan_grammar(text: str, tally: _Tally) -> None:
    """A Lark (or GBNF) grammar: its ``x{n,m}`` ranges and regexes, and the JSON Schemas of its
    ``%json {...}`` rules."""
    decoder = json.JSONDecoder()
    rest = []
    position = 0
    for match in _JSON_IN_LARK.finditer(text):
        if match.start() < position:
            continue  # inside a schema already walked
        try:
            schema, end = decoder.raw_decode(text, match.end())
        except ValueError:
            continue  # not JSON: the compiler reports it
        rest.append(text[position : match.start()])
        _walk_schema(schema, tally)
        position = end
    rest.append(text[position:])
    _scan_repetitions("grammar", "".join(rest), tally)

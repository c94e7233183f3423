"""How an option is declared and read: ``Option`` (a field's metadata) and ``option(...)``; the
units and their parsers (sizes and durations are parsed here and nowhere else); the checks of a
value and of a keyword's name; argparse flags from the declarations.

The declarations themselves are ``EngineConfig`` and ``ServingOptions`` (``vllm_mlx.config``).
Pure Python, no imports of ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

# Surfaces: where an option shows besides ``EngineConfig(...)``/``LLM(...)``.
ENGINE = "engine"
"""The engine flags ``vllm-mlx generate`` and ``serve`` share."""
SERVE = "serve"
"""Flags of ``vllm-mlx serve`` only."""
BENCH = "bench"
"""Flags of ``vllm-mlx bench``."""
NOTEBOOK = "notebook"
"""``%vllm_mlx load --flag`` in a notebook."""

ENGINE_GROUP = "engine"
DISTRIBUTED_GROUP = "tensor and pipeline parallelism (docs/distributed.md)"

# Units: how a value given as text (a flag, ``LLM(kv_cache_memory="512M")``) is read.
BYTES = "bytes"
"""A size: an int of bytes or text like ``512M`` (``parse_bytes``)."""
MEMORY = "memory"
"""A size, or a fraction of the available memory (``parse_memory``)."""
SECONDS = "seconds"
"""A duration in seconds (``parse_seconds``)."""

_SAME = "same as the field"  # Option.cli_default when the flag's default is the field's


@dataclass(frozen=True)
class Option:
    """How one config field shows on every surface. Lives in the field's metadata (``option``)."""

    help: str
    """The flag's ``--help`` text (plain text: a ``%`` is escaped for argparse here)."""
    doc: str = ""
    """The meaning in the docs' tables (Markdown); empty = ``help``."""
    surfaces: frozenset[str] = frozenset()
    unit: str = ""
    minimum: int | float | None = None
    """Values below are refused by ``normalize`` (for ``SECONDS``: values not above it)."""
    flag: str = ""
    """The flag when it is not ``--field-name``."""
    cli_default: Any = _SAME
    """The flag's default when not the field's: None = unset, the config keeps its default."""
    choices: tuple[str, ...] | Any = ()
    """The values allowed, or a function that returns them (read when a parser is built)."""
    metavar: str | None = None
    group: str | None = ENGINE_GROUP
    """The ``--help`` section of the flag (None: the command's own options)."""
    parse: Any = None
    """How the flag's text is read when the type and unit do not say (e.g. ``parse_count``)."""
    doc_flag: str = ""
    """The docs' "CLI flag" cell when the generated one would not say it all."""


def option(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
           surfaces: tuple[str, ...] = (), **details: Any) -> Any:  # fmt: skip
    """A dataclass field declared with its ``Option`` (see there for ``details``)."""
    meta = {"option": Option(help=help, surfaces=frozenset(surfaces), **details)}
    return field(default=default, default_factory=default_factory, metadata=meta)


def options_of(cls) -> list[tuple[dataclasses.Field, Option]]:
    """The declared fields of a config dataclass, in order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def field_default(f: dataclasses.Field) -> Any:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


# -- sizes and durations: parsed here only -----------------------------------------------------

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """A size: an int of bytes, or text like ``"512M"``, ``"2G"``, ``"1.5GB"``, ``"4096"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r} (e.g. 512M, 2G, or an int of bytes)")
    text = value.strip().upper().removesuffix("B")
    try:
        if text[-1:] in _UNITS:
            return int(float(text[:-1]) * _UNITS[text[-1]])
        return int(text)
    except ValueError:
        raise ValueError(f"not a size: {value!r} (e.g. 512M, 2G, or an int of bytes)") from None


def parse_memory(value: str | int | float) -> int | float:
    """A memory budget: a size (see ``parse_bytes``) or a fraction of available memory
    (a float, or text like ``"0.3"``)."""
    if isinstance(value, float):
        return value
    if isinstance(value, str) and "." in value and not value.strip()[-1:].isalpha():
        try:
            return float(value)
        except ValueError:
            pass
    return parse_bytes(value)


def parse_seconds(text: str) -> float:
    """A duration given as text: a number of seconds >= 0 (``"0.5"``, ``"60"``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise ValueError(f"must be >= 0, got {text}")
    return value


def parse_count(text: str) -> int:
    """A count given as text: an int >= 1 (``"4"``)."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not an int: {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def is_seconds(value: object, minimum: float = 0) -> bool:
    """A duration as the config holds it: a number (not a bool) above ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > minimum


def argparse_type(parse):
    """``parse`` as an argparse ``type``: its ``ValueError`` becomes argparse's usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__  # argparse names the type in "invalid ... value"
    convert.__doc__ = parse.__doc__
    return convert


_TEXT_PARSERS = {BYTES: parse_bytes, MEMORY: parse_memory, SECONDS: parse_seconds}


def checked_value(f: dataclasses.Field, opt: Option, value: Any) -> Any:
    """``value`` of field ``f`` in its canonical form (sizes parsed), or ``ValueError`` naming it."""
    name, kind = f.name, str(f.type)
    if value is None and kind.endswith("| None"):
        return value
    if opt.unit in (BYTES, MEMORY):
        try:
            size = _TEXT_PARSERS[opt.unit](value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if opt.minimum is not None and isinstance(size, int) and size < opt.minimum:
            raise ValueError(f"{name} must be a size of at least {opt.minimum} bytes, got {value!r}")
        return size
    if opt.unit == SECONDS:
        if not is_seconds(value, opt.minimum or 0):
            raise ValueError(f"{name} must be a number of seconds > {opt.minimum or 0:g}, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    elif kind.startswith("int") and opt.minimum is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < opt.minimum:
            raise ValueError(f"{name} must be an int >= {opt.minimum}, got {value!r}")
    return value


def apply_options(config, overrides: dict, what: str = "engine option") -> None:
    """Set ``overrides`` (field name -> value) on the dataclass ``config``; an unknown name is a
    ``TypeError`` naming the close ones (``max_num_seq`` -> ``max_num_seqs``)."""
    check_option_names(type(config), overrides, what)
    for name, value in overrides.items():
        setattr(config, name, value)


def check_option_names(cls, names, what: str = "engine option") -> None:
    """``TypeError`` for the first of ``names`` that is not a field of ``cls``, naming the close ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    for name in names:
        if name not in known:
            raise TypeError(unknown_option_message(name, known, what))


def unknown_option_message(name: str, known: list[str], what: str = "engine option") -> str:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"unknown {what} {name!r}{hint}"


# -- argparse: flags from the declarations ------------------------------------------------------


def flag_of(f: dataclasses.Field, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def cli_default(f: dataclasses.Field, opt: Option) -> Any:
    return field_default(f) if opt.cli_default is _SAME else opt.cli_default


def add_arguments(parser: argparse.ArgumentParser, cls, surface: str) -> None:
    """Add a flag for every option of ``cls`` shown on ``surface``, each in its ``--help``
    section (``Option.group``). Bools default on get ``--x/--no-x``; bools default off, ``--x``."""
    for f, opt in options_of(cls):
        if surface in opt.surfaces:
            target = parser if opt.group is None else argument_group(parser, opt.group)
            target.add_argument(flag_of(f, opt), dest=f.name, **_argparse_kwargs(f, opt))


def _argparse_kwargs(f: dataclasses.Field, opt: Option) -> dict:
    default = cli_default(f, opt)
    kwargs: dict[str, Any] = {"default": default, "help": opt.help.replace("%", "%%")}
    if str(f.type) == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        return kwargs
    if opt.parse:
        kwargs["type"] = argparse_type(opt.parse)
    elif opt.unit:
        kwargs["type"] = argparse_type(_TEXT_PARSERS[opt.unit])
    elif str(f.type).startswith("int"):
        kwargs["type"] = int
    if opt.choices:
        kwargs["choices"] = list(opt.choices() if callable(opt.choices) else opt.choices)
    if opt.metavar:
        kwargs["metavar"] = opt.metavar
    return kwargs


def argument_group(parser: argparse.ArgumentParser, title: str):
    """The parser's ``--help`` section called ``title``, made on first use."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def options_from_args(args: argparse.Namespace, cls, surface: str) -> dict:
    """The fields of ``cls`` that ``surface``'s flags set (a flag left unset keeps the default)."""
    values = {f.name: getattr(args, f.name) for f, opt in options_of(cls) if surface in opt.surfaces}
    return {name: value for name, value in values.items() if value is not None}

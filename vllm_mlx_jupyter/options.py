"""Engine options on a magic line: ``%vllm_mlx load [MODEL] [--num-kv-blocks 256 ...]``.

Flags are derived from ``EngineConfig``'s fields (``--max-num-seqs``, ``--block-size``,
``--kv-cache-memory 512M``, ``--no-enable-prefix-caching``, ...), so new engine options appear
here without changes. Values parse as int, then float, then a size (``512M``, ``2G``), then text.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from IPython.core.error import UsageError

_SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message}\n\n{self.format_help()}")


def parse_value(text: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    unit = text.strip().upper().removesuffix("B")
    if unit[-1:] in _SIZES:
        try:
            return int(float(unit[:-1]) * _SIZES[unit[-1]])
        except ValueError:
            pass
    return text


def load_parser() -> argparse.ArgumentParser:
    from vllm_mlx.engine_core import EngineConfig

    parser = _Parser(prog="%vllm_mlx load", add_help=False,
                     description="Load a model (default: the configured one) and start the engine.")  # fmt: skip
    parser.add_argument("model", nargs="?", help="MLX directory, .gguf file, hub id or 'default'")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        if hints[field.name] is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=field.name, type=parse_value, default=None, metavar="VALUE")
    return parser


def parse_load(argv: list[str]) -> tuple[str | None, dict]:
    """(model or None, EngineConfig options given on the line)."""
    args = load_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k != "model" and v is not None}
    return args.model, options

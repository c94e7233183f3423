"""Engine options on a magic line: ``%vllm_mlx load [MODEL] [--num-kv-blocks 256 ...]``.

The flags are ``EngineConfig``'s options declared for the notebook (``vllm_mlx/config/``:
``--max-num-seqs``, ``--block-size``, ``--kv-cache-memory 512M``, ``--no-enable-prefix-caching``,
...), so new engine options appear here without changes. Every flag takes ``VALUE`` as text and
``EngineConfig.normalize`` reads it (sizes like ``512M``, numbers, names); bools are
``--x/--no-x``.
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message}\n\n{self.format_help()}")


def parse_value(text: str) -> int | float | str:
    """A flag's text as the config takes it: an int, else a float, else the text itself
    (sizes such as ``512M`` stay text: ``EngineConfig.normalize`` parses them)."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def load_parser() -> argparse.ArgumentParser:
    from vllm_mlx.config import EngineConfig
    from vllm_mlx.config.options import NOTEBOOK, options_of

    parser = _Parser(prog="%vllm_mlx load", add_help=False,
                     description="Load a model (default: the configured one) and start the engine.")  # fmt: skip
    parser.add_argument("model", nargs="?", help="MLX directory, .gguf file, hub id or 'default'")
    for field, option in options_of(EngineConfig):
        if NOTEBOOK not in option.surfaces:
            continue
        flags = ["--" + field.name.replace("_", "-")]
        if option.flag and option.flag not in flags:
            flags.append(option.flag)  # the CLI's own name for it too (``--kv-disk``)
        if str(field.type) == "bool":
            parser.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                                help=option.help)  # fmt: skip
        else:
            parser.add_argument(*flags, dest=field.name, type=parse_value, default=None, metavar="VALUE",
                                help=option.help)  # fmt: skip
    return parser


def parse_load(argv: list[str]) -> tuple[str | None, dict]:
    """(model or None, EngineConfig options given on the line)."""
    args = load_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k != "model" and v is not None}
    return args.model, options

"""The docs' configuration tables, generated from the declarations: ``<!-- generated: NAME -->``
... ``<!-- end generated -->`` in a page holds ``GENERATED_TABLES[NAME]()``.
``python -m vllm_mlx.config --write docs/configuration.md`` rewrites them; a test checks them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from vllm_mlx.config import BENCH, ENGINE, SERVE, EngineConfig, ServingOptions
from vllm_mlx.config.options import Option, cli_default, field_default, flag_of, options_of
from vllm_mlx.core.fields import field_doc
from vllm_mlx.core.request import SamplingParams
from vllm_mlx.core.sched.scheduler import SchedulerConfig


def _code(value: Any) -> str:
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    return f"`{text}`"


def _meaning(opt: Option) -> str:
    return opt.doc or opt.help


def _flag_cell(f: dataclasses.Field, opt: Option) -> str:
    if opt.doc_flag:
        return opt.doc_flag
    if not opt.surfaces & {ENGINE, SERVE}:
        return "—"
    flag = flag_of(f, opt)
    if str(f.type) == "bool" and field_default(f):
        return f"`{flag}` / `--no-{flag[2:]}`"
    return f"`{flag}`" if ENGINE in opt.surfaces else f"`{flag}` (`serve` only)"


def config_table(cls) -> list[str]:
    """The docs' table of a config dataclass: field, type, default, CLI flag, meaning."""
    rows = ["| field | type | default | CLI flag | meaning |", "| --- | --- | --- | --- | --- |"]
    for f, opt in options_of(cls):
        rows.append(f"| `{f.name}` | `{f.type}` | {_code(field_default(f))} | {_flag_cell(f, opt)} | {_meaning(opt)} |")
    return rows


def described_table(cls) -> list[str]:
    """The docs' table of a ``core`` dataclass whose fields are ``described`` (``core/fields.py``):
    field, type, default, meaning; ``ValueError`` names a field declared without a meaning."""
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        rows.append(f"| `{f.name}` | `{f.type}` | {_code(field_default(f))} | {field_doc(f)} |")
    return rows


def flags_table(classes: list, surface: str, meaning: str = "help") -> list[str]:
    """The docs' table of ``surface``'s flags declared on ``classes``: flag, default, meaning
    (the ``--help`` text, or with ``meaning="doc"`` the docs' longer one)."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for cls in classes:
        for f, opt in options_of(cls):
            if surface in opt.surfaces:
                rows.append(_flag_row(cls, f, opt, meaning))
    return rows


def _flag_row(cls, f: dataclasses.Field, opt: Option, meaning: str) -> str:
    flag, default = flag_of(f, opt), cli_default(f, opt)
    names = f"`{flag}` / `--no-{flag[2:]}`" if str(f.type) == "bool" and default else f"`{flag}`"
    text = opt.doc or opt.help if meaning == "doc" else opt.help
    if default is None and field_default(f) is not None and "default" not in text:
        text += f" (unset: `{cls.__name__}.{f.name}`, {_code(field_default(f))})"
    return f"| {names} | {_code(default)} | {text} |"


GENERATED_TABLES = {
    "engine-config": lambda: config_table(EngineConfig),
    "scheduler-config": lambda: described_table(SchedulerConfig),
    "sampling-params": lambda: described_table(SamplingParams),
    "engine-flags": lambda: flags_table([EngineConfig], ENGINE),
    "serve-options": lambda: flags_table([ServingOptions, EngineConfig], SERVE, meaning="doc"),
    "bench-flags": lambda: flags_table([EngineConfig], BENCH),
}
"""The docs' generated tables by name: ``<!-- generated: NAME -->`` ... ``<!-- end generated -->``
in a page holds ``GENERATED_TABLES[NAME]()``."""


def markdown_tables() -> dict[str, str]:
    """Every generated table, as Markdown text, by name."""
    return {name: "\n".join(make()) for name, make in GENERATED_TABLES.items()}


def replace_tables(page: str) -> str:
    """``page`` (Markdown) with every generated table rewritten from the declarations."""
    lines, out, skipping = page.splitlines(), [], False
    tables = markdown_tables()
    for line in lines:
        if line.startswith("<!-- generated: "):
            name = line.removeprefix("<!-- generated: ").removesuffix(" -->")
            out += [line, tables[name]]
            skipping = True
        elif line == "<!-- end generated -->":
            out.append(line)
            skipping = False
        elif not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_mlx.config", description="The generated docs tables.")
    parser.add_argument("--markdown", action="store_true", help="print every generated table")
    parser.add_argument("--write", metavar="PAGE", nargs="*", default=[], help="rewrite the tables in these pages")
    args = parser.parse_args(argv)
    for page in args.write:
        Path(page).write_text(replace_tables(Path(page).read_text()))
    if args.markdown or not args.write:
        for name, table in markdown_tables().items():
            print(f"<!-- generated: {name} -->\n{table}\n<!-- end generated -->\n")
    return 0



"""The docs site: it builds strictly, its tables match the code, and every guide's code runs.

- ``mkdocs build --strict`` into a temporary directory: a broken link or anchor, a page missing
  from the nav or an unresolvable API reference fails the build.
- The configuration reference's tables are checked against the dataclasses and the ``argparse``
  parsers (names, types, defaults), the environment variables against the source.
- The API reference covers every name in ``vllm_mlx.__all__`` and ``LLM``.
- Every ```` ```python ````, ```` ```ipython ```` (notebook cells) and ```` ```bash ```` block under ``docs/`` runs, unless the line
  before its fence is a marker:

  ``<!-- not-run: REASON -->``
      shown, not run (installs, commands that need root or a GPU, servers that block).
  ``<!-- background: REASON -->``
      a one-line ``vllm-mlx serve ...`` command, started before the page's other blocks with a
      free ``--port`` appended; the test waits for ``/health``, and rewrites ``127.0.0.1:8000``
      in the page's blocks to that port.

  A page's Python blocks run in order in one fresh interpreter (one namespace, as a reader
  pasting them one after another), in a temporary working directory; each bash block runs on its
  own with ``bash -euo pipefail``, before the Python blocks. So a page's shell and Python blocks
  must not depend on each other.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import free_port, wait_for_health

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
RUNNABLE = ("python", "bash", "ipython")
PLUGIN_NAMES = {"MLXPlatform": "vllm_mlx.vllm_platform", "MLXWorker": "vllm_mlx.worker"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[a-z-]+)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")


# -- reading the docs ---------------------------------------------------------------------------


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    lang: str
    code: str
    marker: str | None = None
    reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUNNABLE and self.marker is None


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the marker comment before each, if any."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", lines[end]):
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = MARKER.match(before)
        blocks.append(
            Block(
                path, i + 2, match["info"].lower(), "\n".join(body) + "\n",
                marker["kind"] if marker else None, marker["reason"] if marker else None,
            )  # fmt: skip
        )
        i = end + 1
    return blocks


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def pages_with_code() -> list[Path]:
    return [page for page in doc_pages() if any(b.runs or b.marker == "background" for b in code_blocks(page))]


def split_row(row: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside a code span does not split."""
    cells, cell, in_code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    cells.append(cell.strip())
    return cells


def table_after(page: str, heading: str) -> list[dict[str, str]]:
    """The rows (header -> cell) of the first table after the line ``heading``."""
    lines = (DOCS / page).read_text().splitlines()
    assert heading in lines, f"{page} has no heading {heading!r}"
    i = lines.index(heading) + 1
    while not lines[i].startswith("|"):
        assert not lines[i].startswith("#"), f"{page}: no table under {heading!r}"
        i += 1
    header = split_row(lines[i])
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, split_row(line))))
    return rows


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def documented_default(cell: str):
    text = code_spans(cell)[0]
    if text.startswith("$"):  # an environment variable's value, or None when unset
        return os.environ.get(text[1:])
    return ast.literal_eval(text)


# -- the site builds ----------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    for page in ["index.html", "api/llm/index.html", "benchmarks/index.html", "configuration/index.html"]:
        assert (tmp_path / "site" / page).is_file(), page
    llm_page = (tmp_path / "site" / "api/llm/index.html").read_text()
    assert "vllm_mlx.llm.LLM.generate" in llm_page  # mkdocstrings rendered the class and its methods


def test_benchmarks_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert "benchmarks.md" in nav


# -- code blocks ----------------------------------------------------------------------------------


def test_code_block_markers():
    """Markers are known and explained; background blocks are one server command; few not-runs."""
    blocks = [b for page in doc_pages() for b in code_blocks(page)]
    assert any(b.runs for b in blocks)
    for block in blocks:
        if block.marker is None:
            continue
        assert block.marker in ("not-run", "background"), f"{block.where}: unknown marker {block.marker!r}"
        assert block.reason, f"{block.where}: say why ({block.marker}: REASON)"
        assert block.lang in RUNNABLE, f"{block.where}: a marker on a {block.lang or 'plain'} block"
        if block.marker == "background":
            lines = [line for line in block.code.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("vllm-mlx serve"), block.where
            assert "--port" not in lines[0], f"{block.where}: the test picks the port"
    not_run = [b.where for b in blocks if b.marker == "not-run"]
    runs = [b.where for b in blocks if b.runs]
    assert len(not_run) < len(runs) / 2, f"most blocks should run; not run: {not_run}"
    for page in doc_pages():
        assert sum(b.marker == "background" for b in code_blocks(page)) <= 1, page


def run_env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_MLX_API_KEY", None)  # the pages say which key the server wants
    env["HF_HUB_OFFLINE"] = "1"  # the guides never need a model hub
    return env


@contextlib.contextmanager
def background_server(block: Block, port: int, cwd: Path, env: dict):
    command = block.code.strip() + f" --port {port}"
    log_path = cwd / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_health(proc, port, log_path, timeout=180, what=f"{block.where}: `{command}`")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


PYTHON_RUNNER = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for path, line, code in json.load(sys.stdin):
    print(f"----- {path}:{line}", flush=True)
    try:
        exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(f"FAILED: the block at {path}:{line}")
# Leave no engine for interpreter teardown (a reader's script would end the same way).
namespace.clear()
import gc
gc.collect()
"""


IPYTHON_RUNNER = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
for path, line, code in json.load(sys.stdin):
    print(f"----- {path}:{line}", flush=True)
    if not shell.run_cell(code).success:
        sys.exit(f"FAILED: the block at {path}:{line}")
if "vllm_mlx" in shell.magics_manager.magics["line"]:
    shell.run_line_magic("vllm_mlx", "wait")  # the cells' generations must finish cleanly
    shell.run_line_magic("vllm_mlx", "shutdown")
"""


def run_blocks(runner: str, blocks: list[Block], cwd: Path, env: dict) -> None:
    """Run a page's blocks of one language in order, in one fresh interpreter (``runner``)."""
    payload = json.dumps([[str(b.path), b.line, b.code] for b in blocks])
    result = subprocess.run(
        [sys.executable, "-c", runner], input=payload, cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stdout, result.stdout


def run_bash_block(block: Block, cwd: Path, env: dict) -> None:
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{block.where} failed:\n{block.code}\n{result.stdout}\n{result.stderr}"


@pytest.mark.e2e
@pytest.mark.parametrize("page", pages_with_code(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path, default_model_dir):
    """Run the page's code as a reader would (the default model is prepared first, once)."""
    blocks = code_blocks(page)
    env = run_env()
    server = next((b for b in blocks if b.marker == "background"), None)
    runnable = [b for b in blocks if b.runs]
    with contextlib.ExitStack() as stack:
        if server is not None:
            port = free_port()
            stack.enter_context(background_server(server, port, tmp_path, env))
            for block in runnable:
                block.code = block.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        for block in runnable:
            if block.lang == "bash":
                run_bash_block(block, tmp_path, env)
        python = [b for b in runnable if b.lang == "python"]
        if python:
            run_blocks(PYTHON_RUNNER, python, tmp_path, env)
        notebook_cells = [b for b in runnable if b.lang == "ipython"]
        if notebook_cells:
            run_blocks(IPYTHON_RUNNER, notebook_cells, tmp_path, env)  # magics included


# -- the configuration reference matches the code -------------------------------------------------


def check_dataclass_table(cls, heading: str) -> None:
    rows = {code_spans(row["field"])[0]: row for row in table_after("configuration.md", heading)}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(rows) == list(fields), f"{heading}: documented {list(rows)}, code has {list(fields)}"
    for name, field in fields.items():
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        assert documented_default(rows[name]["default"]) == default, f"{cls.__name__}.{name} default"
        assert code_spans(rows[name]["type"])[0] == field.type, f"{cls.__name__}.{name} type"


def test_engine_config_table():
    from vllm_mlx.engine_core import EngineConfig

    check_dataclass_table(EngineConfig, "## `EngineConfig`")
    serve_flags = {flag for flags in parser_flags(subcommands()["serve"]) for flag in flags}
    for row in table_after("configuration.md", "## `EngineConfig`"):
        for flag in (span for span in code_spans(row["CLI flag"]) if span.startswith("--")):
            assert flag in serve_flags, f"EngineConfig table: no CLI flag {flag}"


def test_scheduler_config_table():
    from vllm_mlx.scheduler import SchedulerConfig

    check_dataclass_table(SchedulerConfig, "## `SchedulerConfig`")


def test_sampling_params_table():
    from vllm_mlx.request import SamplingParams

    check_dataclass_table(SamplingParams, "## `SamplingParams`")


def parser_flags(parser) -> dict[frozenset[str], object]:
    """Option strings (or the positional's metavar) -> default, for every visible argument."""
    import argparse

    flags = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        key = action.option_strings or [action.metavar or action.dest.upper()]
        flags[frozenset(key)] = action.default
    return flags


def documented_flags(*headings: str) -> dict[frozenset[str], object]:
    flags = {}
    for heading in headings:
        for row in table_after("configuration.md", heading):
            names = frozenset(span.removesuffix("...") for span in code_spans(row["flag"]))
            flags[names] = documented_default(row["default"])
    return flags


def subcommands() -> dict:
    import argparse

    from vllm_mlx.entrypoints.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize(
    "command, headings",
    [
        ("generate", ["### Engine flags (`generate` and `serve`)", "### `vllm-mlx generate`"]),
        ("serve", ["### Engine flags (`generate` and `serve`)", "### `vllm-mlx serve`"]),
        ("pull", ["### `vllm-mlx pull`"]),
        ("demo", ["### `vllm-mlx demo`"]),
        ("models", ["### `vllm-mlx models`"]),
    ],
)
def test_cli_flags_table(command, headings):
    actual = parser_flags(subcommands()[command])
    documented = documented_flags(*headings)
    assert set(documented) == set(actual), f"vllm-mlx {command}: docs {set(documented)} != code {set(actual)}"
    for flags, default in actual.items():
        assert documented[flags] == default, f"vllm-mlx {command} {sorted(flags)}: default {default!r}"


def test_bench_flags_table():
    from vllm_mlx.entrypoints.bench import build_parser

    actual = parser_flags(build_parser())
    documented = documented_flags("### `vllm-mlx bench`")
    assert documented == actual


def test_environment_variables_are_documented():
    used = set()
    for source in (ROOT / "vllm_mlx").rglob("*.py"):
        used |= set(re.findall(r"VLLM_MLX_[A-Z_]+", source.read_text()))
    rows = table_after("configuration.md", "## Environment variables")
    documented = {code_spans(row["variable"])[0] for row in rows}
    assert used <= documented, f"undocumented: {sorted(used - documented)}"


# -- the API reference covers the public names ---------------------------------------------------


def api_directives() -> set[str]:
    directives = set()
    for page in (DOCS / "api").glob("*.md"):
        directives |= set(re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M))
    return directives


def test_api_reference_covers_every_public_name():
    import importlib.util

    import vllm_mlx

    directives = api_directives()
    index = (DOCS / "api" / "index.md").read_text()
    runner_page = (DOCS / "api" / "runner.md").read_text()
    for name in [*vllm_mlx.__all__, "LLM"]:
        assert f"`{name}`" in index, f"api/index.md does not list {name}"
        if name == "__version__":
            continue
        if name in PLUGIN_NAMES:  # checked by path: importing them needs the `vllm` extra
            target = f"{PLUGIN_NAMES[name]}.{name}"
            assert importlib.util.find_spec(PLUGIN_NAMES[name]) is not None, target
            assert target in directives, f"no `::: {target}` in docs/api/ for vllm_mlx.{name}"
            assert name in runner_page, name
            continue
        obj = getattr(vllm_mlx, name)
        target = f"{obj.__module__}.{obj.__qualname__}"
        assert target in directives, f"no `::: {target}` in docs/api/ for vllm_mlx.{name}"

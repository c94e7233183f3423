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
PLUGIN_NAMES = {"MLXPlatform": "vllm_mlx.plugin.platform", "MLXWorker": "vllm_mlx.plugin.worker"}

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


# -- every page can be found, and none calls a shipped feature unfinished ------------------------


def mkdocs_config() -> dict:
    """``mkdocs.yml`` as data (its ``!!python/name:`` tags read as their names)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def page_names(folder: Path) -> set[str]:
    return {page.relative_to(DOCS).as_posix() for page in folder.glob("*.md")}


def linked_pages(page: Path, rows_under: str | None = None) -> set[str]:
    """The ``.md`` pages ``page`` links to (anchors dropped), relative to ``docs/``; with
    ``rows_under``, only those in the table rows of that section."""
    text = page.read_text()
    if rows_under is not None:
        section = text.split(rows_under, 1)[1].split("\n#", 1)[0]
        text = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    targets = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text)
    return {(page.parent / target).resolve().relative_to(DOCS.resolve()).as_posix() for target in targets}


def test_every_page_is_in_the_nav_and_an_omitted_one_fails_the_build():
    config = mkdocs_config()
    assert config["strict"] is True
    assert config["validation"]["nav"]["omitted_files"] == "warn"  # strict: a page left out fails
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is in the nav twice"
    assert set(listed) == {page.relative_to(DOCS).as_posix() for page in doc_pages()}


def test_every_page_is_on_the_home_table():
    """The home page's table leads to every guide (and the API overview, which leads to the
    API pages): a new page that is not there is a page nobody finds."""
    home = linked_pages(DOCS / "index.md", rows_under="## Where to go next")
    pages = page_names(DOCS) - {"index.md"} | {"api/index.md"}
    assert not pages - home, f"pages missing from the home page's table: {sorted(pages - home)}"
    assert home <= pages, f"the home page's table links elsewhere: {sorted(home - pages)}"
    api_pages = page_names(DOCS / "api") - {"api/index.md"}
    missing = api_pages - linked_pages(DOCS / "api" / "index.md")
    assert not missing, f"API pages missing from api/index.md: {sorted(missing)}"


def test_installation_lists_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = table_after("installation.md", "Extras add the optional parts:")
    documented = sorted(code_spans(row["extra"])[0] for row in rows)
    assert documented == sorted(extras), f"installation.md's extras {documented} != pyproject's {sorted(extras)}"


GENERATED = {"notebooks/quickstart.executed.ipynb"}  # written by `vllm-mlx demo`, not in the repository


def documented_texts() -> list[tuple[Path, str]]:
    return [(path, path.read_text()) for path in [ROOT / "README.md", *doc_pages()]]


REPOSITORY_PATH = re.compile(r"(?<![\w/.-])((?:vllm_mlx|vllm_mlx_jupyter|tests|bench|notebooks|\.ci)/[\w./-]*\w)")


def test_repository_paths_the_docs_name_exist():
    """Files and folders the docs point at (``vllm_mlx/core/kv/spec.py``, ``bench/limits.py``, a test
    file by name) exist: a module or test that moved shows here, not in a reader's terminal."""
    tests = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for path, text in documented_texts():
        for name in REPOSITORY_PATH.findall(text):
            if name not in GENERATED and not (ROOT / name).exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        for name in re.findall(r"(?<![\w/])(test_\w+\.py)", text):
            if name not in tests:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(sorted(set(missing)))


def module_file(parts: list[str]) -> Path | None:
    """The source file of the module ``parts`` names in this repository, or None."""
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def resolve_dotted(name: str) -> str | None:
    """Why the dotted ``name`` (``vllm_mlx.x.y``) does not resolve, or None when it does: its
    longest prefix that is a module of the repository must be below the package (or be
    ``vllm_mlx`` with a public name), and what follows an attribute chain of it."""
    import importlib

    parts = name.split(".")
    i = max(n for n in range(1, len(parts) + 1) if n == 1 or module_file(parts[:n]) is not None)
    module, attributes = ".".join(parts[:i]), parts[i:]
    if not attributes:
        return None
    if module in ("vllm_mlx", "vllm_mlx_jupyter"):
        import vllm_mlx

        public = [*vllm_mlx.__all__, "__all__", "LLM"] if module == "vllm_mlx" else []
        return None if attributes[0] in public else f"no module or public name {attributes[0]}"
    source = module_file(parts[:i]).read_text()
    if re.search(r"^\s*(?:import|from) (?:vllm|torch)\b(?!_mlx)", source, flags=re.M):
        # The plugin's modules import vLLM (a minute to import): read their top-level names instead.
        tree = ast.parse(source)
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        return None if attributes[0] in defined else f"{module} has no {attributes[0]}"
    obj = importlib.import_module(module)
    for attribute in attributes:
        if not hasattr(obj, attribute):
            return f"{module} has no {'.'.join(attributes)}"
        obj = getattr(obj, attribute)
    return None


def test_dotted_names_the_docs_give_exist():
    """Every ``vllm_mlx.x.y`` the README and the docs name (prose and code) imports as written."""
    names = {name for _, text in documented_texts() for name in re.findall(r"\bvllm_mlx(?:_jupyter)?(?:\.\w+)+", text)}
    problems = [f"{name}: {why}" for name in sorted(names) if (why := resolve_dotted(name))]
    assert not problems, "the docs name what the code does not have:\n" + "\n".join(problems)


UNFINISHED = re.compile(r"\bin progress\b|\bcoming soon\b|\bwork in progress\b|\bTODO\b", re.I)
"""Words no page may use: whatever the docs describe is either shipped or named as missing."""

NOT_YET = re.compile(r"\bnot yet\b|\b(?:no|not|n't|never|nothing)\b[^.;:]*\byet\b", re.I)

REFUSAL = re.compile(r"\brefus|\bdoes not support\b|\bnot supported\b", re.I)
"""A sentence that names what the code refuses states a limitation, not an unfinished feature."""

SHIPPED = {
    # what the docs call it -> the code that ships it ("module" or "module:attribute")
    r"notebook|jupyter|%%generate": "vllm_mlx_jupyter",
    r"tool[- ]call|tool use|\btools\b|tool_choice": "vllm_mlx.tool_parsers",
    r"anthropic|/v1/messages|/v1/responses|responses api": "vllm_mlx.entrypoints.anthropic",
    r"\bimages?\b|vision|multimodal|mllm": "vllm_mlx.multimodal.cache",
    r"vllm plugin|platform plugin|vllm serve|vllm\.LLM": "vllm_mlx.plugin.platform",
    r"structured output|json schema|response_format|grammar": "vllm_mlx.structured",
    r"tensor[- ]parallel": "vllm_mlx.engine.core:EngineConfig.tensor_parallel",
    r"pipeline[- ]parallel": "vllm_mlx.engine.core:EngineConfig.pipeline_parallel",
    r"sliding[- ]window": "vllm_mlx.core.kv.spec:SlidingWindowSpec",
    r"prefix (?:reuse|hits?|is resumed)|resum\w* (?:a|the) prefix|state checkpoint": (
        "vllm_mlx.engine.core:EngineConfig.max_state_checkpoints"
    ),
}


def shipped(evidence: str) -> bool:
    import importlib
    import importlib.util

    module, _, attributes = evidence.partition(":")
    if importlib.util.find_spec(module) is None:
        return False
    obj = importlib.import_module(module) if attributes else None
    for name in attributes.split(".") if attributes else []:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def prose_sentences(path: Path) -> list[str]:
    """The sentences of a page outside code blocks (each table row one sentence or more)."""
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", path.read_text(), flags=re.S | re.M)
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines() if paragraph.lstrip().startswith("|") else [paragraph]
        for line in lines:
            sentences += re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[])", " ".join(line.split()))
    return sentences


def test_no_shipped_feature_is_called_unfinished():
    """README and docs never call a page or feature "in progress" (or "coming soon"), and a "not
    yet" never names a feature the code ships (the home page once called the notebook front end
    "in progress"; the README said Qwen3.5 had "no prefix reuse yet" after checkpoints gave it)."""
    for pattern, evidence in SHIPPED.items():
        assert shipped(evidence), f"SHIPPED names {evidence} for {pattern!r}, which is gone: update the table"
    found = []
    for path, _ in documented_texts():
        for sentence in prose_sentences(path):
            where = f"{path.relative_to(ROOT)}: {sentence[:160]}"
            if UNFINISHED.search(sentence):
                found.append(where)
            elif NOT_YET.search(sentence) and not REFUSAL.search(sentence):
                if any(re.search(pattern, sentence, re.I) for pattern in SHIPPED):
                    found.append(where)
    assert not found, "shipped features called unfinished:\n" + "\n".join(found)


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
    from vllm_mlx.engine.core import EngineConfig

    check_dataclass_table(EngineConfig, "## `EngineConfig`")
    serve_flags = {flag for flags in parser_flags(subcommands()["serve"]) for flag in flags}
    for row in table_after("configuration.md", "## `EngineConfig`"):
        for flag in (span for span in code_spans(row["CLI flag"]) if span.startswith("--")):
            assert flag in serve_flags, f"EngineConfig table: no CLI flag {flag}"


def test_scheduler_config_table():
    from vllm_mlx.core.sched.scheduler import SchedulerConfig

    check_dataclass_table(SchedulerConfig, "## `SchedulerConfig`")


def test_sampling_params_table():
    from vllm_mlx.core.request import SamplingParams

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
        ("serve", ["### Engine flags (`generate` and `serve`)", "### `vllm-mlx serve`",
                   "#### Serving options (`ServingOptions`) and the engine's `serve`-only flags"]),  # fmt: skip
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
    documented = documented_flags("### `vllm-mlx bench`", "#### Engine flags of `bench`")
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

"""Every import is declared in the extra that runs it (issue #40).

A user installs ``vllm-mlx`` or one of its extras, never the test suite's packages; an import that
only ``dev`` brings in works in CI and fails on their machine. Two checks, both against the
requirements in the installed metadata (``pyproject.toml`` as pip sees it), closed over their own
dependencies, as pip installs them:

- **Every import statement** (top level, inside functions), read from the source: the package it
  imports is in the standard library, or installed by the extra of the importing module. Lazy
  imports count: they run when the feature runs.
- **Every module imports** in a subprocess that can see only the packages of one extra (a meta-path
  finder hides the rest, as if they were not installed).

An import of another extra's package is allowed only where it is guarded (inside a ``try`` that
catches ``ImportError``), never run (``if TYPE_CHECKING:``) or listed in ``OPTIONAL_IMPORTS`` with the reason it cannot run without it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vllm_mlx", "vllm_mlx_jupyter")
CORE = ""  # the base install: `pip install vllm-mlx`

# The extra a module needs, by the longest matching prefix (everything else: the base install).
EXTRA_OF_MODULE = {
    "vllm_mlx_jupyter": "jupyter",
    "vllm_mlx.entrypoints.openai": "server",
    "vllm_mlx.entrypoints.anthropic": "server",
    "vllm_mlx.entrypoints.request_model": "server",
    "vllm_mlx.entrypoints.content_blocks": "server",
    "vllm_mlx.entrypoints.distributed_serve": "server",
    # The serve command's flags are the CLI's (`vllm-mlx --help` lists them): no server package.
    "vllm_mlx.entrypoints.openai.cli_args": CORE,
    "vllm_mlx.multimodal.vlm_families": "vlm",
    "vllm_mlx.multimodal.vlm_generic": "vlm",
    "vllm_mlx.multimodal.vlm_models": "vlm",
    "vllm_mlx.multimodal.vlm_placeholder": "vlm",
    "vllm_mlx.plugin": "vllm",
    "vllm_mlx.vllm_platform": "vllm",  # the seed's faces of the plugin
    "vllm_mlx.worker": "vllm",
}

# (module, imported package): why the base install may leave it out. Each runs only on a path that
# needs that extra anyway, and says so when it is missing.
OPTIONAL_IMPORTS = {
    ("vllm_mlx.multimodal.images", "PIL"): "images reach the engine only for a vision model (the vlm extra)",
}


def extra_of(module: str) -> str:
    matches = [prefix for prefix in EXTRA_OF_MODULE if module == prefix or module.startswith(prefix + ".")]
    return EXTRA_OF_MODULE[max(matches, key=len)] if matches else CORE


@cache
def installed_by(extra: str) -> frozenset[str]:
    """The distributions ``pip install "vllm-mlx[extra]"`` installs here (canonical names),
    following requirements' extras and markers; vllm-mlx itself included."""
    found: set[str] = set()
    todo = [("vllm-mlx", extra)]
    while todo:
        name, wanted = todo.pop()
        key = f"{canonicalize_name(name)}[{wanted}]"
        if key in found:
            continue
        found.add(key)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not for this platform (its marker held elsewhere)
        for line in requirements:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": wanted}):
                todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
    return frozenset(key.partition("[")[0] for key in found)


@cache
def distributions_of(package: str) -> frozenset[str]:
    """The installed distributions providing a top-level import name (empty: the standard library
    or not installed)."""
    return frozenset(canonicalize_name(d) for d in top_level_packages().get(package, ()))


@cache
def top_level_packages() -> dict[str, list[str]]:
    """Import name -> the distributions providing it (read once: it scans every installed one)."""
    return metadata.packages_distributions()


def _catches_import_error(node: ast.Try) -> bool:
    return any(
        isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError")
        for handler in node.handlers if handler.type is not None for name in ast.walk(handler.type)
    )


def unguarded_imports(tree: ast.AST, guarded: bool = False) -> set[str]:
    """Top-level packages of the absolute imports that run unguarded: not inside a ``try`` that
    catches ``ImportError``, not under ``if TYPE_CHECKING:`` (never run)."""
    if isinstance(tree, ast.Import):
        return set() if guarded else {alias.name.partition(".")[0] for alias in tree.names}
    if isinstance(tree, ast.ImportFrom):
        return set() if guarded or tree.level else {tree.module.partition(".")[0]}
    found = set()
    for field, value in ast.iter_fields(tree):
        inner_guarded = guarded or (
            isinstance(tree, ast.Try) and field == "body" and _catches_import_error(tree)
        ) or (isinstance(tree, ast.If) and field == "body" and "TYPE_CHECKING" in ast.unparse(tree.test))
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                found |= unguarded_imports(child, inner_guarded)
    return found


def module_files() -> dict[str, Path]:
    """Every module of the two packages and its file, programs (``__main__``) left out: importing
    one runs it."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] != "__main__":
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def undeclared_imports() -> list[str]:
    problems = []
    for module, path in module_files().items():
        extra = extra_of(module)
        for package in sorted(unguarded_imports(ast.parse(path.read_text()))):
            if package in PACKAGES or (module, package) in OPTIONAL_IMPORTS:
                continue
            providers = distributions_of(package)
            if providers and not providers & installed_by(extra):  # else stdlib, or installed
                problems.append(f"{module} imports {package} ({', '.join(sorted(providers))}), "
                                f"which `vllm-mlx{f'[{extra}]' if extra else ''}` does not install")
    return problems


def test_every_import_is_installed_by_the_extra_that_runs_it():
    assert undeclared_imports() == []


def test_the_check_finds_an_undeclared_import(monkeypatch):
    """The check is not vacuous: without its reason, the base install's lazy PIL import is reported."""
    monkeypatch.delitem(OPTIONAL_IMPORTS, ("vllm_mlx.multimodal.images", "PIL"))
    assert installed_by(CORE) < installed_by("dev")
    assert "pytest" in installed_by("dev") and "pytest" not in installed_by(CORE)
    assert "mlx-lm" in installed_by(CORE) and "fastapi" in installed_by("server")
    problems = undeclared_imports()
    assert problems and all("PIL" in line for line in problems), problems


# -- every module imports where only its extra is installed -------------------------------------

HIDING_IMPORTER = textwrap.dedent(
    """
    import importlib, importlib.util, json, sys
    from importlib.abc import MetaPathFinder

    hidden, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])

    class NotInstalled(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in hidden:
                raise ModuleNotFoundError(f"No module named {name!r} (hidden: not in this extra)", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):  # what "is it installed?" checks see: nothing there
        return None if name.partition(".")[0] in hidden else real_find_spec(name, package)

    importlib.util.find_spec = find_spec
    failures = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            failures[module] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(failures))
    """
)


def hidden_packages(extra: str) -> list[str]:
    """Top-level import names whose every distribution the extra does not install."""
    installed = installed_by(extra)
    return sorted(
        package
        for package, dists in top_level_packages().items()
        if package.isidentifier() and package.partition(".")[0] not in PACKAGES
        and not {canonicalize_name(d) for d in dists} & installed
    )


@pytest.mark.parametrize("extra", [CORE, "server", "jupyter", "vlm", "vllm"], ids=lambda e: e or "base")
def test_every_module_imports_with_only_its_extra(extra):
    if extra == "vllm":  # CI installs the plugin's stack in an environment of its own (.ci/run)
        pytest.importorskip("vllm", reason="the vllm extra is not installed")
    modules = [m for m in module_files() if extra_of(m) in (CORE, extra)]
    result = subprocess.run(
        [sys.executable, "-c", HIDING_IMPORTER, json.dumps(hidden_packages(extra)), json.dumps(modules)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {}

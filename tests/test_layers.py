"""The layering (issue #26): no module import circles, and the import-linter contracts in
pyproject.toml (`lint-imports`) hold. Counted on the source, as a contributor's change would be."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm_mlx", "vllm_mlx_jupyter")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every module name ``module`` imports: top level, inside functions, under TYPE_CHECKING."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = module_files()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {
        module: {target for name in imported_names(module, path) if (target := owner(name)) not in (None, module)}
        for module, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter = counter + 1
        stack.append(root), on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter = counter + 1
                    stack.append(target), on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while (member := stack.pop()) != node:
                        on_stack.discard(member), component.append(member)
                    on_stack.discard(node), component.append(node)
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_module_import_circles():
    assert circles(import_graph()) == []


def test_import_contracts_hold():
    """pyproject.toml's [tool.importlinter] contracts (layers; core without MLX; nothing below
    the entry points imports them; only the plugin imports torch/vllm; no code imports a face)."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [lint, "--no-cache"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def engine_reach_ins() -> list[str]:
    """``x.call(lambda ...)`` outside ``engine/async_engine.py``: a caller reaching into the
    ``EngineCore`` on its thread instead of using a read the engine offers."""
    found = []
    for module, path in module_files().items():
        if module == "vllm_mlx.engine.async_engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "call"
                    and node.args and isinstance(node.args[0], ast.Lambda)):  # fmt: skip
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    return found


def test_observers_use_the_engines_reads_not_call_lambda():
    """Observers read the engine through the typed reads it offers (``snapshot()``, ``stats()``,
    ``recent_step_records()``, ``model_path``, ...), never ``engine.call(lambda core: ...)``
    (issue #26: no caller reaches into ``EngineCore``); only ``AsyncEngineCore`` itself does."""
    assert engine_reach_ins() == []

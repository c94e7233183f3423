"""The README's quick start stays true: CI runs both its commands verbatim, as a new user would."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line.strip() for block in blocks[:2] for line in block.splitlines() if line.strip()]


def test_quick_start_is_two_commands():
    install_and_run, install_and_test = readme_commands()
    assert install_and_run.startswith("pip install") and "vllm-mlx demo" in install_and_run
    assert install_and_test.startswith("pip install") and "pytest" in install_and_test


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readme_commands_as_a_new_user_would():
    """CI's first install is the quick start, verbatim, in a fresh virtual environment with an
    empty model cache; then the test command verbatim; the vLLM plugin's stack only after both."""
    install_and_run, install_and_test = readme_commands()
    lines = ci_lines()
    installs = [i for i, line in enumerate(lines) if re.match(r"(pip|apt-get) install", line)]
    venv = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    activate = next(i for i, line in enumerate(lines) if line.startswith("source ") and "bin/activate" in line)
    cache = next(i for i, line in enumerate(lines) if line.startswith("export VLLM_MLX_CACHE="))
    quick_start, tests = lines.index(install_and_run), lines.index(install_and_test)
    assert venv < activate < quick_start and cache < quick_start
    assert installs[0] == quick_start < tests
    torch = next(i for i, line in enumerate(lines) if line.startswith("pip install") and "torch" in line)
    assert torch > tests


def test_console_script_points_at_the_cli():
    import tomllib

    from vllm_mlx.entrypoints import cli

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["vllm-mlx"] == "vllm_mlx.entrypoints.cli:main"
    assert callable(cli.main)


def _extras_of(extra: str, table: dict) -> set[str]:
    """``extra`` and every extra it pulls in through ``vllm-mlx[...]`` requirements."""
    found, todo = set(), [extra]
    while todo:
        name = todo.pop()
        found.add(name)
        for req in table[name]:
            if match := re.match(r"vllm-mlx\[([\w,-]+)\]", req):
                todo += [e for e in match.group(1).split(",") if e not in found]
    return found


def test_quick_start_and_ci_bring_the_fast_blas():
    """The README's first command (and CI's `.[dev]`) installs the fast-cpu extra: MKL from
    PyPI on x86_64 Linux only, so macOS and aarch64 installs are unchanged."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for command in readme_commands():
        extra = re.search(r'"\.\[([\w-]+)\]"', command).group(1)
        assert "fast-cpu" in _extras_of(extra, extras), command
    (mkl,) = extras["fast-cpu"]
    assert mkl.startswith("mkl") and "platform_system == 'Linux'" in mkl and "platform_machine == 'x86_64'" in mkl

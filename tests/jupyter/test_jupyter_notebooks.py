"""The notebooks in notebooks/ run top to bottom, unattended, in a real kernel (nbclient).

They run on the tiny llama (``VLLM_MLX_JUPYTER_MODEL``, read by ``GenerateMagics.model``), and
the quick start once more on the real default model (e2e).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
STATUS = re.compile(r"^(?P<name>\S+) · (?P<state>[a-z]+)")


def execute(name: str, tmp_path: Path, parameters: str | None = None) -> nbformat.NotebookNode:
    """Run a notebook; ``parameters`` replaces the source of its cell tagged ``parameters``."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if parameters is not None:
        (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        cell.source = parameters
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    return nb


def outputs(nb) -> list[dict]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def generations(nb) -> dict[str, tuple[str, str]]:
    """name -> (final status line, final text) of every %%generate cell."""
    found = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or not cell.source.startswith("%%generate"):
            continue
        texts = [
            o["data"]["text/plain"]
            for o in cell.outputs
            if o.get("output_type") == "display_data" and "text/plain" in o["data"]
        ]
        status, body = texts[0], texts[-1]
        found[STATUS.match(status)["name"]] = (status, body)
    return found


def assert_clean(nb) -> None:
    errors = [o for o in outputs(nb) if o["output_type"] == "error" or o.get("name") == "stderr"]
    assert not errors, errors


def assert_three_cells_done(nb) -> None:
    """The quick start ran cleanly and its three concurrent cells streamed to the end."""
    assert_clean(nb)
    gens = generations(nb)
    assert set(gens) == {"haiku", "joke", "capital"}
    for status, text in gens.values():
        assert " · done (" in status and text.strip(), (status, text)


@pytest.fixture
def tiny(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("VLLM_MLX_JUPYTER_MODEL", str(tiny_model_dir))


def test_quickstart(tiny, tmp_path):
    nb = execute("quickstart.ipynb", tmp_path)
    assert_three_cells_done(nb)
    inspector = [o for o in outputs(nb) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                 and o["data"]["text/plain"].startswith("KV cache")]  # fmt: skip
    assert inspector and "<span title=" in inspector[0]["data"]["text/html"]
    timeline = [o for o in outputs(nb) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                and o["data"]["text/plain"].startswith("Scheduler timeline")]  # fmt: skip
    assert timeline and "vllm-mlx-timeline-static" in timeline[0]["data"]["text/html"]


def test_prefix_caching(tiny, tmp_path):
    nb = execute("prefix_caching.ipynb", tmp_path)
    assert_clean(nb)
    gens = generations(nb)
    assert all(" · done (" in status for status, _ in gens.values()), gens
    printed = "".join(o.get("text", "") for o in outputs(nb) if o["output_type"] == "stream")
    cached = {m[1]: int(m[2]) for m in re.finditer(r"(\w+): (\d+) of \d+ prompt tokens from the cache", printed)}
    assert cached["first"] == 0 and cached["second"] > 0 and cached["third"] > 0
    assert "after the reset: 0 prompt tokens from the cache" in printed


def test_chat(tiny, tmp_path):
    nb = execute("chat.ipynb", tmp_path)
    assert_clean(nb)
    gens = generations(nb)
    assert set(gens) == {"trip-1", "trip-2"} and all(" · done (" in s for s, _ in gens.values())
    printed = "".join(o.get("text", "") for o in outputs(nb) if o["output_type"] == "stream")
    assert "[system] You are a concise travel guide." in printed and "[user] What should I eat there?" in printed
    assert re.search(r"turn 2: [1-9]\d* of \d+ prompt tokens from the cache", printed)


def test_dataset(tiny, tmp_path):
    nb = execute("dataset.ipynb", tmp_path, parameters="ROWS = 24")
    assert_clean(nb)
    (status, _), = generations(nb).values()
    assert " · done · 24/24 rows" in status, status
    printed = "".join(o.get("text", "") for o in outputs(nb) if o["output_type"] == "stream")
    assert re.search(r"24 rows, 0 errors, accuracy \d+%", printed), printed


@pytest.mark.e2e
def test_quickstart_on_the_default_model(monkeypatch, default_model_dir, tmp_path):
    monkeypatch.delenv("VLLM_MLX_JUPYTER_MODEL", raising=False)
    nb = execute("quickstart.ipynb", tmp_path)
    assert_three_cells_done(nb)


@pytest.mark.e2e
def test_demo_command_runs_the_quickstart_and_summarises(tmp_path, default_model_dir):
    """On the default model (what `vllm-mlx demo` runs by default): an answer takes seconds, so the
    three cells, sent a fraction of a second apart, share the batch however busy the machine is.
    (On the tiny model an answer took ~0.01 s: whether the cells overlapped was up to timing.)"""
    import subprocess
    import sys

    output = tmp_path / "quickstart.executed.ipynb"
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mlx.entrypoints.cli", "demo", "notebooks/quickstart.ipynb",
         "--output", str(output), "--model", str(default_model_dir)],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"3 requests, up to 3 in one batch", done.stdout), done.stdout
    assert "tok/s aggregate" in done.stdout and "time to first token: haiku" in done.stdout
    executed = json.loads(output.read_text())
    assert not any("VLLM_MLX_DEMO_SUMMARY" in "".join(c["source"]) for c in executed["cells"])
    assert any(c.get("outputs") for c in executed["cells"] if c["cell_type"] == "code")


def test_demo_without_the_notebook_is_a_clear_error(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vllm_mlx.entrypoints.cli", "demo", str(tmp_path / "nope.ipynb")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "no notebook at" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.e2e
def test_lora_trains_an_adapter_and_serves_it_beside_the_base_model(monkeypatch, default_model_dir, tmp_path):
    """On the default model (an adapter trained on random weights teaches nothing to check): the
    adapter learned the made-up fact, the base model did not, and the adapter kept a general
    answer; the three cells shared the engine."""
    monkeypatch.delenv("VLLM_MLX_JUPYTER_MODEL", raising=False)
    shutil.copytree(NOTEBOOKS / "data", tmp_path / "data")
    nb = execute("lora.ipynb", tmp_path)
    assert_clean(nb)
    gens = generations(nb)
    assert all(" · done (" in status for status, _ in gens.values()) and len(gens) == 3, gens
    printed = "".join(o.get("text", "") for o in outputs(nb) if o["output_type"] == "stream")
    answers = dict(re.findall(r"^(tuned|plain|general): (.*)$", printed, re.M))
    assert "Ingrid Vale" in answers["tuned"] and "Ingrid Vale" not in answers["plain"], answers
    assert "Rome" in answers["general"], answers
    assert (tmp_path / "adapters" / "quillfeather" / "adapters.safetensors").is_file()

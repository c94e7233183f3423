"""A real browser: JupyterLab 4 and Notebook 7, each driven by headless Chromium (Playwright),
run the quickstart notebook (plus a hostile-text cell, a `--logprobs` token view and a long
generation) and a `%%generate --over` cell whose progress advances until its stop button is
clicked. Every test runs once per frontend (the ``server`` fixture's parameter).

The recipe follows DESIGN.md §8: the server on 127.0.0.1 with a token, its own config/settings
dirs (no news, no update checks, read-only extension manager, no cell windowing), the app exposed
as ``window.jupyterapp`` (Notebook 7 has it too, with the same shell, notebook panel and
``notebook:run-all-cells`` command); Debian's Chromium binary through
``launch_persistent_context``; "run all" without awaiting its promise; assertions on the DOM;
the kernel shut down in ``finally``.

Skipped (with the reason) when Playwright or Chromium is missing or Chromium cannot start.
The inspector and timeline screenshots (one per frontend) are saved to
``$VLLM_MLX_TEST_ARTIFACTS`` (default: a temp dir).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("VLLM_MLX_CHROMIUM", "/usr/lib/chromium/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]  # fmt: skip
NUM_KV_BLOCKS = 128  # what quickstart.ipynb loads with
LONG_CELL = "%%generate -n long --min-tokens 1800 --max-tokens 1800\nCount slowly from one to one thousand."
# Model text as the output area shows it, with HTML that would mark the page if it ran.
HOSTILE_CELL = """from types import SimpleNamespace
from IPython.display import display
from vllm_mlx_jupyter.views.render import body_bundle
answer = '**Hi** <img src=x onerror="document.body.dataset.xss=1"> <script>document.body.dataset.xss=2</script>'
display(body_bundle(SimpleNamespace(content=answer, reasoning=None, tool_calls=[], format="markdown")), raw=True)"""
TOKENS_CELL = "%%generate -n tokens --logprobs 3 --max-tokens 8 --temperature 0\nName a colour."
# 30 rows, two in the engine at a time and 48 tokens each: the rows finish a pair at a time,
# over many seconds on a CPU, so the test sees the count rise and can stop the run half-way.
OVER_ROWS = 30
OVER_CELLS = [
    "%load_ext vllm_mlx_jupyter",
    f"%vllm_mlx load --num-kv-blocks {NUM_KV_BLOCKS}",
    f"animals = [f'animal number {{i}}' for i in range({OVER_ROWS})]",
    "%%generate --over animals -n rows -o rows --max-in-flight 2 --min-tokens 48 --max-tokens 48\n"
    "Write one sentence about an {item}.",
]
LAST_STEP = "() => Number(document.querySelector('.vmt-columns')?.lastChild?.dataset.step || 0)"
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"checkForUpdates": False, "fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def artifacts_dir() -> Path:
    path = Path(os.environ.get("VLLM_MLX_TEST_ARTIFACTS") or Path(tempfile.gettempdir()) / "vllm_mlx_test_artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Frontend:
    """A Jupyter frontend: how its server starts and where it shows a notebook."""

    name: str
    app: str
    """``window.jupyterapp.name``: the page is this frontend's, not another's."""
    module: str
    """``python -m MODULE`` starts its server."""
    options: tuple[str, ...]
    page: str
    """A notebook's page, ``{}`` for its path from the server's root."""


FRONTENDS = [
    Frontend("jupyterlab", "JupyterLab", "jupyterlab",
             ("--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly"), "/lab/tree/{}?reset"),
    Frontend("notebook7", "Jupyter Notebook", "notebook",
             ("--JupyterNotebookApp.expose_app_in_browser=True",), "/notebooks/{}"),
]  # fmt: skip


@dataclass(frozen=True)
class Server:
    url: str
    token: str
    frontend: Frontend

    def run_all(self, page, notebook: str) -> None:
        """Open ``notebook``, wait for its kernel, run all its cells (without awaiting them)."""
        path = self.frontend.page.format(notebook)
        page.goto(f"{self.url}{path}{'&' if '?' in path else '?'}token={self.token}")
        page.wait_for_function(KERNEL_IDLE, timeout=90_000)
        assert page.evaluate("() => window.jupyterapp.name") == self.frontend.app
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the Jupyter server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the Jupyter server did not answer {url} within {timeout} s")


def _write_notebooks(dest: Path) -> None:
    """quickstart.ipynb with the test's cells appended, and over.ipynb."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    for name, source in (("hostile", HOSTILE_CELL), ("tokens", TOKENS_CELL), ("long", LONG_CELL)):
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = f"browser-test-{name}"
        nb.cells.append(cell)
    nbformat.write(nb, dest / "quickstart.ipynb")
    over = nbformat.v4.new_notebook(metadata=nb.metadata)
    over.cells = [nbformat.v4.new_code_cell(source) for source in OVER_CELLS]
    for i, cell in enumerate(over.cells):
        cell["id"] = f"browser-test-over-{i}"
    nbformat.write(over, dest / "over.ipynb")


@pytest.fixture(scope="module", params=FRONTENDS, ids=lambda f: f.name)
def server(request, tmp_path_factory, default_model_dir):
    """A Jupyter server of one frontend on 127.0.0.1 serving the test notebooks (the default
    model: slow enough on a CPU that the long generation is still running when the test clicks).
    The kernels it starts inherit this process's environment (``PYTHONPATH`` included)."""
    frontend: Frontend = request.param
    pytest.importorskip(frontend.module)
    base = tmp_path_factory.mktemp(frontend.name)
    root = base / "root"
    root.mkdir()
    _write_notebooks(root)
    for name, value in SETTINGS.items():
        path = base / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    token, port = secrets.token_hex(16), _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
    }
    env.pop("VLLM_MLX_JUPYTER_MODEL", None)
    command = [sys.executable, "-m", frontend.module, "--no-browser", "--allow-root", "--ip=127.0.0.1",
               f"--port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               *frontend.options]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(base / "server.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_http(f"{url}/api/status?token={token}", proc)
            yield Server(url, token, frontend)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def page(tmp_path):
    """A headless Chromium page (skips when Chromium cannot be launched)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (never 'playwright install')")
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        try:
            context = playwright.chromium.launch_persistent_context(
                str(tmp_path / "chromium"), executable_path=str(CHROMIUM), headless=True,
                args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000},
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - any launch failure is a reason to skip
            pytest.skip(f"Chromium at {CHROMIUM} cannot be launched: {exc}")
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


KERNEL_IDLE = """() => {
  const w = window.jupyterapp?.shell?.currentWidget;
  const kernel = w?.sessionContext?.session?.kernel;
  return !!kernel && kernel.status === 'idle' && (w.content?.widgets?.length ?? 0) > 0;
}"""
ALL_EXECUTED = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const cells = w.content.widgets.filter((c) => c.model.type === 'code');
  return cells.every((c) => c.model.executionCount !== null) && w.sessionContext.session.kernel.status === 'idle';
}"""
HIGHLIGHT_MATCHES_ROW = """() => {
  const row = document.querySelector('.vmi-requests tr.vmi-selected[data-id="long"]');
  if (!row) return false;
  const blocks = Number(row.cells[5].textContent);
  return blocks > 0 && document.querySelectorAll('.vmi-block.vmi-hl').length === blocks;
}"""


def test_quickstart(server, page):
    page.set_default_timeout(60_000)
    try:
        server.run_all(page, "quickstart.ipynb")
        page.wait_for_function(ALL_EXECUTED, timeout=120_000)

        # The three concurrent cells streamed to the end; nothing failed.
        assert page.locator('.vllm-mlx-status[data-state="done"]').count() >= 3
        assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
        assert page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']").count() == 0

        # Model text is rendered Markdown in which raw HTML is text: nothing in it ran.
        hostile = page.locator(".vllm-mlx-text", has_text="<script>")
        assert hostile.locator("strong").inner_text() == "Hi" and hostile.locator("img, script").count() == 0
        assert "<img src=x onerror=" in hostile.inner_text()
        assert page.evaluate("() => document.body.dataset.xss") is None

        # The inspector draws every KV block of the pool (the null block included).
        inspector = page.locator(".vmi").first
        page.wait_for_function(f"() => document.querySelectorAll('.vmi-grid .vmi-block').length === {NUM_KV_BLOCKS}")

        # Hovering a block that holds tokens shows its details. The grid is live: a block can
        # change state between the hover and the read, so hover again (a few times at most).
        # A redraw can also replace the hovered block under a still mouse, so no mouseover
        # comes: each try waits a little, then moves away and hovers again.
        tip, text = inspector.locator(".vmi-tip"), ""
        for _ in range(12):
            page.mouse.move(0, 0)
            inspector.locator(".vmi-block.vmi-used, .vmi-block.vmi-cached").first.hover()
            try:
                tip.wait_for(state="visible", timeout=5_000)
            except sync_api.TimeoutError:
                continue
            text = tip.inner_text()
            if "hash" in text:
                break
        assert "Block" in text and "hash" in text, text

        # Clicking the running request highlights exactly its block table.
        row = inspector.locator('.vmi-requests tr[data-id="long"]')
        page.wait_for_function("""() => {
          const row = document.querySelector('.vmi-requests tr[data-id="long"]');
          return !!row && Number(row.cells[5].textContent) > 0 && row.cells[1].textContent !== 'done';
        }""")
        row.click()
        page.wait_for_function(HIGHLIGHT_MATCHES_ROW, timeout=10_000)
        inspector.screenshot(path=str(artifacts_dir() / f"inspector-{server.frontend.name}.png"))

        # The timeline adds columns while the long generation runs; hovering one shows the step.
        timeline = page.locator(".vmt").first
        page.wait_for_function(f"() => ({LAST_STEP})() > 0")
        seen = page.evaluate(LAST_STEP)
        page.wait_for_function(f"() => ({LAST_STEP})() > {seen}", timeout=20_000)
        timeline.locator(".vmt-col").last.hover()
        timeline.locator(".vmt-tip").wait_for(state="visible")
        assert "Step" in timeline.locator(".vmt-tip").inner_text() and "long" in timeline.locator(".vmt-tip").inner_text()
        timeline.screenshot(path=str(artifacts_dir() / f"timeline-{server.frontend.name}.png"))

        # The token view: each token a span; hovering one shows its top alternatives.
        token = page.locator(".vllm-mlx-tokens .vllm-mlx-tok").first
        token.hover()
        alternatives = token.locator(".vllm-mlx-alts")
        alternatives.wait_for(state="visible")
        assert "%" in alternatives.inner_text() and "logprob" in alternatives.inner_text()

        # The stop button aborts the generation.
        page.locator("button.vllm-mlx-stop").last.click()
        page.wait_for_function(
            """() => [...document.querySelectorAll('.vllm-mlx-status')]
            .some((s) => s.dataset.state === 'aborted' && s.textContent.includes('long'))""",
            timeout=20_000,
        )

        # Pause freezes the view; "Reset prefix cache" (handled once the kernel is idle) forgets
        # the cached blocks, the aborted generation's included.
        inspector.locator("button.vmi-pause").click()
        assert inspector.locator("button.vmi-pause").inner_text() == "Resume"
        inspector.locator("button.vmi-pause").click()
        page.wait_for_function("() => document.querySelectorAll('.vmi-block.vmi-cached').length > 0")
        inspector.locator("button.vmi-reset").click()
        page.wait_for_function("() => document.querySelectorAll('.vmi-block.vmi-cached').length === 0")
    finally:
        page.evaluate("() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.shutdown()")


# The --over run's state, rows done (from its status line) and the green bar's width (%).
OVER_STATUS = f"""() => {{
  const rows = / (\\d+)\\/{OVER_ROWS} rows/;
  const status = [...document.querySelectorAll('.vllm-mlx-status')].find((s) => rows.test(s.textContent));
  const bar = document.querySelector('.vllm-mlx-progress')?.firstElementChild;
  if (!status) return null;
  return {{state: status.dataset.state, done: Number(status.textContent.match(rows)[1]),
           bar: parseFloat(bar?.style.width || '0')}};
}}"""
# Runs Python in the notebook's kernel (beside the cells, not in one) and returns what it printed.
KERNEL_PRINT = """async (code) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const future = kernel.requestExecute({code, store_history: false});
  let text = '';
  future.onIOPub = (msg) => { if (msg.header.msg_type === 'stream') text += msg.content.text; };
  await future.done;
  return text;
}"""


def test_over_progress_and_stop(server, page):
    """``%%generate --over``: the progress line and bar advance as rows finish; Stop cancels the
    run half-way (the handle ends aborted with rows left, the line says so, the button goes)."""
    page.set_default_timeout(60_000)
    try:
        server.run_all(page, "over.ipynb")
        page.wait_for_function(f"() => ({OVER_STATUS})()?.done > 0", timeout=120_000)
        seen = page.evaluate(OVER_STATUS)
        page.wait_for_function(f"() => ({OVER_STATUS})().done > {seen['done']}", timeout=30_000)
        advanced = page.evaluate(OVER_STATUS)
        assert advanced["state"] == "generating" and 0 < seen["bar"] < advanced["bar"] < 100, (seen, advanced)

        page.locator("button.vllm-mlx-stop").click()
        page.wait_for_function(f"() => ({OVER_STATUS})().state === 'aborted'", timeout=20_000)
        stopped = page.evaluate(OVER_STATUS)
        assert advanced["done"] <= stopped["done"] < OVER_ROWS and stopped["bar"] < 100, stopped
        page.locator("button.vllm-mlx-stop").wait_for(state="hidden")

        handle = page.evaluate(KERNEL_PRINT, "rows.wait(10); print(rows.state, rows.progress.done, rows.total)")
        assert handle.split() == ["aborted", str(stopped["done"]), str(OVER_ROWS)], handle
    finally:
        page.evaluate("() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.shutdown()")

"""``vllm-mlx demo``: execute the quick-start notebook headlessly and summarise what happened.

The notebook runs in a real kernel (nbclient), exactly as a user would run it; the executed copy
is written next to it. A last cell, added for the run and removed from the saved copy, asks the
kernel-resident engine what it did: how many requests ran, the largest batch a step carried,
throughput, and prefix-cache hits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SUMMARY_MARKER = "VLLM_MLX_DEMO_SUMMARY "

SUMMARY_CELL = f"""
import json
from vllm_mlx.platform.cpu_backend import reference_blas_warning
from vllm_mlx_jupyter import get_session
_session = get_session()
_records = _session.engine.recent_step_records()
_stats = _session.engine.snapshot(include_blocks=False).stats
_outputs = [g.output for g in _session.generations.values() if g.output is not None]
_spans = [(o.arrival_time, o.finish_time) for o in _outputs if o.finish_time]
print({SUMMARY_MARKER!r} + json.dumps({{
    "requests": len(_outputs),
    "largest_batch": max((len(r.request_ids) for r in _records), default=0),
    "steps": len(_records),
    "generated_tokens": sum(len(o.token_ids) for o in _outputs),
    "seconds": (max(e for _, e in _spans) - min(a for a, _ in _spans)) if _spans else 0.0,
    "prefix_hit_tokens": _stats.prefix_cache.hit_tokens,
    "ttft": {{g.name: g.output.ttft for g in _session.generations.values() if g.output is not None}},
    "backend": _session.status().get("backend"),
    "blas_warning": reference_blas_warning(),
}}))
"""


def run_demo(notebook: Path, output: Path | None = None, *, model: str | None = None, timeout: int = 600) -> dict:
    """Execute ``notebook``; write the executed copy to ``output``; return the summary."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(SUMMARY_CELL))
    env_model = {"VLLM_MLX_JUPYTER_MODEL": model} if model else {}
    started = time.monotonic()
    with _environ(env_model):
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}).execute()
    summary_cell = nb.cells.pop()
    summary = _parse_summary(summary_cell)
    summary["wall_seconds"] = time.monotonic() - started
    output = output or notebook.with_name(f"{notebook.stem}.executed.ipynb")
    nbformat.write(nb, output)
    summary["executed_notebook"] = str(output)
    return summary


def format_summary(summary: dict) -> str:
    tok_s = summary["generated_tokens"] / summary["seconds"] if summary["seconds"] else 0.0
    ttft = ", ".join(f"{name} {value:.2f}s" for name, value in summary["ttft"].items() if value is not None)
    return "\n".join([
        f"{summary['requests']} requests, up to {summary['largest_batch']} in one batch "
        f"({summary['steps']} engine steps)",
        f"{summary['generated_tokens']} tokens generated in {summary['seconds']:.1f}s ({tok_s:.1f} tok/s aggregate)",
        f"time to first token: {ttft}",
        f"backend: {summary.get('backend')}",
        f"prompt tokens served from the prefix cache: {summary['prefix_hit_tokens']}",
        f"executed notebook: {summary['executed_notebook']} (open it, or run: jupyter lab notebooks/quickstart.ipynb)",
    ])  # fmt: skip


def _parse_summary(cell) -> dict:
    for out in cell.get("outputs", []):
        for line in out.get("text", "").splitlines():
            if line.startswith(SUMMARY_MARKER):
                return json.loads(line[len(SUMMARY_MARKER) :])
    raise RuntimeError("the notebook ran, but the engine summary could not be read")


class _environ:
    """Set environment variables for the kernel about to start (it inherits them)."""

    def __init__(self, values: dict) -> None:
        self.values = values
        self.saved: dict = {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

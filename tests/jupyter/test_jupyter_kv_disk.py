"""A notebook keeps its prompts' KV across a kernel restart: a real kernel (jupyter_client) runs a
``%%generate`` cell with a long prompt, is restarted, and runs the cell again; the second run's
prompt comes from the disk tier (the notebook's default, in ``$VLLM_MLX_KV_DISK`` here) and its
text is the first run's."""

from __future__ import annotations

import json
import os

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

PROMPT = "The lighthouse on Gull Point was built in 1871 from granite quarried on the island. " * 12
TIMEOUT = 120


def run_cell(client, code: str) -> str:
    """Execute ``code``; its stdout and displayed text (an error fails the test)."""
    out: list[str] = []

    def hook(message):
        content = message["content"]
        if message["msg_type"] == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif message["msg_type"] == "display_data":
            out.append(content["data"].get("text/plain", ""))
        elif message["msg_type"] == "error":
            out.append("ERROR " + "\n".join(content["traceback"]))

    reply = client.execute_interactive(code, timeout=TIMEOUT, output_hook=hook)
    text = "".join(out)
    assert reply["content"]["status"] == "ok" and "ERROR" not in text, text
    return text


def the_cell(client, model_dir) -> dict:
    run_cell(client, f"%load_ext vllm_mlx_jupyter\n%vllm_mlx load {model_dir} --num-kv-blocks 256")
    run_cell(client, f"%%generate -o g --wait --raw --max-tokens 4 --temperature 0\n{PROMPT}")
    shown = run_cell(client, "import json; print(json.dumps({'cached': g.output.num_cached_tokens, 'text': g.text, "
                             "'disk': g.output.metrics.num_disk_tokens, "
                             "'status': ' · '.join(__import__('vllm_mlx_jupyter.views.render').views.render.status_parts(g))}))")
    return json.loads(shown.strip().splitlines()[-1])


def test_a_restarted_kernel_finds_its_prompt_on_disk(tiny_model_dir, tmp_path):
    manager = jupyter_client.KernelManager(kernel_name="python3")
    env = {**os.environ, "VLLM_MLX_KV_DISK": str(tmp_path / "kv-disk")}
    manager.start_kernel(env=env, cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=TIMEOUT)
        first = the_cell(client, tiny_model_dir)
        manager.restart_kernel(now=False, env=env)  # a normal shutdown: queued blocks are written first
        client.wait_for_ready(timeout=TIMEOUT)
        second = the_cell(client, tiny_model_dir)
        status = run_cell(client, "%vllm_mlx status")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert first["cached"] == 0 and second["cached"] >= 192  # every full block of the prompt but the last
    assert second["disk"] == second["cached"] and f"({second['disk']} from disk)" in second["status"]
    assert second["text"] == first["text"]
    assert "KV on disk" in status and "blocks read" in status

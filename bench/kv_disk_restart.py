"""A notebook cell re-run after a kernel restart: its long prompt's KV from the disk tier against
computing it again, and against mlx-lm's own way of keeping a prompt across processes.

Ours: a real Jupyter kernel (jupyter_client) loads the model (``%vllm_mlx load``, the disk tier
on as notebooks have it, in a fresh folder) and runs a ``%%generate --raw --max-tokens 1`` cell
whose prompt is ``--tokens`` long (a text about a lighthouse, varied so that nothing repeats);
the kernel is restarted and the cell run again. TTFT is the request's own (arrival to first
token, ``RequestOutput``), so loading is left out. Then the same cell once more in the same
kernel: the prompt from memory, for scale.

mlx-lm: in one process, ``stream_generate`` on the prompt with a fresh prompt cache, timed to its
first token, then ``save_prompt_cache`` to a file (mlx-lm's ``cache_prompt`` workflow); in a
second process, ``load_prompt_cache`` and ``stream_generate`` on the prompt's last token, timed
from before the load. Same model, same weight format (ours prepares the weights; mlx-lm's side
gets the same conversion).

    python bench/kv_disk_restart.py [--model default] [--tokens 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

TIMEOUT = 600

SENTENCES = [
    "The lighthouse on Gull Point was built in {year} from granite quarried on the island.",
    "Its lamp was lit by keeper number {n}, who kept a log of every ship that passed in the night.",
    "In {year} a storm tore away part of the keeper's cottage, and the light was dark for {n} days.",
    "Visitors in {year} counted {n} steps to the lantern room and wrote their names in the book.",
]


def long_text(tokenizer, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of varied sentences (no block repeats another)."""
    parts, i = [], 0
    while len(tokenizer.encode(" ".join(parts))) < num_tokens:
        parts.append(SENTENCES[i % len(SENTENCES)].format(year=1800 + i, n=i + 3))
        i += 1
    return " ".join(parts)


def run_cell(client, code: str) -> str:
    out: list[str] = []

    def hook(message):
        if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
            out.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            raise RuntimeError("\n".join(message["content"]["traceback"]))

    client.execute_interactive(code, timeout=TIMEOUT, output_hook=hook)
    return "".join(out)


def cell_ttft(client, model: str, prompt_file: Path, load: bool) -> float:
    if load:
        run_cell(client, f"%load_ext vllm_mlx_jupyter\n%vllm_mlx load {model}")
    run_cell(client, f"prompt = open({str(prompt_file)!r}).read()")
    run_cell(client, "%%generate -o g --wait --raw --max-tokens 1 --temperature 0\n{prompt}")
    shown = run_cell(client, "print(g.output.first_token_time - g.output.arrival_time, g.output.num_cached_tokens)")
    ttft, cached = shown.split()[-2:]
    print(f"  TTFT {float(ttft):.3f} s, {cached} prompt tokens cached", flush=True)
    return float(ttft)


def ours(model: str, prompt_file: Path) -> tuple[float, float, float]:
    """(cold TTFT, TTFT after a restart, TTFT from memory) in a real kernel."""
    import jupyter_client

    env = {**os.environ, "VLLM_MLX_KV_DISK": tempfile.mkdtemp(prefix="kv-disk-")}
    manager = jupyter_client.KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=TIMEOUT)
        cold = cell_ttft(client, model, prompt_file, load=True)
        manager.restart_kernel(now=False, env=env)
        client.wait_for_ready(timeout=TIMEOUT)
        restarted = cell_ttft(client, model, prompt_file, load=True)
        memory = cell_ttft(client, model, prompt_file, load=False)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return cold, restarted, memory


MLX_LM_SIDE = """
import json, sys, time
import vllm_mlx  # the fast BLAS first, as our engine has it
from vllm_mlx.platform import cpu_backend
import mlx_lm
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

path, weight_format, cache_file, mode = sys.argv[1:5]
tokens = json.loads(open(sys.argv[5]).read())
model, tokenizer = mlx_lm.load(path)
cpu_backend.prepare_model_weights(model, weight_format)
start = time.perf_counter()
cache = make_prompt_cache(model) if mode == "save" else load_prompt_cache(cache_file)
rest = tokens if mode == "save" else tokens[-1:]
for _ in mlx_lm.stream_generate(model, tokenizer, rest, max_tokens=1, prompt_cache=cache):
    break
print(time.perf_counter() - start)
if mode == "save":  # keep the prompt but its last token, which the loading side computes
    for layer in cache:
        layer.trim(1)
    save_prompt_cache(cache_file, cache)
"""


def mlx_lm_side(path: Path, weight_format: str, tokens: list[int]) -> tuple[float, float]:
    """(cold TTFT, TTFT after loading the saved prompt cache in a new process)."""
    folder = Path(tempfile.mkdtemp(prefix="mlx-lm-prompt-"))
    (folder / "tokens.json").write_text(json.dumps(tokens))
    cache_file = str(folder / "prompt.safetensors")

    def side(mode: str) -> float:
        args = [sys.executable, "-c", textwrap.dedent(MLX_LM_SIDE), str(path), weight_format, cache_file, mode,
                str(folder / "tokens.json")]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, check=True)
        return float(done.stdout.split()[-1])

    cold = side("save")
    loaded = side("load")
    print(f"  mlx-lm: cold {cold:.3f} s, from its prompt-cache file {loaded:.3f} s", flush=True)
    return cold, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=args.model, num_kv_blocks=16)  # the tokenizer, path and weight format
    path, weight_format, tokenizer = engine.model_path, engine.weight_format, engine.tokenizer
    engine.shutdown()
    text = long_text(tokenizer, args.tokens)
    tokens = tokenizer.encode(text)
    prompt_file = Path(tempfile.mkdtemp(prefix="kv-disk-prompt-")) / "prompt.txt"
    prompt_file.write_text(text)
    print(f"model {path.name}, weights {weight_format}, prompt {len(tokens)} tokens, {args.repeats} runs")
    rows = []
    for run in range(args.repeats):
        print(f"run {run + 1}", flush=True)
        rows.append((*ours(args.model, prompt_file), *mlx_lm_side(path, weight_format, tokens)))
    cold, restarted, memory, peer_cold, peer_loaded = (statistics.median(column) for column in zip(*rows))
    print("| side | cold TTFT (s) | after a restart (s) | ratio | from memory (s) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| ours: disk tier, real kernel | {cold:.3f} | {restarted:.3f} | {restarted / cold:.2f}x | {memory:.3f} |")
    print(f"| mlx-lm: save/load_prompt_cache | {peer_cold:.3f} | {peer_loaded:.3f} | {peer_loaded / peer_cold:.2f}x | - |")


if __name__ == "__main__":
    main()

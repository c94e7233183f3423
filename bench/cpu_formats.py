"""Decode speed of the default model on MLX's CPU backend: weight format x BLAS x batch size.

Configurations, each measured in a fresh subprocess (the BLAS is chosen before mlx is imported):

* quantized      -- the converted Q4/Q8 weights (float32 scales), bundled reference BLAS
* f32-bundled    -- weights dequantized to float32, MLX's bundled BLAS (VLLM_MLX_FAST_BLAS=0)
* f32-fastblas   -- weights dequantized to float32, optimised BLAS preloaded (VLLM_MLX_FAST_BLAS=1)

Workload (identical for every configuration): a B x 16 random-token prefill into mlx-lm's
standard per-layer KV cache, then ``--steps`` greedy decode steps of a [B, 1] input, each step
evaluated before the next (as a real decode loop must). One warm-up run first. Reported: decode
tokens per second, aggregate over the batch (B * steps / seconds).

    python bench/cpu_formats.py [--batches 1 8 32] [--steps 32] [--configs ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    # name: (weight format, VLLM_MLX_FAST_BLAS)
    "quantized": ("quantized", "0"),
    "f32-bundled": ("float32", "0"),
    "f32-fastblas": ("float32", "1"),
}
PROMPT_LEN = 16


def decode_tps(model, batch: int, steps: int, vocab: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, vocab, (batch, PROMPT_LEN))
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    tokens = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
    mx.eval(tokens)
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(tokens, cache=cache)
        tokens = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        mx.eval(tokens)
    return batch * steps / (time.perf_counter() - start)


def child(config: str, batches: list[int], steps: int) -> None:
    """Run one configuration (in a fresh process) and print a JSON line of results."""
    from vllm_mlx.platform import cpu_backend  # importing vllm_mlx has already run the BLAS preload

    import mlx.core as mx
    import mlx_lm
    from vllm_mlx.models import resolve_model

    weight_format, _ = CONFIGS[config]
    model, _tokenizer = mlx_lm.load(str(resolve_model("default")))
    used = cpu_backend.prepare_model_weights(model, weight_format)
    vocab = model.args.vocab_size
    mx.random.seed(0)
    decode_tps(model, max(batches), 4, vocab)  # warm-up
    results = {b: decode_tps(model, b, steps, vocab) for b in batches}
    print(json.dumps({
        "config": config, "format": used, "backend": cpu_backend.describe_backend(),
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "tps": results,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batches, args.steps)
        return

    rows = {}
    for config in args.configs:
        env = {**os.environ, "VLLM_MLX_FAST_BLAS": CONFIGS[config][1]}
        cmd = [sys.executable, __file__, "--child", config, "--steps", str(args.steps), "--batches"]
        cmd += [str(b) for b in args.batches]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{config}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows[config] = row
        print(f"# {config}: format={row['format']} backend={row['backend']}", flush=True)

    header = f"{'config':<14}" + "".join(f"{'B=' + str(b):>10}" for b in args.batches)
    steps = f"{args.steps} steps after a {PROMPT_LEN}-token prefill"
    print(f"\ndecode tok/s (aggregate over the batch), {steps}")
    print(header)
    for config, row in rows.items():
        print(f"{config:<14}" + "".join(f"{row['tps'][str(b)]:>10.1f}" for b in args.batches))
    base = rows.get("quantized")
    if base:
        print("\nratio to quantized")
        for config, row in rows.items():
            ratios = (row["tps"][str(b)] / base["tps"][str(b)] for b in args.batches)
            print(f"{config:<14}" + "".join(f"{r:>9.2f}x" for r in ratios))


if __name__ == "__main__":
    main()

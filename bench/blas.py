"""MLX's CPU matmuls and the default model under each BLAS this machine has, in one run.

Each configuration runs in a fresh subprocess (the BLAS is preloaded when ``vllm_mlx`` is
imported, before mlx, so it cannot change within a process):

* reference   -- MLX's bundled reference BLAS (``VLLM_MLX_FAST_BLAS=0``)
* openblas    -- a system OpenBLAS (e.g. Debian's libopenblas0-pthread), its default threads
* openblas-1t -- the same with ``OPENBLAS_NUM_THREADS=1``
* mkl         -- MKL (PyPI's ``mkl`` wheel or a system one), the sequential layer we default to
* mkl-omp-1t  -- MKL's Intel OpenMP layer, 1 thread
* mkl-omp-2t  -- MKL's Intel OpenMP layer, 2 threads

A configuration whose library is missing is skipped. Measured per configuration:

* float32 ``x @ w.T`` (as ``nn.Linear`` does) at decode (M=1, 8), batched-decode (M=32) and
  prefill (M=512) rows for the default model's projections: hidden 576 -> intermediate 1536, back,
  and the 49152-token vocabulary head (not at M=512: prefill only computes the last rows' logits).
  Median milliseconds per call, each call evaluated.
* end to end, the default model through ``vllm_mlx.LLM`` (float32 weights, greedy, no prefix
  cache): a 256-token prefill (``max_tokens=1``), and single-stream decode tok/s from a 16-token
  prompt (32 more tokens, EOS ignored). Best of 2.

    python bench/blas.py [--configs ...] [--no-e2e]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name: (provider the run must end up with, environment)
CONFIGS = {
    "reference": (None, {"VLLM_MLX_FAST_BLAS": "0"}),
    "openblas": ("openblas", {"VLLM_MLX_FAST_BLAS": "openblas"}),
    "openblas-1t": ("openblas", {"VLLM_MLX_FAST_BLAS": "openblas", "OPENBLAS_NUM_THREADS": "1"}),
    "mkl": ("mkl", {"VLLM_MLX_FAST_BLAS": "mkl"}),
    "mkl-omp-1t": ("mkl", {"VLLM_MLX_FAST_BLAS": "mkl", "MKL_THREADING_LAYER": "intel", "MKL_NUM_THREADS": "1"}),
    "mkl-omp-2t": ("mkl", {"VLLM_MLX_FAST_BLAS": "mkl", "MKL_THREADING_LAYER": "intel", "MKL_NUM_THREADS": "2"}),
}  # fmt: skip
HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
SHAPES = [  # (M, K, N)
    *((m, HIDDEN, INTERMEDIATE) for m in (1, 8, 32, 512)),
    *((m, INTERMEDIATE, HIDDEN) for m in (1, 8, 32, 512)),
    *((m, HIDDEN, VOCAB) for m in (1, 8, 32)),
]
PREFILL_LEN, DECODE_PROMPT, DECODE_TOKENS = 256, 16, 32


def time_matmul(m: int, k: int, n: int, budget_s: float = 0.3) -> float:
    """Median milliseconds of one evaluated ``x @ w.T``, over at least 5 calls or ``budget_s``."""
    import mlx.core as mx

    x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
    mx.eval(x, w, x @ w.T)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def end_to_end() -> dict:
    """Prefill seconds and decode tok/s of the default model, best of 2 each."""
    from vllm_mlx import LLM, SamplingParams

    llm = LLM("default", enable_prefix_caching=False)
    ids = [1000 + (7 * i) % 20000 for i in range(PREFILL_LEN)]

    def seconds(prompt: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - start

    seconds(ids[:DECODE_PROMPT], 4)  # warm-up
    prefill = min(seconds(ids, 1) for _ in range(2))
    short = min(seconds(ids[:DECODE_PROMPT], 1) for _ in range(2))
    long = min(seconds(ids[:DECODE_PROMPT], 1 + DECODE_TOKENS) for _ in range(2))
    return {"prefill_s": prefill, "decode_tps": DECODE_TOKENS / (long - short)}


def child(config: str, e2e: bool) -> None:
    """Run one configuration (in a fresh process) and print a JSON line of results."""
    from vllm_mlx.platform import cpu_backend  # importing vllm_mlx has already run the BLAS preload

    import mlx.core as mx

    mx.random.seed(0)
    row = {"config": config, "provider": cpu_backend.FAST_BLAS_PROVIDER, "blas": cpu_backend.blas_provider()}
    row["ms"] = {f"{m}x{k}x{n}": time_matmul(m, k, n) for m, k, n in SHAPES}
    if e2e:
        row.update(end_to_end())
    print(json.dumps(row))


def run_config(config: str, e2e: bool) -> dict | None:
    provider, extra = CONFIGS[config]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OPENBLAS_"))}
    env.update(extra)
    cmd = [sys.executable, __file__, "--child", config] + ([] if e2e else ["--no-e2e"])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"# {config}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if row["provider"] != provider:  # e.g. asked for OpenBLAS, none installed, got MKL
        print(f"# {config}: skipped ({provider} not available; got {row['provider']})", flush=True)
        return None
    print(f"# {config}: {row['blas'] or 'bundled reference BLAS'}", flush=True)
    return row


def report(rows: dict[str, dict], e2e: bool) -> None:
    names = list(rows)
    width = max(12, *(len(n) + 2 for n in names))
    print("\nfloat32 matmul x @ w.T, median ms per evaluated call (MxKxN)")
    print(f"{'shape':<16}" + "".join(f"{n:>{width}}" for n in names))
    for shape in next(iter(rows.values()))["ms"]:
        print(f"{shape:<16}" + "".join(f"{rows[n]['ms'][shape]:>{width}.3f}" for n in names))
    base = rows.get("reference")
    if base:
        print("\nspeed-up over the reference BLAS")
        for shape in base["ms"]:
            ratios = (base["ms"][shape] / rows[n]["ms"][shape] for n in names)
            print(f"{shape:<16}" + "".join(f"{r:>{width - 1}.1f}x" for r in ratios))
    if e2e:
        print(f"\ndefault model, float32 weights: {PREFILL_LEN}-token prefill, single-stream decode")
        print(f"{'':<16}" + "".join(f"{n:>{width}}" for n in names))
        print(f"{'prefill s':<16}" + "".join(f"{rows[n]['prefill_s']:>{width}.3f}" for n in names))
        print(f"{'decode tok/s':<16}" + "".join(f"{rows[n]['decode_tps']:>{width}.1f}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--no-e2e", action="store_true", help="matmuls only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, not args.no_e2e)
        return
    rows = {c: row for c in args.configs if (row := run_config(c, not args.no_e2e))}
    if rows:
        report(rows, not args.no_e2e)


if __name__ == "__main__":
    main()

"""Throughput and TTFT: this engine vs mlx-lm's batched generation, same model, same workload.

Scenarios:
  together   all requests arrive at once; peer: mlx_lm.batch_generate (its BatchGenerator)
  staggered  requests arrive at random (Poisson) times; peer: mlx-lm static batching, i.e.
             batch_generate over the requests that have arrived, again and again

Each side runs in its own subprocess (clean memory figures, same BLAS setup), then the parent
prints a table with ratios. Every request generates exactly --max-tokens tokens (EOS ignored on
both sides) from prompts of mixed lengths.

    vllm-mlx bench --num-requests 32 --max-tokens 128     (or: python bench/throughput.py ...)
    vllm-mlx bench --scenario staggered --arrival-rate 2
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

from vllm_mlx.config import BENCH, EngineConfig
from vllm_mlx.config.options import add_arguments, options_from_args


def corpus_text() -> str:
    """Prompt material: English prose that ships with the package (its module docstrings)."""
    import vllm_mlx.core.kv.paged_cache
    import vllm_mlx.engine.async_engine
    import vllm_mlx.engine.core
    import vllm_mlx.executor.attention
    import vllm_mlx.executor.model_runner
    import vllm_mlx.models.gguf.convert

    modules = [vllm_mlx.executor.attention, vllm_mlx.engine.async_engine, vllm_mlx.engine.core, vllm_mlx.executor.model_runner,
               vllm_mlx.models.gguf.convert, vllm_mlx.core.kv.paged_cache]  # fmt: skip
    return "\n\n".join(m.__doc__ for m in modules)


def make_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    corpus = tokenizer.encode(corpus_text())
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(corpus) - length)
        prompts.append(corpus[start : start + length])
    return prompts


def arrival_times(num: int, rate: float | None, seed: int) -> list[float]:
    if not rate:
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# -- the two sides (each runs in a subprocess) -------------------------------------------------


def run_ours(args, prompts, arrivals) -> dict:
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(**options_from_args(args, EngineConfig, BENCH))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warm = engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    start = time.monotonic()
    pending = list(range(len(prompts)))
    ttft, tokens = {}, 0
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and arrivals[pending[0]] <= now:
            engine.add_request(prompts[pending[0]], params, request_id=str(pending.pop(0)))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - now))
            continue
        for out in engine.step():
            if out.finished:
                ttft[out.request_id] = out.first_token_time - out.arrival_time
                tokens += len(out.token_ids)
    elapsed = time.monotonic() - start
    batch = max(len(r.request_ids) for r in engine.step_records)
    return summary(elapsed, tokens, list(ttft.values()), max_batch=batch, weight_format=engine.weight_format)


def run_mlx_lm(args, prompts, arrivals) -> dict:
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from vllm_mlx.engine.weight_plan import plan_weight_format
    from vllm_mlx.models import resolve_model
    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    path = resolve_model(args.model)
    # The format our engine runs with the same flags, refused alike when it cannot fit.
    config = EngineConfig(**options_from_args(args, EngineConfig, BENCH))
    config.normalize()
    plan = plan_weight_format(config, path)
    model, _ = mlx_lm.load(str(path))
    weight_format = prepare_model_weights(model, plan.weight_format)

    def run_batch(batch: list[int], t0: float, ttft: dict) -> int:
        gen = BatchGenerator(model, completion_batch_size=args.max_num_seqs, prefill_batch_size=8)
        uids = gen.insert([prompts[i] for i in batch], [args.max_tokens] * len(batch))
        index = dict(zip(uids, batch))
        count = 0
        while responses := gen.next_generated():
            now = time.monotonic() - t0
            for r in responses:
                ttft.setdefault(index[r.uid], now - arrivals[index[r.uid]])
                count += 1
        gen.close()
        return count

    run_batch([0], time.monotonic(), {})  # warm-up
    start = time.monotonic()
    pending = list(range(len(prompts)))
    ttft, tokens = {}, 0
    while pending:  # static batching: each batch runs to completion before the next starts
        now = time.monotonic() - start
        if arrivals[pending[0]] > now:
            time.sleep(arrivals[pending[0]] - now)
            now = time.monotonic() - start
        batch = [i for i in pending if arrivals[i] <= now]
        pending = [i for i in pending if arrivals[i] > now]
        tokens += run_batch(batch, start, ttft)
    elapsed = time.monotonic() - start
    return summary(elapsed, tokens, list(ttft.values()), max_batch=args.max_num_seqs, weight_format=weight_format)


def summary(elapsed: float, tokens: int, ttft: list[float], **extra) -> dict:
    import mlx.core as mx

    return {
        "elapsed_s": elapsed,
        "tokens": tokens,
        "tok_per_s": tokens / elapsed,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "peak_memory_mb": mx.get_peak_memory() / 1e6,
        **extra,
    }


# -- driver ------------------------------------------------------------------------------------


def run_side(args) -> None:
    from vllm_mlx.models import load_model

    tokenizer = load_model(args.model).tokenizer
    prompts = make_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    arrivals = arrival_times(args.num_requests, args.arrival_rate if args.scenario == "staggered" else None, args.seed)
    result = (run_ours if args.side == "ours" else run_mlx_lm)(args, prompts, arrivals)
    print(json.dumps(result))


ARGV: list[str] = []


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, EngineConfig, BENCH)  # --model and the engine's flags
    parser.add_argument("--scenario", choices=["together", "staggered", "both"], default="both")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--arrival-rate", type=float, default=1.0, help="requests per second (staggered)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=["ours", "mlx-lm"], help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ARGV[:] = argv
    run(build_parser().parse_args(argv))
    return 0


def run(args: argparse.Namespace) -> None:
    if args.side:
        return run_side(args)
    scenarios = ["together", "staggered"] if args.scenario == "both" else [args.scenario]
    print(f"model={args.model} requests={args.num_requests} max_tokens={args.max_tokens} "
          f"prompt_len={args.min_prompt}..{args.max_prompt} weight_format={args.weight_format}")  # fmt: skip
    for scenario in scenarios:
        results = {side: side_result(side, scenario) for side in ("ours", "mlx-lm")}
        print_table(scenario, results)


def side_result(side: str, scenario: str) -> dict:
    command = [sys.executable, "-m", "vllm_mlx.entrypoints.bench", *_argv_without_scenario(), "--scenario", scenario, "--side", side]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _argv_without_scenario() -> list[str]:
    argv, skip = [], False
    for arg in ARGV:
        if skip:
            skip = False
        elif arg == "--scenario":
            skip = True
        elif not arg.startswith("--scenario="):
            argv.append(arg)
    return argv


def print_table(scenario: str, results: dict) -> None:
    ours, peer = results["ours"], results["mlx-lm"]
    print(f"\n[{scenario}]  weights: ours={ours['weight_format']} mlx-lm={peer['weight_format']}")
    print(f"{'':14s}{'vllm-mlx':>12s}{'mlx-lm':>12s}{'ratio':>9s}")
    for key, label, better_high in [
        ("tok_per_s", "output tok/s", True),
        ("ttft_p50_s", "TTFT p50 s", False),
        ("ttft_p95_s", "TTFT p95 s", False),
        ("elapsed_s", "wall s", False),
        ("peak_memory_mb", "peak MB", False),
    ]:
        ratio = ours[key] / peer[key] if better_high else peer[key] / max(ours[key], 1e-9)
        print(f"{label:14s}{ours[key]:12.2f}{peer[key]:12.2f}{ratio:8.2f}x")
    print("(ratio > 1 means vllm-mlx is better)")


if __name__ == "__main__":
    sys.exit(main())

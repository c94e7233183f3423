"""A long prompt beside a decoding stream: does the prefill starve the stream?

One stream decodes while a ~7,000-token prompt arrives and is prefilled in chunks. For each
policy, the stream's gaps between tokens while the long prompt prefills (max and p95) and the
long prompt's time to first token:

  cost units  prefill chunks charged for their attention (prefill_attention_tokens, the default)
  tokens      prefill chunks charged their token count (prefill_attention_tokens=0: the old policy)

The two policies run on one engine, alternating, ``--repeats`` times each; figures are medians
over the repeats (the machine may be shared: say so when you quote them).

``--chunk-sweep 128,512`` measures instead what the cost model is fitted to: the long prompt
alone, prefilled in chunks of each size (tokens-only policy), and each step's time by the
context position where its chunk starts.

    python bench/prefill_interference.py [--model default] [--prompt-tokens 7000] [--repeats 3]
    python bench/prefill_interference.py --chunk-sweep 128,512 --prompt-tokens 7400
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass


@dataclass
class Run:
    max_gap: float
    p95_gap: float
    ttft: float
    steps: int


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    from vllm_mlx.entrypoints.bench import corpus_text

    text = corpus_text()
    ids = tokenizer.encode(text)
    while len(ids) < num_tokens:
        ids += ids
    return ids[:num_tokens]


def run_once(engine, prompt: list[int], attention_tokens: int, tag: str) -> Run:
    """The stream starts decoding, then the long prompt arrives; until its first token, the times
    at which the stream got each token."""
    from vllm_mlx import SamplingParams
    from vllm_mlx.core.sched.prefill_budget import PrefillCost

    engine.scheduler.prefill_cost = PrefillCost(attention_tokens)
    stream = engine.add_request("Count slowly:", SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True),
                                request_id=f"stream-{tag}")  # fmt: skip
    for _ in range(3):
        engine.step()  # the stream is decoding
    start = time.perf_counter()
    first_step = len(engine.step_records)
    long = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id=f"long-{tag}")
    stamps, ttft = [start], None
    while ttft is None:
        for out in engine.step():
            if out.request_id == stream and out.outputs[0].token_ids:
                stamps.append(time.perf_counter())
            if out.request_id == long and out.finished:
                ttft = time.perf_counter() - start
    engine.abort_request(stream)
    while engine.has_unfinished_requests():
        engine.step()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return Run(max(gaps), p95(gaps), ttft, len(engine.step_records) - first_step)


def chunk_sweep(engine, prompt: list[int], chunk: int) -> list[tuple[int, int, float]]:
    """(position, chunk, seconds) of each step prefilling ``prompt`` alone in ``chunk``-token chunks."""
    from vllm_mlx import SamplingParams
    from vllm_mlx.core.sched.prefill_budget import PrefillCost

    engine.scheduler.prefill_cost = PrefillCost(0)
    engine.scheduler.config.max_num_batched_tokens = chunk
    first_step = len(engine.step_records)
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id=f"sweep-{chunk}")
    while engine.has_unfinished_requests():
        engine.step()
    return [(r.requests[0].num_computed_tokens, r.num_new_tokens[0], r.wall_time)
            for r in list(engine.step_records)[first_step:]]  # fmt: skip


def main() -> None:
    from vllm_mlx.core.sched.prefill_budget import DEFAULT_PREFILL_ATTENTION_TOKENS
    from vllm_mlx.engine.core import EngineCore

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=7000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefill-attention-tokens", type=int, default=DEFAULT_PREFILL_ATTENTION_TOKENS)
    parser.add_argument("--chunk-sweep", default="", help="comma-separated chunk sizes: measure step times instead")
    args = parser.parse_args()

    engine = EngineCore(model=args.model, max_model_len=args.prompt_tokens + 4096, enable_prefix_caching=False,
                        max_num_batched_tokens=args.max_num_batched_tokens, force_model_takeover=True)  # fmt: skip
    prompt = long_prompt(engine.tokenizer, args.prompt_tokens)
    if args.chunk_sweep:
        print(f"{'chunk':>6s} {'position':>9s} {'step (s)':>9s}")
        for chunk in map(int, args.chunk_sweep.split(",")):
            for position, num_tokens, seconds in chunk_sweep(engine, prompt, chunk):
                print(f"{num_tokens:6d} {position:9d} {seconds:9.3f}", flush=True)
        engine.shutdown()
        return
    policies = {"cost units": args.prefill_attention_tokens, "tokens (old)": 0}
    runs: dict[str, list[Run]] = {name: [] for name in policies}
    run_once(engine, prompt[:600], 0, "warm-up")
    for repeat in range(args.repeats):
        for name, attention_tokens in policies.items():
            run = run_once(engine, prompt, attention_tokens, f"{repeat}-{attention_tokens}")
            runs[name].append(run)
            print(f"  {name:13s} repeat {repeat}: max gap {run.max_gap:.2f} s, p95 gap {run.p95_gap:.2f} s, "
                  f"TTFT {run.ttft:.1f} s, {run.steps} steps", flush=True)  # fmt: skip
    engine.shutdown()
    print(f"\n{args.prompt_tokens}-token prompt beside a decoding stream, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, medians of {args.repeats}:")  # fmt: skip
    print(f"{'policy':18s} {'max gap (s)':>12s} {'p95 gap (s)':>12s} {'long TTFT (s)':>14s} {'steps':>6s}")
    for name, attention_tokens in policies.items():
        r = runs[name]
        label = f"{name} ({attention_tokens})" if attention_tokens else name
        print(f"{label:18s} {statistics.median(x.max_gap for x in r):12.2f} {statistics.median(x.p95_gap for x in r):12.2f} "
              f"{statistics.median(x.ttft for x in r):14.1f} {statistics.median(x.steps for x in r):6.0f}")  # fmt: skip


if __name__ == "__main__":
    main()

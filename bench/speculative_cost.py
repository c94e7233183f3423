"""What verifying k proposed tokens costs: one forward over k + 1 positions per row against one.

Speculative decoding pays off when the tokens a verification yields outweigh what it costs. With
acceptance rate ``a`` per proposed token, a row that proposes ``k`` expects
``(1 - a**(k + 1)) / (1 - a)`` tokens from one forward over ``k + 1`` positions; plain decoding
gets one token from a forward over one. This measures the second half, the cost ratio
``t(B, k + 1) / t(B, 1)`` of a decode forward of ``B`` rows, each with a ``--context``-token KV
cache, so that the adaptive policy of issue #28 works from figures, not guesses: speculation is
worth it for ``k`` while the expected tokens exceed the cost ratio, and the break-even acceptance
rate is printed for each batch size and ``k``.

The model runs as the engine runs it on this backend (``weight_format`` auto), through mlx-lm's
own KV cache (the cost of the forward, not of our paging).

``--engine`` measures our engine's whole decode step instead (paged attention, the LM head over
every verified position, sampling each one, the bookkeeping): ``B`` requests decode together,
each verifying exactly ``k`` proposals a step (a stand-in proposer; what is kept does not change
what a step computes), and the median step of pure decoding is compared with ``k = 0``. These are
the figures of the adaptive policy (``core/spec_decode/policy.py``, ``STEP_MS``), printed as
its table: step cost by rows and positions per row.

    python bench/speculative_cost.py [--model default] [--batches 1 8 32] [--k 1 2 4 7] [--context 256] [--engine]
"""

from __future__ import annotations

import argparse
import statistics
import time


def forward_seconds(model, batch: int, positions: int, context: int, repeats: int) -> float:
    """Median seconds of one forward of ``batch`` rows x ``positions`` tokens after ``context``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, vocab, (batch, context)), cache=cache))
    times = []
    for _ in range(repeats):
        tokens = mx.random.randint(0, vocab, (batch, positions))
        start = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append(time.perf_counter() - start)
        for layer_cache in cache:  # drop what this forward wrote: every repeat sees `context`
            layer_cache.trim(positions)
    return statistics.median(times)


def break_even(cost_ratio: float, k: int) -> float:
    """The acceptance rate at which k proposals yield as many tokens per second as none."""
    low, high = 0.0, 1.0
    for _ in range(50):  # expected tokens grow with the rate: bisect
        rate = (low + high) / 2
        expected = sum(rate**i for i in range(k + 1))
        low, high = (rate, high) if expected < cost_ratio else (low, rate)
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 7])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine", action="store_true", help="measure our engine's decode steps")
    args = parser.parse_args()
    if args.engine:
        engine_table(args)
        return

    from vllm_mlx.models import load_model
    from vllm_mlx.platform.cpu_backend import backend_summary, choose_weight_format, prepare_model_weights

    model = load_model(args.model).model
    weight_format = prepare_model_weights(model, choose_weight_format("auto"))
    print(f"{args.model}: {backend_summary(weight_format)}; context {args.context} tokens, median of {args.repeats}")
    print(f"{'batch':>5} {'k':>3} {'ms (k+1)':>9} {'ms (1)':>8} {'cost ratio':>10} {'break-even acceptance':>22}")
    for batch in args.batches:
        one = forward_seconds(model, batch, 1, args.context, args.repeats)
        for k in args.k:
            more = forward_seconds(model, batch, k + 1, args.context, args.repeats)
            ratio = more / one
            print(f"{batch:>5} {k:>3} {more * 1e3:>9.1f} {one * 1e3:>8.1f} {ratio:>10.2f} {break_even(ratio, k):>22.2f}")


class FixedProposals:
    """A stand-in n-gram proposer: always ``k`` tokens (the cost of a step does not depend on them)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def lookup(self, tokens):
        from vllm_mlx.core.spec_decode.ngram import Lookup

        return Lookup([tokens[-1]] * self.k, 4)


def engine_step_seconds(engine, batch: int, k: int, context: int, repeats: int) -> float:
    """Median wall time of our engine's steps in which ``batch`` requests each decode and verify
    ``k`` proposals, after ``context``-token prompts."""
    from vllm_mlx import SamplingParams

    if engine.speculator is not None:
        engine.speculator.proposer = FixedProposals(k)
        engine.speculator.config = type(engine.speculator.config)(num_speculative_tokens=max(k, 1), adaptive=False)
    prefill_steps = batch * context // engine.config.max_num_batched_tokens + 1  # requests start decoding apart
    params = SamplingParams(max_tokens=(repeats + 2 + prefill_steps) * (k + 1), temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 100 for j in range(context)], params)
    first = len(engine.step_records)
    while engine.has_unfinished_requests():
        engine.step()
    steps = [
        r.wall_time for r in list(engine.step_records)[first:]
        if len(r.requests) == batch and all(q.is_decode and q.num_draft_tokens == k for q in r.requests)
    ]  # fmt: skip
    return statistics.median(steps[1:] or steps)  # the first decode step warms up


def engine_table(args) -> None:
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(
        model=args.model, max_num_seqs=max(args.batches), max_num_batched_tokens=max(args.batches) * (max(args.k) + 1),
        speculative_config={"method": "ngram", "num_speculative_tokens": max(args.k), "adaptive": False},
    )  # fmt: skip
    print(f"{engine.model_path.name}, {engine.weight_format}: our engine's decode steps, context {args.context}")
    print("| batch | k | tokens | ms per step | ms, k = 0 | cost ratio | break-even acceptance |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        one = engine_step_seconds(engine, batch, 0, args.context, args.repeats)
        for k in args.k:
            more = engine_step_seconds(engine, batch, k, args.context, args.repeats)
            ratio = more / one
            print(f"| {batch} | {k} | {batch * (k + 1)} | {more * 1e3:.1f} | {one * 1e3:.1f} | {ratio:.2f} | "
                  f"{break_even(ratio, k):.2f} |")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()

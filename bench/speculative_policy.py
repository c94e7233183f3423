"""How close n-gram speculation's adaptive policy comes to the best choices, replayed offline.

A lone stream's speed under speculation is decided by how many proposals each step verifies:
too few leave tokens the lookup had right, too many pay for positions that are thrown away.
This generates each workload's greedy tokens once (our engine, no speculation), then replays
n-gram lookup over them step by step, pricing each step with the policy's own measured step
costs (``STEP_MS``, one row), and prints the speedup over plain decoding of:

* ``policy``: the adaptive policy as the engine runs it (``AcceptanceEstimate.rate``: the match
  length's prior and the request's record, added in log-odds);
* ``record only``: the same with the record blended into the prior instead
  (``AcceptanceEstimate.rate_from``, the estimate before 2026-12-03);
* ``hindsight``: the best width for every step, knowing how many proposals the target will keep
  (dynamic programming over the whole output): no policy can beat it.

The replay leaves out what a real step costs beyond the table (bookkeeping), so the engine's
measured ratios (``bench/speculative.py``) come out a few percent lower.

    python bench/speculative_policy.py [--model default] [--tokens 128] [--k 4 7]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from speculative import engine_run, workload_prompts

from vllm_mlx.core.spec_decode.ngram import NgramProposer
from vllm_mlx.core.spec_decode.policy import (
    STEP_MS,
    AcceptanceEstimate,
    choose_lengths,
    match_prior,
    step_cost,
)

RateRule = Callable[[AcceptanceEstimate, int], float]
RULES: dict[str, RateRule] = {
    "policy": lambda estimate, match_len: estimate.rate(match_len),
    "record only": lambda estimate, match_len: estimate.rate_from(match_prior(match_len)),
}


def step_ms(width: int) -> float:
    return step_cost(1, width) * STEP_MS[1][1]


def kept(output: list[int], start: int, proposal: list[int]) -> int:
    """How many of ``proposal`` match ``output`` from ``start`` on, in a row."""
    count = 0
    for offset, token in enumerate(proposal):
        if start + offset >= len(output) or output[start + offset] != token:
            break
        count += 1
    return count


def replay(prompt: list[int], output: list[int], k: int, rule: RateRule) -> float:
    """The speedup of the adaptive policy with ``rule`` over plain decoding of ``output``."""
    proposer, estimate = NgramProposer(num_tokens=k), AcceptanceEstimate()
    known, spent = 1, 0.0  # the first token comes from the prefill
    while known < len(output):
        lookup = proposer.lookup(prompt + output[:known])
        proposal = lookup.token_ids[: len(output) - known - 1]
        length = choose_lengths([rule(estimate, lookup.match_len)], [len(proposal)])[0] if proposal else 0
        accepted = kept(output, known, proposal[:length])
        estimate.record(length, accepted)
        spent += step_ms(length + 1)
        known += accepted + 1
    return (len(output) - 1) * step_ms(1) / spent


def hindsight(prompt: list[int], output: list[int], k: int) -> float:
    """The speedup of the best width at every step, knowing what will be kept."""
    proposer = NgramProposer(num_tokens=k)
    right = [kept(output, known, proposer.propose(prompt + output[:known])) for known in range(len(output))]
    best = [0.0] * (len(output) + 1)  # best[i]: the least cost from i known tokens to the end
    for known in range(len(output) - 1, 0, -1):
        best[known] = min(
            step_ms(width) + best[min(known + min(right[known], width - 1) + 1, len(output))]
            for width in range(1, k + 2)
        )
    return (len(output) - 1) * step_ms(1) / best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 7], help="num_speculative_tokens")
    parser.add_argument("--workloads", nargs="+", default=["extract", "edit", "free"])
    args = parser.parse_args()

    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=args.model, enable_prefix_caching=False)
    print(f"model {engine.model_path.name}, {args.tokens} greedy tokens, step costs STEP_MS (one row)")
    print("| workload | k | policy | record only | hindsight |")
    print("|---|---:|---:|---:|---:|")
    for name in args.workloads:
        prompt = workload_prompts(name, engine.tokenizer)[0]
        output = engine_run(engine, [prompt], args.tokens)[0][0]
        for k in args.k:
            ratios = [replay(prompt, output, k, rule) for rule in RULES.values()] + [hindsight(prompt, output, k)]
            print(f"| {name} | {k} | " + " | ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")
    engine.shutdown()


if __name__ == "__main__":
    main()

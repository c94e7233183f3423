"""Speculative decoding (n-gram prompt lookup or a draft model) against the same engine without
it, and mlx-lm.

Workloads on one model, greedy, fixed output lengths (``ignore_eos``), so every side produces
the same tokens (checked: speculation never changes the output):

- ``extract`` / ``edit``, single stream: the answer copies stretches of a text the prompt
  gives (quote the sentences about a topic; rewrite with one name changed). Where prompt lookup
  helps most.
- ``free``, single stream: a question answered in the model's own words; lookup rarely
  guesses right, and the adaptive policy must keep it from costing anything.
- ``batch8`` / ``batch32``: that many free-generation requests at once; decode is no longer
  bound by reading the weights, and the policy must back off.

Single streams report decode tokens per second (from the first token to the last, so prefill
is left out); batches report output tokens per second over the whole run. mlx-lm has no prompt
lookup (its speculation needs a draft model), so with n-gram its column is plain decoding with
its own ``stream_generate`` on the same weights (same format), for scale. With ``--draft MODEL``
(a smaller model with the same tokenizer; ``--draft self`` drafts with a second copy of the
target, every proposal kept: what the machinery costs) we propose with that model, and mlx-lm's
column is its own speculative decoding with the same draft (``draft_model=``, single streams
only: mlx-lm does not batch it). Ratios are against our engine without speculation.

    python bench/speculative.py [--model default] [--tokens 128] [--k 4] [--repeats 3]
        [--workloads extract edit free batch8 batch32] [--draft MODEL] [--no-adaptive]

``--match-table`` instead prints how often lookup's first proposed token is right, by the length
of the tail it matched, over the single-stream workloads and the free-generation prompts: the
figures of the adaptive policy's prior (``core/spec_decode/policy.py``, ``MATCH_PRIOR``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

PASSAGE = (
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island. Its lamp "
    "was first lit by Margaret Hale, who kept it for thirty-one years. In 1903 a storm tore away "
    "the keeper's cottage, and the light was dark for nine days. Margaret Hale rowed to the "
    "mainland for oil and glass, and the lamp was burning again before the supply boat came. The "
    "station was automated in 1962, and the last keeper, Thomas Reed, moved to the harbour town. "
    "Today the tower is a museum, and visitors can climb its ninety-four steps to the lantern room."
)
WORKLOADS = {
    "extract": f"Here is a text.\n\n{PASSAGE}\n\nCopy, word for word, every sentence of the text that mentions "
    "Margaret Hale.",
    "edit": f"Rewrite the following text exactly, but replace the name Margaret Hale with Ada Brown.\n\n{PASSAGE}",
    "free": "Write a short story about a fox who learns to sail.",
}
FREE_PROMPTS = [
    "Write a short story about a fox who learns to sail.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe a walk through a forest in autumn.",
    "What are the benefits of regular exercise?",
    "Write a poem about the sea at night.",
    "How does a bicycle stay upright?",
    "Tell me about the history of paper.",
]


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def engine_run(engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float, float]:
    """(tokens per request, decode tok/s of the first request, output tok/s overall)."""
    from vllm_mlx import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    wall = time.perf_counter() - start
    first = final[ids[0]]
    decode = (tokens - 1) / (first.finish_time - first.first_token_time)
    return [final[i].outputs[0].token_ids for i in ids], decode, len(prompts) * tokens / wall


def mlx_lm_decode(model, tokenizer, prompt: list[int], tokens: int, draft=None, k: int = 2) -> tuple[list[int], float]:
    """mlx-lm's tokens and decode tok/s; with ``draft``, its speculative decoding (``k`` drafts)."""
    import mlx_lm

    extra = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    out, last = [], None
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=tokens, **extra):
        out.append(response.token)
        last = response
    return out, last.generation_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per workload and side (the median counts)")
    parser.add_argument("--workloads", nargs="+", default=["extract", "edit", "free", "batch8", "batch32"])
    parser.add_argument("--match-table", action="store_true", help="print lookup's hit rate by match length")
    parser.add_argument("--draft", help="a draft model (same tokenizer) instead of n-gram; 'self': the target")
    parser.add_argument("--no-adaptive", action="store_true", help="always propose k tokens")
    args = parser.parse_args()
    if args.match_table:
        match_table(args.model, args.tokens)
        return

    # vllm_mlx first: importing it preloads the fast BLAS that MLX then binds to.
    from vllm_mlx.engine.core import EngineCore
    from vllm_mlx.platform import cpu_backend

    import mlx_lm  # noqa: I001

    # One engine (one per model and process), speculating or not in turn. No prefix cache: the
    # repeats would otherwise skip their prefill, the first run not.
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": not args.no_adaptive}
    if args.draft is not None:
        from vllm_mlx.models import resolve_model

        draft_path = resolve_model(args.model if args.draft == "self" else args.draft)
        spec_config = {**spec_config, "method": "draft_model", "model": str(draft_path)}
    engine = EngineCore(model=args.model, max_num_seqs=32, enable_prefix_caching=False, speculative_config=spec_config)
    path, weight_format = engine.model_path, engine.weight_format
    method = "n-gram" if args.draft is None else f"draft {Path(spec_config['model']).name}"
    print(f"model {path.name}, weights {weight_format}, {args.tokens} tokens per request, k = {args.k}, "
          f"median of {args.repeats} runs, ours with and without {method} in turn")  # fmt: skip
    rows = [compare(name, workload_prompts(name, engine.tokenizer), engine, args) for name in args.workloads]
    engine.shutdown()
    model, mlx_tokenizer = mlx_lm.load(str(path))
    cpu_backend.prepare_model_weights(model, weight_format)  # the weights ours ran
    draft = None
    if args.draft is not None:
        draft, _ = mlx_lm.load(spec_config["model"])
        cpu_backend.prepare_model_weights(draft, weight_format)
    peer_name = "mlx-lm" if draft is None else "mlx-lm, draft"
    print(f"| workload | metric | {peer_name} | ours, plain | ours, {method} | ratio | proposed | accepted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        peer = "-"
        if row.single:
            runs = [mlx_lm_decode(model, mlx_tokenizer, row.prompts[0], args.tokens, draft, args.k)[1]
                    for _ in range(args.repeats)]  # fmt: skip
            peer = f"{statistics.median(runs):.1f}"
        metric = "decode tok/s" if row.single else "output tok/s"
        print(f"| {row.name} | {metric} | {peer} | {row.plain:.1f} | {row.spec:.1f} | {row.spec / row.plain:.2f}x "
              f"| {row.proposed} | {row.accepted} |")  # fmt: skip


@dataclass
class Comparison:
    """One workload's medians (decode tok/s of a single stream, else output tok/s) and the
    proposals of its last speculative run."""

    name: str
    prompts: list[list[int]]
    single: bool
    plain: float
    spec: float
    proposed: int
    accepted: int


def compare(name: str, prompts: list[list[int]], engine, args) -> Comparison:
    """Run ``prompts`` without speculation and with it in turn, ``args.repeats`` times (so a slow
    spell of the machine falls on both); check that speculation changed no token."""
    single = len(prompts) == 1
    plain_rates, spec_rates = [], []
    speculator = engine.speculator
    for _ in range(args.repeats):
        engine.speculator = None  # the engine as built without speculative_config
        base_tokens, base_decode, base_rate = engine_run(engine, prompts, args.tokens)
        engine.speculator = speculator
        before = len(engine.step_records)
        got_tokens, decode, rate = engine_run(engine, prompts, args.tokens)
        if got_tokens != base_tokens:
            raise SystemExit(f"{name}: speculation changed the output")
        plain_rates.append(base_decode if single else base_rate)
        spec_rates.append(decode if single else rate)
    records = list(engine.step_records)[before:]
    proposed = sum(r.num_draft_tokens for r in records)
    accepted = sum(r.num_accepted_tokens for r in records)
    median = statistics.median
    return Comparison(name, prompts, single, median(plain_rates), median(spec_rates), proposed, accepted)


def match_table(model: str, tokens: int) -> None:
    """How often the first token n-gram lookup proposes is the model's own, by match length."""
    from vllm_mlx.core.spec_decode.ngram import NgramProposer
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=model)
    lookup = NgramProposer(1, 4, 1).lookup
    texts = [WORKLOADS["extract"], WORKLOADS["edit"], *FREE_PROMPTS]
    prompts = [chat_prompt(engine.tokenizer, text) for text in texts]
    outputs, _, _ = engine_run(engine, prompts, tokens)
    engine.shutdown()
    hits: dict[int, list[int]] = {}
    for prompt, output in zip(prompts, outputs):
        for i, token in enumerate(output):
            found = lookup(list(prompt) + output[:i])
            if found.token_ids:
                counts = hits.setdefault(found.match_len, [0, 0])
                counts[0] += found.token_ids[0] == token
                counts[1] += 1
    print("| match length | lookups | first token right | rate |")
    print("|---:|---:|---:|---:|")
    for n, (right, total) in sorted(hits.items()):
        print(f"| {n} | {total} | {right} | {right / total:.2f} |")


def workload_prompts(name: str, tokenizer) -> list[list[int]]:
    if name.startswith("batch"):
        size = int(name.removeprefix("batch"))
        return [chat_prompt(tokenizer, f"{FREE_PROMPTS[i % len(FREE_PROMPTS)]} ({i})") for i in range(size)]
    return [chat_prompt(tokenizer, WORKLOADS[name])]


if __name__ == "__main__":
    main()

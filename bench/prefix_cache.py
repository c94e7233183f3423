"""Prefix caching: a long shared prefix asked many questions, and a multi-turn chat.

Part 1: a ~1,024-token document followed by 16 different short questions, one at a time.
  vllm-mlx cold   prefix caching off: every question prefills the whole document
  vllm-mlx cached prefix caching on: after the first question the document's blocks are reused
  mlx-lm cached   mlx-lm's own prompt cache: the document prefilled once into a KV cache,
                  copied for each question (what `mlx_lm.cache_prompt` users do by hand)
  Reports mean TTFT and total time, and the cached/cold ratio (target: cached TTFT <= 0.1x cold).

Part 2: an 8-turn chat; per turn, the prompt tokens the engine actually computed (target: only
the new turn's tokens, up to one partial block).

    python bench/prefix_cache.py [--model default] [--prefix-tokens 1024] [--questions 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

QUESTIONS = [
    "What is a block?", "Who owns the model?", "What is preemption?", "How are hashes chained?",
    "What does the runner return?", "Why float32 on CPU?", "What is the null block?",
    "How is padding masked?", "What is a step?", "What is TTFT?", "Which thread runs MLX?",
    "What is evicted first?", "What is a cache salt?", "How long is a block?",
    "What does update_and_fetch do?", "Why chunked prefill?",
]  # fmt: skip


def document(tokenizer, num_tokens: int) -> str:
    from vllm_mlx.entrypoints.bench import corpus_text

    ids = tokenizer.encode(corpus_text() * 4)[:num_tokens]
    return tokenizer.decode(ids)


def chat_prompt(tokenizer, doc: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def run_engine(args, prompts: list[list[int]], caching: bool) -> dict:
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=args.model, enable_prefix_caching=caching, force_model_takeover=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ttft, total = [], []
    for prompt in prompts:
        start = time.monotonic()
        rid = engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and first is None and out.token_ids:
                    first = time.monotonic() - start
        ttft.append(first)
        total.append(time.monotonic() - start)
    engine.shutdown()
    return {"ttft": ttft, "total": total}


def run_mlx_lm(args, doc_ids: list[int], prompts: list[list[int]]) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from vllm_mlx.models import resolve_model
    from vllm_mlx.platform.cpu_backend import choose_weight_format, prepare_model_weights

    model, tokenizer = mlx_lm.load(str(resolve_model(args.model)))
    prepare_model_weights(model, choose_weight_format("auto"))  # the same weights as the engine
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    base = make_prompt_cache(model)
    model(mx.array([prompts[0][:shared]]), cache=base)  # prefill the shared prefix once
    mx.eval([c.state for c in base])
    ttft, total = [], []
    for prompt in prompts:
        cache = copy.deepcopy(base)
        start = time.monotonic()
        first = None
        for _ in mlx_lm.stream_generate(model, tokenizer, prompt[shared:], max_tokens=args.max_tokens, prompt_cache=cache):
            first = first or time.monotonic() - start
        ttft.append(first)
        total.append(time.monotonic() - start)
    return {"ttft": ttft, "total": total}


def multi_turn(args) -> list[tuple[int, int]]:
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=args.model, force_model_takeover=True)
    tokenizer = engine.tokenizer
    messages, rows = [], []
    for turn in range(8):
        messages.append({"role": "user", "content": QUESTIONS[turn]})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
        new_turn = len(prompt) - len(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=False)) if turn else len(prompt)
        rows.append((len(prompt), len(prompt) - final.num_cached_tokens, new_turn))
        messages.append({"role": "assistant", "content": final.text})
    engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    from vllm_mlx.models import load_model

    tokenizer = load_model(args.model).tokenizer
    doc = document(tokenizer, args.prefix_tokens)
    prompts = [chat_prompt(tokenizer, doc, q) for q in QUESTIONS[: args.questions]]
    doc_ids = tokenizer.encode(doc)
    print(f"model={args.model} prefix~{len(doc_ids)} tokens, {len(prompts)} questions, {args.max_tokens} output tokens each")
    results = {
        "vllm-mlx cold": run_engine(args, prompts, caching=False),
        "vllm-mlx cached": run_engine(args, prompts, caching=True),
        "mlx-lm cached": run_mlx_lm(args, doc_ids, prompts),
    }
    cold = statistics.mean(results["vllm-mlx cold"]["ttft"])
    print(f"\n{'':18s}{'TTFT mean s':>12s}{'(q2..)':>10s}{'total s':>10s}{'TTFT vs cold':>14s}")
    for name, r in results.items():
        later = statistics.mean(r["ttft"][1:]) if len(r["ttft"]) > 1 else r["ttft"][0]
        print(f"{name:18s}{statistics.mean(r['ttft']):12.3f}{later:10.3f}{sum(r['total']):10.2f}{later / cold:13.3f}x")
    print("(q2.. = questions after the first, which warms the cache)")

    print(f"\n8-turn chat: prompt tokens per turn, computed by the engine")
    print(f"{'turn':>5s}{'prompt':>8s}{'computed':>10s}{'new turn':>10s}")
    for turn, (prompt_len, computed, new) in enumerate(multi_turn(args), 1):
        print(f"{turn:5d}{prompt_len:8d}{computed:10d}{new:10d}")


if __name__ == "__main__":
    main()

"""Models with sliding-window or recurrent layers: an 8-turn chat and a batch, against mlx-lm.

No such model can be downloaded here, so this builds one with random weights and real widths
(timing does not depend on weight values), with fewer layers (``--layers``) to keep CPU runs
short, and the default model's tokenizer:
  --family gemma3   Gemma 3 1B's widths (hidden 1152, 4 heads, 1 KV head, head dim 256, MLP 6912,
                    sliding window 512, one global layer in six)
  --family qwen3_5  a Qwen3.5-style hybrid at 2B-class widths (hidden 2048, MLP 6144; gated
                    delta-net layers with 16 key / 16 value heads of 128, one full-attention layer
                    in four with 8 heads, 2 KV heads of 256)

Part 1, an 8-turn chat (a long system prompt, so the conversation outgrows the window): per turn
the prompt tokens computed and the TTFT of
  vllm-mlx cached   prefix caching on (the default): earlier turns' blocks are reused
  vllm-mlx cold     prefix caching off: every turn prefills the whole conversation
  mlx-lm cache      the peer: one mlx-lm prompt cache kept across turns, fed the tokens after the
                    longest common prefix (trimmed where mlx-lm can trim; rebuilt where it cannot,
                    as a rotating sliding-window cache that has wrapped cannot be trimmed)

The cached run also reports the most KV memory the conversation held during each turn, with block
groups (a sliding-window group keeps only the blocks its window reaches) and as one table shared
by every layer would hold it.

Part 2, a batch: ``--batch`` prompts at once, vs ``mlx_lm.batch_generate`` on the same weights
(the ``vllm-mlx bench`` comparison, for this architecture).

    python bench/layer_families.py [--family gemma3|qwen3_5] [--layers 6] [--max-tokens 32] [--batch 8]
                                    [--skip-chat | --skip-batch]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import vllm_mlx  # noqa: F401  first: on Linux it preloads OpenBLAS before anything loads MLX

GEMMA3_1B_WIDTHS = {
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
}
QWEN3_5_2B_CLASS_WIDTHS = {
    "model_type": "qwen3_5",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768,
}
FAMILIES = {"gemma3": GEMMA3_1B_WIDTHS, "qwen3_5": QWEN3_5_2B_CLASS_WIDTHS}
SYSTEM = "You are a meticulous assistant. Answer briefly and precisely. " * 40  # ~480 tokens
TURNS = [
    "What is a block table?", "Why keep a window of keys?", "What is evicted first?",
    "How is padding masked?", "What does preemption cost?", "Why chunked prefill?",
    "What is a cache salt?", "Summarise our talk.",
]  # fmt: skip


def build_model(args, out_dir: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_model import build_tiny_llama

    from vllm_mlx.models import resolve_model

    widths = FAMILIES[args.family]
    return build_tiny_llama(out_dir, resolve_model("default"), num_hidden_layers=args.layers, **widths)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def engine_chat(model_dir: Path, args, caching: bool) -> list[dict]:
    """The 8 turns through the engine; the assistant's turns are its own (greedy) answers, the
    same with caching on and off (the cache is invisible)."""
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=str(model_dir), enable_prefix_caching=caching, force_model_takeover=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    messages, rows = [{"role": "system", "content": SYSTEM}], []
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        prompt = chat_ids(engine.tokenizer, messages)
        start, first, final, held = time.monotonic(), None, None, KVHeld()
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    first = first or (time.monotonic() - start if out.token_ids else None)
                    final = out if out.finished else final
            held.measure(engine)
        computed = len(prompt) - final.num_cached_tokens
        rows.append({"prompt": len(prompt), "computed": computed, "ttft": first, "answer": final.text,
                     "kv_mib": held.grouped / 2**20, "kv_one_table_mib": held.one_table / 2**20})  # fmt: skip
        messages.append({"role": "assistant", "content": final.text})
    engine.shutdown()
    return rows


class KVHeld:
    """The most KV bytes held at a step boundary: as the block groups hold them, and as one block
    table shared by every attention layer would (every block, all layers)."""

    def __init__(self) -> None:
        self.grouped = self.one_table = 0

    def measure(self, engine) -> None:
        usage = engine.cache_snapshot(include_blocks=False)["block_groups"]
        block_tokens = engine.kv_cache.block_size
        per_block = engine.kv_layout.bytes_per_block_token(engine.runner.block_groups) * block_tokens
        self.grouped = max(self.grouped, sum(g["num_used_blocks"] for g in usage) * per_block)
        all_layers = engine.kv_layout.bytes_per_token * block_tokens
        self.one_table = max(self.one_table, usage[0]["num_used_blocks"] * all_layers)


def mlx_lm_chat(model_dir: Path, args, answers: list[str]) -> list[dict]:
    """The peer: one prompt cache across turns, fed what it has not seen (same answers as ours)."""
    import mlx_lm
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

    from vllm_mlx.platform.cpu_backend import choose_weight_format, prepare_model_weights

    model, tokenizer = mlx_lm.load(str(model_dir))
    prepare_model_weights(model, choose_weight_format("auto"))  # the same weights as the engine
    cache, seen = make_prompt_cache(model), []
    messages, rows = [{"role": "system", "content": SYSTEM}], []
    for question, answer in zip(TURNS, answers):
        messages.append({"role": "user", "content": question})
        prompt = chat_ids(tokenizer, messages)
        common = next((i for i, (a, b) in enumerate(zip(seen, prompt)) if a != b), min(len(seen), len(prompt)))
        if common < len(seen) and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, len(seen) - common)
        elif common < len(seen):
            cache, common = make_prompt_cache(model), 0  # cannot trim a wrapped rotating cache
        start, first, generated = time.monotonic(), None, []
        for step in mlx_lm.stream_generate(model, tokenizer, prompt[common:], max_tokens=args.max_tokens, prompt_cache=cache):
            first = first or time.monotonic() - start
            generated.append(step.token)
        seen = prompt + generated[:-1]  # the last sampled token was never fed back
        rows.append({"prompt": len(prompt), "computed": len(prompt) - common, "ttft": first})
        messages.append({"role": "assistant", "content": answer})
    return rows


def batch_throughput(model_dir: Path, args) -> None:
    from vllm_mlx.entrypoints.bench import main as bench_main

    bench_main(["--model", str(model_dir), "--num-requests", str(args.batch), "--max-tokens", str(args.max_tokens),
                "--min-prompt", "64", "--max-prompt", "256", "--scenario", "together"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma3")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--skip-chat", action="store_true", help="run only the batch part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp) / args.family)
        print(f"{FAMILIES[args.family]['model_type']} ({args.family} widths), {args.layers} layers, "
              f"{args.max_tokens} tokens per answer")
        if not args.skip_chat:
            chat(model_dir, args)
        if not args.skip_batch:
            print()
            batch_throughput(model_dir, args)


def chat(model_dir: Path, args) -> None:
    """Part 1: the 8-turn chat, ours cached and cold, and mlx-lm's prompt cache."""
    cached = engine_chat(model_dir, args, caching=True)
    cold = engine_chat(model_dir, args, caching=False)
    peer = mlx_lm_chat(model_dir, args, [row["answer"] for row in cached])
    print(f"\n{'turn':>4s}{'prompt':>8s} | {'computed: cached':>17s}{'cold':>7s}{'mlx-lm':>8s} | "
          f"{'TTFT s: cached':>15s}{'cold':>8s}{'mlx-lm':>8s}")  # fmt: skip
    for turn, (a, b, c) in enumerate(zip(cached, cold, peer), 1):
        print(f"{turn:4d}{a['prompt']:8d} | {a['computed']:17d}{b['computed']:7d}{c['computed']:8d} | "
              f"{a['ttft']:15.3f}{b['ttft']:8.3f}{c['ttft']:8.3f}")  # fmt: skip
    later = slice(1, None)  # turn 1 is cold for everyone
    mean = lambda rows: statistics.mean(r["ttft"] for r in rows[later])  # noqa: E731
    print(f"mean TTFT turns 2-8: cached {mean(cached):.3f} s, cold {mean(cold):.3f} s, mlx-lm {mean(peer):.3f} s; "
          f"cached/cold {mean(cached) / mean(cold):.2f}x, cached/mlx-lm {mean(cached) / mean(peer):.2f}x")  # fmt: skip
    print("KV MiB held at most per turn (cached run), block groups / one table: "
          + ", ".join(f"{r['kv_mib']:.1f}/{r['kv_one_table_mib']:.1f}" for r in cached))


if __name__ == "__main__":
    main()

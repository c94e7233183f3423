"""Many LoRA adapters in one batch against the base model's batch, same engine, same run.

A batch of ``--batch`` requests (free-generation prompts, greedy, ``--tokens`` each, ``ignore_eos``)
on the default model: the base model alone, then the same prompts spread over ``--adapters``
random-weight adapters (rank ``--rank`` on the attention's q and v and the MLP's down
projections, mlx-lm's format), on one engine with ``enable_lora`` and as many slots as adapters.
An engine without ``enable_lora`` runs the base batch too: what wrapping the layers costs. Then
``--rounds`` batches that switch between the adapters, to count slot loads (a switch between
adapters the slots hold reloads nothing). Output tokens per second over the whole batch.
``--dora``: DoRA adapters instead (mlx-lm's ``fine_tune_type: "dora"``, magnitudes moved off the
base rows' norms), whose rows are also rescaled per output feature.

    python bench/lora.py [--batch 16] [--adapters 4] [--tokens 64] [--rank 8] [--repeats 3] [--dora]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "Write a short story about a fox who learns to sail.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe a walk through a forest in autumn.",
]


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int, dora: bool = False) -> Path:
    """A random-weight adapter in mlx-lm's format (what ``mlx_lm.lora`` saves)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
    model, _ = mlx_lm.load(str(model_dir))
    layers = len(model.layers)
    linear_to_lora_layers(model, layers, {"rank": rank, "scale": 2.0, "dropout": 0.0, "keys": keys}, use_dora=dora)
    mx.random.seed(seed)
    factors = {k: mx.random.normal(v.shape) * 0.01 for k, v in tree_flatten(model.parameters()) if "lora_" in k}
    factors.update({k: v * 1.1 for k, v in tree_flatten(model.parameters()) if k.endswith(".m")})  # DoRA only
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), factors)
    kind = "dora" if dora else "lora"
    config = {"fine_tune_type": kind, "num_layers": layers, "lora_parameters": {"rank": rank, "scale": 2.0, "keys": keys}}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def batch_rate(engine, prompts: list[list[int]], tokens: int, adapters: list) -> float:
    """Output tok/s of one batch (``adapters[i]``: row i's ``LoRARequest`` or None)."""
    from vllm_mlx import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for prompt, adapter in zip(prompts, adapters):
        engine.add_request(prompt, params, lora_request=adapter)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dora", action="store_true", help="DoRA adapters instead of LoRA")
    args = parser.parse_args()

    from vllm_mlx.engine.core import EngineCore
    from vllm_mlx.lora import LoRARequest

    plain = EngineCore(model=args.model, max_num_seqs=args.batch, enable_prefix_caching=False)
    path, tokenizer = plain.model_path, plain.tokenizer
    prompts = [tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} ({i})") for i in range(args.batch)]
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(path, folder / f"a{i}", args.rank, i, args.dora))) for i in range(args.adapters)]
    spread = [loras[i % len(loras)] for i in range(args.batch)]
    base_rows = [None] * args.batch
    unwrapped = [batch_rate(plain, prompts, args.tokens, base_rows) for _ in range(args.repeats)]
    plain.shutdown()
    engine = EngineCore(model=args.model, max_num_seqs=args.batch, enable_prefix_caching=False, enable_lora=True,
                        max_loras=args.adapters, max_lora_rank=args.rank, force_model_takeover=True)  # fmt: skip
    base, mixed = [], []
    for _ in range(args.repeats):  # in turn, so that a slow spell of the machine falls on both
        base.append(batch_rate(engine, prompts, args.tokens, base_rows))
        mixed.append(batch_rate(engine, prompts, args.tokens, spread))
    loads_before = engine.lora.loads
    for round_ in range(args.rounds):  # each batch a different pair of adapters: all held in slots
        pair = [loras[round_ % len(loras)], loras[(round_ + 1) % len(loras)]]
        batch_rate(engine, prompts[:4], 4, [pair[i % 2] for i in range(4)])
    switch_loads = engine.lora.loads - loads_before
    engine.shutdown()
    median = statistics.median
    print(f"model {path.name}, weights {engine.weight_format}, batch {args.batch}, {args.tokens} tokens each, "
          f"{args.adapters} {'DoRA' if args.dora else 'LoRA'} adapters of rank {args.rank}, median of {args.repeats}")  # fmt: skip
    print("| engine | rows | output tok/s | ratio to base |")
    print("|---|---|---:|---:|")
    print(f"| without enable_lora | base model | {median(unwrapped):.1f} | {median(unwrapped) / median(base):.2f}x |")
    print(f"| enable_lora | base model | {median(base):.1f} | 1.00x |")
    print(f"| enable_lora | {args.adapters} adapters, {args.batch // args.adapters} rows each | {median(mixed):.1f} | "
          f"{median(mixed) / median(base):.2f}x |")  # fmt: skip
    print(f"slot loads over {args.rounds} batches switching between the {args.adapters} held adapters: {switch_loads}")


if __name__ == "__main__":
    main()

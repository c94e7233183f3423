"""Images: the same picture asked many questions, and image + text requests in one batch.

No vision-language model can be downloaded here, so this builds one with random weights and
real widths (timing does not depend on weight values): Qwen2-VL-2B's vision tower width (1280,
16 heads) and language width (1536, 12 heads, 2 KV heads, MLP 8960), with fewer blocks
(``--vision-depth``, ``--text-layers``) to keep CPU runs short. A 448x448 image is 1,024
patches -> 256 image tokens.

Part 1, repeated image: one image, ``--questions`` different questions, one request at a time,
each a chat turn "<image> question".
  cold        prefix caching and MLLM cache off: every question runs the vision encoder and
              prefills the image's tokens
  mllm only   MLLM cache on, prefix caching off: the encoder runs once, the image tokens are
              still prefilled each time
  warm        both on (the defaults): after the first question the image's KV blocks are
              reused, the encoder is skipped
  mlx-vlm     the peer: mlx_vlm.stream_generate per question (encodes and prefills each time)
Reports mean TTFT, vision-encoder runs per request, and ratios (the first question of the warm
run is the cold start and is excluded from its mean; the published vllm-mlx figure is a 28x
speed-up on repeated image queries).

Part 2, mixed batch: ``--image-requests`` requests with distinct images plus as many text-only
requests, all submitted at once, vs the image requests run one by one (then the text ones).
Reports generated tokens per second.

    python bench/multimodal.py [--questions 8] [--max-tokens 16] [--vision-depth 8] [--text-layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import vllm_mlx  # noqa: F401  first: on Linux it preloads OpenBLAS before anything loads MLX

QUESTIONS = [
    "What is in this picture?", "What colours dominate?", "Is there a person?", "Describe the texture.",
    "Is it day or night?", "What is in the top left corner?", "Count the shapes.", "Give it a title.",
    "What would you change?", "Is it a photo or a drawing?", "Where could this be?", "What is the mood?",
]  # fmt: skip


def build_model(args, out_dir: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_vlm import build_tiny_qwen2_vl

    text = {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
            "num_hidden_layers": args.text_layers, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}  # fmt: skip
    vision = {"depth": args.vision_depth, "embed_dim": 1280, "num_heads": 16, "mlp_ratio": 4, "hidden_size": 1536}
    side = args.image_side
    return build_tiny_qwen2_vl(out_dir, text_config=text, vision_config=vision, max_pixels=side * side, weight_scale=1.0)


def picture(seed: int, side: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


def chat(question: str, image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def run_questions(model_dir: Path, args, image, **options) -> dict:
    """Ask the questions one at a time; TTFT per question and encoder runs in all."""
    from vllm_mlx import LLM, SamplingParams

    llm = LLM(str(model_dir), force_model_takeover=True, **options)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ttft = []
    for question in QUESTIONS[: args.questions]:
        start = time.monotonic()
        first = None
        for out in llm.stream(llm.chat_prompt(chat(question, image)), params):
            if first is None and out.new_token_ids:
                first = time.monotonic() - start
        ttft.append(first)
    runs = llm.engine.runner.vision_encoder_runs
    llm.shutdown()
    return {"ttft": ttft, "encoder_runs": runs}


def run_mlx_vlm(model_dir: Path, args, image) -> dict:
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate

    model, processor = load(str(model_dir))
    ttft = []
    for question in QUESTIONS[: args.questions]:
        prompt = processor.tokenizer.apply_chat_template(chat(question, image), add_generation_prompt=True, tokenize=False)
        start = time.monotonic()
        first = None
        for _ in stream_generate(model, processor, prompt, image=[image], max_tokens=args.max_tokens, temperature=0.0):
            first = first or time.monotonic() - start
        ttft.append(first)
    return {"ttft": ttft, "encoder_runs": len(ttft)}


def run_mixed(model_dir: Path, args, together: bool) -> tuple[float, int]:
    """(seconds, generated tokens) for the mixed workload, batched or one by one."""
    from vllm_mlx import LLM, SamplingParams

    llm = LLM(str(model_dir), force_model_takeover=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    images = [picture(100 + i, args.image_side) for i in range(args.image_requests)]
    prompts = [llm.chat_prompt(chat(QUESTIONS[i % len(QUESTIONS)], im)) for i, im in enumerate(images)]
    prompts += [f"Write a short note number {i} about caching." for i in range(args.image_requests)]
    start = time.monotonic()
    outs = llm.generate(prompts, params) if together else [o for p in prompts for o in llm.generate(p, params)]
    elapsed = time.monotonic() - start
    llm.shutdown()
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def mean_after_first(values: list[float]) -> float:
    return statistics.mean(values[1:]) if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vision-depth", type=int, default=8)
    parser.add_argument("--text-layers", type=int, default=8)
    parser.add_argument("--image-side", type=int, default=448)
    parser.add_argument("--image-requests", type=int, default=4)
    parser.add_argument("--skip-peer", action="store_true", help="do not run mlx-vlm")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp) / "qwen2-vl-bench")
        image = picture(0, args.image_side)
        print(f"model: random-weight Qwen2-VL widths, {args.vision_depth} vision blocks, {args.text_layers} "
              f"text layers; image {args.image_side}x{args.image_side}; {args.questions} questions, "
              f"{args.max_tokens} tokens each")  # fmt: skip
        results = {
            "cold": run_questions(model_dir, args, image, enable_prefix_caching=False, enable_mllm_cache=False),
            "mllm only": run_questions(model_dir, args, image, enable_prefix_caching=False),
            "warm": run_questions(model_dir, args, image),
        }
        if not args.skip_peer:
            results["mlx-vlm"] = run_mlx_vlm(model_dir, args, image)
        cold = statistics.mean(results["cold"]["ttft"])
        print("\nPart 1: the same image, different questions ('mllm only' and 'warm' leave out their first,")
        print("cold-start question; 'cold' and 'mlx-vlm' average all)")
        print(f"{'run':<10} {'mean TTFT s':>12} {'encoder runs/request':>21} {'vs cold':>8}")
        for name, r in results.items():
            mean = statistics.mean(r["ttft"]) if name in ("cold", "mlx-vlm") else mean_after_first(r["ttft"])
            print(f"{name:<10} {mean:>12.3f} {r['encoder_runs'] / len(r['ttft']):>21.2f} {cold / mean:>7.1f}x")
        if "mlx-vlm" in results:
            peer = statistics.mean(results["mlx-vlm"]["ttft"])
            warm = mean_after_first(results["warm"]["ttft"])
            print(f"warm vllm-mlx vs mlx-vlm per question: {peer / warm:.1f}x faster to first token")

        print(f"\nPart 2: {args.image_requests} image + {args.image_requests} text requests")
        batched_s, batched_tokens = run_mixed(model_dir, args, together=True)
        serial_s, serial_tokens = run_mixed(model_dir, args, together=False)
        print(f"batched     {batched_s:7.2f} s  {batched_tokens / batched_s:7.2f} tok/s")
        print(f"one by one  {serial_s:7.2f} s  {serial_tokens / serial_s:7.2f} tok/s")
        print(f"batched / one by one: {serial_s / batched_s:.2f}x")


if __name__ == "__main__":
    main()

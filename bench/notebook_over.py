"""``%%generate --over``: 256 short prompts as one ``--over`` run vs one ``LLM.generate`` call vs
a loop of blocking ``%%generate --wait`` cells, one prompt at a time.

  llm    ``LLM.generate(prompts)``: the whole list in one call (the offline ceiling)
  over   ``generate_over(prompts, "{item}")`` in an in-process IPython shell: rows go to the
         kernel-resident engine with backpressure (``--max-in-flight``, default 2x max_num_seqs)
  loop   one ``%%generate --wait`` cell per prompt, in the same shell and engine

Every prompt is sent as raw text (``--raw``: no chat template, as ``LLM.generate`` does), greedy,
with exactly ``--max-tokens`` output tokens each, so every mode makes the same tokens. The tiny
random-weight llama of the test suite is the default model (``--model default`` for the real one;
``--loop-rows N`` times the loop on the first N prompts and scales it to all of them).

    python bench/notebook_over.py [--model tiny|default|PATH] [--rows 256] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

SUBJECTS = ["the sea", "a cat", "autumn", "a train", "coffee", "the moon", "a library", "rain"]
TASKS = ["Write one sentence about", "Give a title for a story about", "Name a colour that suits",
         "Describe in three words", "Ask a question about", "Make a rhyme with"]  # fmt: skip


def prompts(n: int) -> list[str]:
    return [f"{TASKS[i % len(TASKS)]} {SUBJECTS[i % len(SUBJECTS)]} (#{i})." for i in range(n)]


def tiny_model(out: Path) -> Path:
    """The test suite's tiny random-weight llama, with the default model's tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_model import build_tiny_llama

    from vllm_mlx.models import resolve_model

    return build_tiny_llama(out, resolve_model("default"))


def time_llm(model: str, texts: list[str], max_tokens: int, options: dict) -> tuple[float, int]:
    from vllm_mlx import LLM, SamplingParams

    llm = LLM(model, **options)
    try:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0)
        llm.generate(texts[:4], params)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(texts, params)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    return wall, sum(len(o.token_ids) for o in outputs)


def notebook_shell(model: str, options: dict):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vllm_mlx_jupyter")
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items())
    with capture_output():
        shell.run_line_magic("vllm_mlx", f"load {model} {flags}")
        shell.run_cell_magic("generate", "--raw --max-tokens 4 --wait", "Warm up.")
    return shell


def time_over(shell, texts: list[str], max_tokens: int) -> tuple[float, int]:
    from IPython.utils.capture import capture_output

    from vllm_mlx_jupyter import generate_over

    start = time.perf_counter()
    with capture_output():
        handle = generate_over(texts, "{item}", raw=True, max_tokens=max_tokens, min_tokens=max_tokens,
                               temperature=0.0, raw_braces=True, ipython=shell)  # fmt: skip
        handle.wait()
    wall = time.perf_counter() - start
    assert handle.state == "done" and not handle.errors, (handle.state, handle.errors)
    return wall, handle.progress.tokens


def time_loop(shell, texts: list[str], max_tokens: int) -> tuple[float, int]:
    from IPython.utils.capture import capture_output

    line = f"--raw --raw-braces --max-tokens {max_tokens} --min-tokens {max_tokens} --temperature 0 --wait"
    tokens = 0
    start = time.perf_counter()
    with capture_output():
        for text in texts:
            gen = shell.run_cell_magic("generate", line, text)
            tokens += len(gen.output.token_ids)
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (built here), default, or a model path")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--loop-rows", type=int, default=None, help="time the loop on this many rows (default: all)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_model(Path(tmp) / "tiny")) if args.model == "tiny" else args.model
        options = {"num_kv_blocks": args.num_kv_blocks}
        texts = prompts(args.rows)
        llm_wall, llm_tokens = time_llm(model, texts, args.max_tokens, options)
        shell = notebook_shell(model, options)
        over_wall, over_tokens = time_over(shell, texts, args.max_tokens)
        loop_texts = texts[: args.loop_rows or args.rows]
        loop_wall, loop_tokens = time_loop(shell, loop_texts, args.max_tokens)
        shell.run_line_magic("unload_ext", "vllm_mlx_jupyter")

    scale = len(texts) / len(loop_texts)
    loop_wall, loop_tokens = loop_wall * scale, round(loop_tokens * scale)
    print(f"{args.rows} prompts x {args.max_tokens} tokens, model {args.model}")
    print(f"{'mode':<34}{'wall s':>9}{'tokens':>8}{'tok/s':>9}")
    rows = [("LLM.generate (one call)", llm_wall, llm_tokens), ("--over", over_wall, over_tokens),
            (f"--wait loop{' (scaled)' if scale != 1 else ''}", loop_wall, loop_tokens)]  # fmt: skip
    for name, wall, tokens in rows:
        print(f"{name:<34}{wall:>9.2f}{tokens:>8}{tokens / wall:>9.1f}")
    over_rate = over_tokens / over_wall
    print(f"--over / LLM.generate throughput: {over_rate / (llm_tokens / llm_wall):.2f}x (target >= 0.95x)")
    print(f"--over vs the --wait loop: {loop_wall / over_wall:.1f}x faster (target >= 5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

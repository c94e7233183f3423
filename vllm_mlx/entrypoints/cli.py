"""The ``vllm-mlx`` command line: ``generate``, ``models``, ``pull``.

Errors the user can fix (a missing model path, a bad GGUF, a failed download, bad sampling
values) print one line to stderr and exit with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllm_mlx import __version__
from vllm_mlx.errors import VllmMlxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-mlx", description="LLM inference on Apple's MLX.")
    parser.add_argument("--version", action="version", version=f"vllm-mlx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    generate.add_argument("--model", default="default", help="MLX directory, .gguf file, hub id or 'default'")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                          help="apply the model's chat template (default: on)")  # fmt: skip
    generate.set_defaults(handler=run_generate)

    models = commands.add_parser("models", help="list the models prepared in the cache")
    models.set_defaults(handler=run_models)

    pull = commands.add_parser("pull", help="prepare a model ahead of time (e.g. 'default')")
    pull.add_argument("model", nargs="?", default="default")
    pull.set_defaults(handler=run_pull)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from vllm_mlx.request import SamplingParams
    from vllm_mlx.simple_generate import generate_text

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )  # fmt: skip
    for i, prompt in enumerate(args.prompts):
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt}")
        for piece in generate_text(args.model, prompt, params, chat=args.chat):
            print(piece, end="", flush=True)
        print()
    return 0


def run_models(args: argparse.Namespace) -> int:
    from vllm_mlx.models import list_cached_models, models_dir

    cached = list_cached_models()
    if not cached:
        print(f"no models prepared yet in {models_dir()} (try: vllm-mlx pull default)")
    for model in cached:
        print(f"{model.name:40s} {model.size_bytes / 1e6:8.1f} MB  {model.path}  ({model.source})")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from vllm_mlx.models import resolve_model

    print(resolve_model(args.model))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (VllmMlxError, ValueError) as exc:
        print(f"vllm-mlx: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

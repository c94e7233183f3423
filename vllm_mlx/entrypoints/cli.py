"""The ``vllm-mlx`` command line: ``generate``, ``demo``, ``bench``, ``serve``, ``models``, ``pull``.

Errors the user can fix (a missing model path, a bad GGUF, a failed download, bad sampling
values) print one line to stderr and exit with status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllm_mlx import __version__
from vllm_mlx.config import ENGINE, EngineConfig
from vllm_mlx.config.options import add_arguments, argparse_type, options_from_args
from vllm_mlx.config.options import parse_bytes as _parse_bytes
from vllm_mlx.config.options import parse_memory as _parse_memory
from vllm_mlx.entrypoints.openai.cli_args import add_serve_arguments, serve_engine_options
from vllm_mlx.platform.errors import VllmMlxError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-mlx", description="LLM inference on Apple's MLX.")
    parser.add_argument("--version", action="version", version=f"vllm-mlx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate text for one or more prompts (batched)")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_model_arguments(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                          help="apply the model's chat template, if it has one (default: on)")  # fmt: skip
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--image", action="append", default=[], metavar="PATH_OR_URL",
                          help="an image for every prompt (vision-language models; repeat for several)")  # fmt: skip
    generate.set_defaults(handler=run_generate)

    bench = commands.add_parser("bench", add_help=False, help="throughput and TTFT vs mlx-lm (see: bench --help)")
    bench.set_defaults(handler=run_bench)  # its own parser takes the rest (see main)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (needs vllm-mlx[server])")
    add_model_arguments(serve)
    add_serve_arguments(serve, parse_bytes)
    serve.set_defaults(handler=run_serve)

    demo = commands.add_parser("demo", help="run the quick-start notebook headlessly and summarise it")
    demo.add_argument("notebook", nargs="?", default="notebooks/quickstart.ipynb")
    demo.add_argument("--output", default=None, help="where to write the executed notebook")
    demo.add_argument("--model", default=None, help="the model the notebook loads (default: 'default')")
    demo.set_defaults(handler=run_demo)

    models = commands.add_parser("models", help="list the models prepared in the cache (or, with --supported, "
                                 "the architectures the engine runs)")  # fmt: skip
    models.add_argument("--supported", nargs="*", default=None, metavar="ARCH",
                        help="list every mlx-lm and mlx-vlm architecture installed as supported, runs-untested, "
                        "refused, not-a-generator or unknown (with the reason); name some to classify only "
                        "those")  # fmt: skip
    models.set_defaults(handler=run_models)

    convert = commands.add_parser("convert", help="convert a GGUF file into an MLX model directory (mlx-lm loads it)")
    convert.add_argument("gguf", help="the .gguf file")
    convert.add_argument("output", help="the directory to write (must not exist)")
    convert.add_argument("--scale-dtype", choices=("float16", "float32"), default=None,
                         help="dtype of the quantization scales (default: float16 on Metal, float32 on the CPU, "
                         "where float16 scales are ~40x slower)")  # fmt: skip
    convert.set_defaults(handler=run_convert)

    pull = commands.add_parser(
        "pull", help="prepare a model ahead of time (e.g. 'default', 'gemma3-270m-q4_k_m', a .gguf file)"
    )
    pull.add_argument("model", nargs="?", default="default")
    pull.set_defaults(handler=run_pull)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and engine options shared by the commands that run the engine (declared on
    ``EngineConfig``'s fields: ``vllm_mlx/config/``)."""
    add_arguments(parser, EngineConfig, ENGINE)


def engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields set by ``add_model_arguments`` (unset ones keep their defaults)."""
    options = options_from_args(args, EngineConfig, ENGINE)
    options.pop("model")  # the commands pass it on their own (``serve`` also takes it as MODEL)
    return options


parse_memory = argparse_type(_parse_memory)
"""A KV budget: a size like 512M / 2G, or a fraction of available memory like 0.3."""
parse_bytes = argparse_type(_parse_bytes)
"""A size like 512M / 2G / 4096."""


def run_generate(args: argparse.Namespace) -> int:
    from vllm_mlx.core.request import SamplingParams
    from vllm_mlx.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )  # fmt: skip
    llm = LLM(args.model, **engine_options(args))
    _say_backend(llm.engine.weight_format)
    use_template = args.chat and llm.has_chat_template
    prompts = [_cli_prompt(llm, text, args.image, use_template) for text in args.prompts]
    errors = []
    if args.stream and len(prompts) == 1:
        for output in llm.stream(prompts[0], params):
            print(output.new_text, end="", flush=True)
        print()
        errors.append(output.error)
    else:
        for i, output in enumerate(llm.generate(prompts, params)):
            if len(prompts) > 1:
                print(f"--- [{i}] {args.prompts[i]}")
            print(output.text)
            errors.append(output.error)
    llm.shutdown()
    for error in filter(None, errors):  # e.g. an unreadable image: that prompt alone failed
        print(f"vllm-mlx: error: {error}", file=sys.stderr)
    return 1 if any(errors) else 0


def _say_backend(weight_format: str | None) -> None:
    """One line on stderr (stdout keeps the answers): device, BLAS and weights; and once, the
    fix when MLX runs on its reference BLAS."""
    from vllm_mlx.platform.cpu_backend import backend_summary, warn_reference_blas

    print(f"vllm-mlx: {backend_summary(weight_format)}", file=sys.stderr, flush=True)
    warn_reference_blas()


def _cli_prompt(llm, text: str, images: list[str], use_template: bool) -> dict:
    """One prompt of ``generate``: templated as a user turn (images first) when the model
    has a chat template, else the raw text (the engine puts the images first)."""
    if use_template:
        parts = [{"type": "image_url", "image_url": {"url": image}} for image in images]
        return llm.chat_prompt([{"role": "user", "content": [*parts, {"type": "text", "text": text}]}])
    return {"prompt": text, "multi_modal_data": {"image": images}}


def run_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from vllm_mlx.entrypoints import bench

    return bench.main(rest)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from vllm_mlx.entrypoints.openai.server import run_server
    except ImportError as exc:
        hint = "pip install 'vllm-mlx[server]'"
        print(f"vllm-mlx: error: the server needs extra packages ({exc.name}): {hint}", file=sys.stderr)
        return 1
    args.model = args.model_arg or args.model
    options = {**engine_options(args), **serve_engine_options(args)}
    if args.distributed or (args.tensor_parallel_size or 1) > 1 or (args.pipeline_parallel_size or 1) > 1:
        from vllm_mlx.entrypoints import distributed_serve

        if args.distributed:
            return distributed_serve.serve_rank(args, options, run_server)
        return distributed_serve.launch_local(args, args.argv)
    return run_server(args, options)


def run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    notebook = Path(args.notebook)
    if not notebook.is_file():
        raise VllmMlxError(f"no notebook at {notebook} (run from the repository root, or pass its path)")
    try:
        from vllm_mlx_jupyter.demo import format_summary, run_demo
    except ImportError as exc:
        raise VllmMlxError(f"the demo needs the notebook extras ({exc.name}): pip install -e '.[jupyter]'") from exc
    output = Path(args.output) if args.output else None
    try:
        summary = run_demo(notebook, output, model=args.model)
    except Exception as exc:  # nbclient's CellExecutionError carries the cell's traceback
        if type(exc).__name__ != "CellExecutionError":
            raise
        raise VllmMlxError(f"a cell of {notebook} failed: {str(exc).strip().splitlines()[-1]}") from exc
    print(format_summary(summary))
    if summary.get("blas_warning"):  # the kernel's own finding: it ran the engine
        print(f"vllm-mlx: {summary['blas_warning']}", file=sys.stderr)
    return 0


def run_models(args: argparse.Namespace) -> int:
    from vllm_mlx.models import list_cached_models, models_dir

    if args.supported is not None:
        return run_supported(args.supported)
    cached = list_cached_models()
    if not cached:
        print(f"no models prepared yet in {models_dir()} (try: vllm-mlx pull default)")
    for model in cached:
        print(f"{model.name:40s} {model.size_bytes / 1e6:8.1f} MB  {model.path}  ({model.source})")
    return 0


def run_supported(names: list[str]) -> int:
    """``models --supported``: the whole (cached) classification, or just ``names``."""
    from vllm_mlx.models import support

    if not names:
        print(support.format_table(support.all_architectures(progress=support.progress_bar())))
        return 0
    installed = {support.TEXT: support.text_architectures(), support.VISION: support.vision_architectures()}
    missing = sorted(set(names) - set(installed[support.TEXT]) - set(installed[support.VISION]))
    if missing:
        raise VllmMlxError(f"no installed mlx-lm or mlx-vlm architecture named {', '.join(missing)}")
    wanted = {source: [n for n in found if n in names] for source, found in installed.items()}
    print(support.format_table(support.classify(wanted)))
    return 0


def run_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vllm_mlx.models.gguf import convert_gguf

    source, output = Path(args.gguf), Path(args.output)
    if output.exists():
        raise VllmMlxError(f"{output} exists: choose a new directory")
    print(convert_gguf(source, output, scale_dtype=args.scale_dtype, source=str(source.resolve())))
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from vllm_mlx.models import resolve_model

    print(resolve_model(args.model))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.handler is run_bench:
            return run_bench(args, rest)
        if rest:
            build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
        args.argv = argv  # serve --tensor-parallel-size re-executes it as every rank
        return args.handler(args)
    except (VllmMlxError, ValueError) as exc:
        print(f"vllm-mlx: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

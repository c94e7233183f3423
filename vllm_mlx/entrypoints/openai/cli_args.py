"""Flags of ``vllm-mlx serve`` (no server imports here: building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from vllm_mlx.config import SERVER_GROUP, EngineConfig, ServingOptions
from vllm_mlx.config.options import (
    DISTRIBUTED_GROUP,
    SERVE,
    add_arguments,
    argparse_type,
    options_from_args,
    parse_count,
)
from vllm_mlx.entrypoints.openai import DEFAULT_MAX_BODY_BYTES
from vllm_mlx.multimodal.media_policy import SERVER_MAX_IMAGES, SERVER_MAX_PIXELS, MediaPolicy, parse_limit_mm_per_prompt
from vllm_mlx.platform.validation import RequestLimits


def add_serve_arguments(parser: argparse.ArgumentParser, parse_bytes) -> None:
    """Server flags and the engine/cache flags beyond the shared ``add_model_arguments``."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="model to serve (same as --model)")
    server = parser.add_argument_group(SERVER_GROUP)
    server.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None, help="the model id clients send (default: from MODEL)")
    server.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_MLX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path but /health and /version (default: $VLLM_MLX_API_KEY)",
    )
    server.add_argument(
        "--max-body-size", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES, help="request body limit, e.g. 4M"
    )
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_arguments(parser, ServingOptions, SERVE)  # ServingOptions' declared flags, in this group
    _add_limit_arguments(parser.add_argument_group("request limits (raise them for trusted clients)"))
    _add_media_arguments(parser.add_argument_group("media inputs (none from outside the request by default)"))
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
        help="serve these adapters beside the model (turns on --enable-lora); a request's `model` picks one by NAME",
    )  # fmt: skip
    lora.add_argument(
        "--enable-lora-loading", default=None, metavar="DIR",
        help="turn on /v1/load_lora_adapter and /v1/unload_lora_adapter for adapter folders inside DIR (and --enable-lora)",
    )  # fmt: skip
    _add_distributed_arguments(parser.add_argument_group(DISTRIBUTED_GROUP))
    # Engine flags shared with other commands come from cli.add_model_arguments; these are the
    # server's own (``generate`` uses --seed for its sampling): --seed and the distributed timeouts.
    add_arguments(parser, EngineConfig, SERVE)


_count = argparse_type(parse_count)


def _add_distributed_arguments(group) -> None:
    group.add_argument("--tensor-parallel-size", type=_count, default=None, metavar="N",
                       help="split the model over N processes on this machine (a loopback ring); "
                       "this process supervises them (default: 1, no split)")  # fmt: skip
    group.add_argument("--pipeline-parallel-size", type=_count, default=None, metavar="N",
                       help="split the model's layers into N stages, one per process on this machine "
                       "(a loopback ring; architectures with mlx-lm's pipeline()); "
                       "not with --tensor-parallel-size")  # fmt: skip
    group.add_argument("--distributed", action="store_true",
                       help="run as one rank of 'mlx.launch ... -- vllm-mlx serve MODEL --distributed': "
                       "rank 0 serves HTTP, the others hold their shard of the model")  # fmt: skip
    group.add_argument("--pipeline-parallel", action="store_true",
                       help="with --distributed: every rank holds a stage of the model's layers instead of "
                       "a shard of every layer (give it to every rank)")  # fmt: skip


def _add_limit_arguments(group) -> None:
    """One ``--max-...`` flag per ``RequestLimits`` field, with its safe default."""
    for limit in dataclasses.fields(RequestLimits):
        flag = "--" + limit.name.replace("_", "-")
        group.add_argument(flag, type=int, default=limit.default, metavar="N", help=f"{limit.metadata['help']} (default: {limit.default})")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The ``RequestLimits`` set by the flags above."""
    return RequestLimits(**{limit.name: getattr(args, limit.name) for limit in dataclasses.fields(RequestLimits)})


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """The ``ServingOptions`` set by the flags above."""
    return ServingOptions(limits=request_limits(args), **options_from_args(args, ServingOptions, SERVE))


def serve_engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields set by the flags above (``--lora-modules`` turns LoRA on)."""
    wants_lora = bool(args.lora_modules) or args.enable_lora_loading is not None
    return options_from_args(args, EngineConfig, SERVE) | ({"enable_lora": True} if wants_lora else {})


def lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` (vLLM's ``--lora-modules`` form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def lora_requests(args: argparse.Namespace) -> list:
    """``--lora-modules`` as ``LoRARequest``s, ids 1, 2, ... in the order given."""
    from vllm_mlx.lora.request import LoRARequest

    modules = args.lora_modules or []
    names = [name for name, _ in modules]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise SystemExit(f"vllm-mlx serve: --lora-modules names {duplicate!r} twice")
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(modules)]


def with_adapter_slots(engine_options: dict, num_adapters: int) -> dict:
    """``engine_options`` with a slot for each adapter ``--lora-modules`` names: ``max_loras`` is
    ``--max-loras`` (or its default) unless the adapters are more, so that adapters loaded later
    at runtime still find the slots the operator expects."""
    if not num_adapters:
        return engine_options
    slots = engine_options.get("max_loras", EngineConfig.max_loras)
    return {**engine_options, "max_loras": max(slots, num_adapters)}


def _add_media_arguments(group) -> None:
    """Where request images may come from, and how many and how large (``MediaPolicy.server``)."""
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests read image files inside DIR (absolute paths or file:// URLs)")  # fmt: skip
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="let requests fetch http(s) image URLs of these hosts (public addresses only)")  # fmt: skip
    group.add_argument("--allow-remote-media", action="store_true",
                       help="let requests fetch http(s) image URLs of any public host")  # fmt: skip
    example = '{"image": 8}'
    group.add_argument("--limit-mm-per-prompt", type=_image_limit, default=None, metavar="JSON",
                       help=f"most images per prompt, e.g. '{example}' (default: {SERVER_MAX_IMAGES})")  # fmt: skip
    group.add_argument("--max-image-pixels", type=int, default=SERVER_MAX_PIXELS, metavar="N",
                       help="largest image accepted, in pixels (width x height), checked before decoding")  # fmt: skip


def _image_limit(text: str) -> int:
    try:
        return parse_limit_mm_per_prompt(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--limit-mm-per-prompt: ")) from None


def serve_media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The server's ``MediaPolicy`` from the flags above (``ValueError`` for a missing DIR)."""
    limit = args.limit_mm_per_prompt
    return MediaPolicy.server(
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        allow_remote_media=args.allow_remote_media,
        max_images_per_prompt=SERVER_MAX_IMAGES if limit is None else limit,
        max_pixels=args.max_image_pixels,
    )

"""Flags of ``vllm-mlx serve`` (no server imports here: building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from vllm_mlx.config import (
    DISTRIBUTED_GROUP,
    SERVE,
    EngineConfig,
    add_arguments,
    argparse_type,
    options_from_args,
    parse_seconds,
)
from vllm_mlx.entrypoints.openai import DEFAULT_MAX_BODY_BYTES, DEFAULT_STREAM_STALL_TIMEOUT_S
from vllm_mlx.media_policy import SERVER_MAX_IMAGES, SERVER_MAX_PIXELS, MediaPolicy, parse_limit_mm_per_prompt
from vllm_mlx.tool_parsers.registry import ALIASES, PARSER_NAMES
from vllm_mlx.validation import RequestLimits


def add_serve_arguments(parser: argparse.ArgumentParser, parse_bytes) -> None:
    """Server flags and the engine/cache flags beyond the shared ``add_model_arguments``."""
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help="model to serve (same as --model)")
    server = parser.add_argument_group("server")
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
    server.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (tells clients about other tenants' prompts)",
    )
    server.add_argument(
        "--cache-stats-per-request",
        action="store_true",
        help="list live requests (ids, token counts) in /v1/cache/stats (default: aggregates only)",
    )
    server.add_argument(
        "--enable-cache-stats-disclosure",
        action="store_true",
        help="show prefix-cache counters (hits, cached tokens, allocations; also per cache_salt) in /v1/cache/stats, "
        "/v1/cache/blocks and /metrics (they tell clients about other tenants' prompts)",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted([*PARSER_NAMES, *ALIASES]),
        help="the model's output format for tool calls (and gpt-oss's Harmony channels); default: recognised from the chat template",
    )
    server.add_argument(
        "--tokenizer-threads", type=_positive_int, default=4, metavar="N",
        help="prompts tokenized at once (default: 4); a prompt too long for the context is refused before",
    )  # fmt: skip
    server.add_argument(
        "--allow-json-whitespace",
        action="store_true",
        help="let JSON constraints (response_format; structured_outputs json without disable_any_whitespace) "
        "have free whitespace between tokens (default: compact JSON, which sampling models finish)",
    )
    server.add_argument(
        "--stream-stall-timeout", type=argparse_type(parse_seconds), default=DEFAULT_STREAM_STALL_TIMEOUT_S, metavar="SECONDS",
        help="abort a streamed request whose client reads nothing for this long, freeing its KV blocks "
        f"(0 = never; default: {DEFAULT_STREAM_STALL_TIMEOUT_S:g})",
    )
    _add_limit_arguments(parser.add_argument_group("request limits (raise them for trusted clients)"))
    _add_media_arguments(parser.add_argument_group("media inputs (none from outside the request by default)"))
    _add_distributed_arguments(parser.add_argument_group(DISTRIBUTED_GROUP))
    # Engine flags shared with other commands come from cli.add_model_arguments; these are the
    # server's own (``generate`` uses --seed for its sampling): --seed and the distributed timeouts.
    add_arguments(parser, EngineConfig, SERVE)


def _add_distributed_arguments(group) -> None:
    group.add_argument("--tensor-parallel-size", type=_positive_int, default=None, metavar="N",
                       help="split the model over N processes on this machine (a loopback ring); "
                       "this process supervises them (default: 1, no split)")  # fmt: skip
    group.add_argument("--pipeline-parallel-size", type=_positive_int, default=None, metavar="N",
                       help="split the model's layers into N stages, one per process on this machine "
                       "(a loopback ring; architectures with mlx-lm's pipeline()); "
                       "not with --tensor-parallel-size")  # fmt: skip
    group.add_argument("--distributed", action="store_true",
                       help="run as one rank of 'mlx.launch ... -- vllm-mlx serve MODEL --distributed': "
                       "rank 0 serves HTTP, the others hold their shard of the model")  # fmt: skip
    group.add_argument("--pipeline-parallel", action="store_true",
                       help="with --distributed: every rank holds a stage of the model's layers instead of "
                       "a shard of every layer (give it to every rank)")  # fmt: skip


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_limit_arguments(group) -> None:
    """One ``--max-...`` flag per ``RequestLimits`` field, with its safe default."""
    for limit in dataclasses.fields(RequestLimits):
        flag = "--" + limit.name.replace("_", "-")
        group.add_argument(flag, type=int, default=limit.default, metavar="N", help=f"{limit.metadata['help']} (default: {limit.default})")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The ``RequestLimits`` set by the flags above."""
    return RequestLimits(**{limit.name: getattr(args, limit.name) for limit in dataclasses.fields(RequestLimits)})


def serve_engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields set by the flags above."""
    return options_from_args(args, EngineConfig, SERVE)


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

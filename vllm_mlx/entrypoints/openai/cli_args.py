"""Flags of ``vllm-mlx serve`` (no server imports here: building the CLI parser stays cheap)."""

from __future__ import annotations

import argparse
import os

from vllm_mlx.entrypoints.openai import DEFAULT_MAX_BODY_BYTES


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
        help="require 'Authorization: Bearer KEY' on /v1 (default: $VLLM_MLX_API_KEY)",
    )
    server.add_argument(
        "--max-body-size", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES, help="request body limit, e.g. 4M"
    )
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = parser.add_argument_group("engine and cache")
    engine.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    engine.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--seed", type=int, default=None, help="seed for requests that bring none")
    engine.add_argument("--weight-format", default="auto", choices=["auto", "quantized", "float32"])


def serve_engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields set by the flags above."""
    options = {
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "weight_format": args.weight_format,
    }
    for name in ("max_model_len", "num_kv_blocks", "seed"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options

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
    # Engine flags shared with other commands come from cli.add_model_arguments; this one is the
    # server's own (``generate`` uses --seed for its sampling).
    parser.add_argument("--seed", type=int, default=None, help="seed drawn from for requests that bring none")


def serve_engine_options(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields set by the flags above."""
    return {"seed": args.seed} if args.seed is not None else {}

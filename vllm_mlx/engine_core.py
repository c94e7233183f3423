"""The public path ``vllm_mlx.engine_core``: a face of ``vllm_mlx.engine.core``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.engine.core``."""

# face: the code lives in vllm_mlx/engine/core.py; edit it there.
from vllm_mlx.engine.core import (  # noqa: F401
    PreparedModel,
    prepare_engine_model,
    EngineCore,
    EngineConfig,
    kv_budget_bytes,
    kv_bytes_per_token,
    kv_shape,
)
from vllm_mlx.engine.async_engine import AsyncEngineCore  # noqa: F401

__all__ = [
    "PreparedModel",
    "prepare_engine_model",
    "EngineCore",
    "EngineConfig",
    "kv_budget_bytes",
    "kv_bytes_per_token",
    "kv_shape",
    "AsyncEngineCore",
]

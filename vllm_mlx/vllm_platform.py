"""The public path ``vllm_mlx.vllm_platform``: a face of ``vllm_mlx.plugin.platform``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.plugin.platform``."""

# face: the code lives in vllm_mlx/plugin/platform.py; edit it there.
from vllm_mlx.plugin.platform import (  # noqa: F401
    SUPPORTED_VLLM_VERSION,
    DEFAULT_BLOCK_SIZE,
    WORKER_CLS,
    ATTENTION_BACKEND_CLS,
    register,
    UnsupportedVllmFeatureError,
    MLXPlatform,
    check_vllm_version,
    unsupported_request_features,
    host_total_memory,
)

__all__ = [
    "SUPPORTED_VLLM_VERSION",
    "DEFAULT_BLOCK_SIZE",
    "WORKER_CLS",
    "ATTENTION_BACKEND_CLS",
    "register",
    "UnsupportedVllmFeatureError",
    "MLXPlatform",
    "check_vllm_version",
    "unsupported_request_features",
    "host_total_memory",
]

"""The public path ``vllm_mlx.worker``: a face of ``vllm_mlx.plugin.worker``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.plugin.worker``."""

# face: the code lives in vllm_mlx/plugin/worker.py; edit it there.
from vllm_mlx.plugin.worker import (  # noqa: F401
    UNLIMITED_TOKENS,
    MLXPagedAttentionBackend,
    RequestState,
    WorkerStats,
    MLXWorker,
    activation_dtype,
)

__all__ = [
    "UNLIMITED_TOKENS",
    "MLXPagedAttentionBackend",
    "RequestState",
    "WorkerStats",
    "MLXWorker",
    "activation_dtype",
]

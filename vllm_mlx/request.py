"""The public path ``vllm_mlx.request``: a face of ``vllm_mlx.core.request``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.core.request``."""

# face: the code lives in vllm_mlx/core/request.py; edit it there.
from vllm_mlx.core.request import (  # noqa: F401
    MAX_LOGPROBS,
    SamplingParams,
    RequestStatus,
    Request,
    CompletionOutput,
    RequestOutput,
)

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "RequestStatus",
    "Request",
    "CompletionOutput",
    "RequestOutput",
]

"""The public path ``vllm_mlx.model_registry``: a face of ``vllm_mlx.models.registry``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.models.registry``."""

# face: the code lives in vllm_mlx/models/registry.py; edit it there.
from vllm_mlx.models.registry import (  # noqa: F401
    ModelOwnershipError,
    ModelRegistry,
    get_registry,
)

__all__ = [
    "ModelOwnershipError",
    "ModelRegistry",
    "get_registry",
]

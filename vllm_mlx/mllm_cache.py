"""The public path ``vllm_mlx.mllm_cache``: a face of ``vllm_mlx.multimodal.cache``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.multimodal.cache``."""

# face: the code lives in vllm_mlx/multimodal/cache.py; edit it there.
from vllm_mlx.multimodal.cache import (  # noqa: F401
    DEFAULT_MAX_MEMORY_BYTES,
    MLLMCacheEntry,
    MLLMCacheManager,
    MLLMCacheStats,
    VLMCacheManager,
    VLMCacheStats,
)

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "MLLMCacheEntry",
    "MLLMCacheManager",
    "MLLMCacheStats",
    "VLMCacheManager",
    "VLMCacheStats",
]

"""The public path ``vllm_mlx.paged_cache``: a face of ``vllm_mlx.core.kv.paged_cache``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.core.kv.paged_cache``."""

# face: the code lives in vllm_mlx/core/kv/paged_cache.py; edit it there.
from vllm_mlx.core.kv.paged_cache import (  # noqa: F401
    BlockTable,
    CacheBlock,
    CacheStats,
    FreeBlockQueue,
    PagedCacheManager,
)

__all__ = [
    "BlockTable",
    "CacheBlock",
    "CacheStats",
    "FreeBlockQueue",
    "PagedCacheManager",
]

"""The public path ``vllm_mlx.prefix_cache``: a face of ``vllm_mlx.core.kv.prefix_cache``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.core.kv.prefix_cache``."""

# face: the code lives in vllm_mlx/core/kv/prefix_cache.py; edit it there.
from vllm_mlx.core.kv.prefix_cache import (  # noqa: F401
    ROOT_HASH,
    BlockAwarePrefixCache,
    PrefixCacheManager,
    PrefixCacheStats,
    compute_block_hashes,
    hash_block,
)

__all__ = [
    "ROOT_HASH",
    "BlockAwarePrefixCache",
    "PrefixCacheManager",
    "PrefixCacheStats",
    "compute_block_hashes",
    "hash_block",
]

"""
vllm-mlx: Apple Silicon MLX backend for vLLM

This package provides native Apple Silicon GPU acceleration for vLLM using
Apple's MLX framework, mlx-lm for LLMs, and mlx-vlm for vision-language models.

Features:
- Continuous batching via vLLM-style scheduler
- OpenAI-compatible API server
- Support for LLM and multimodal models

Every public name is loaded lazily (module ``__getattr__``), so ``import vllm_mlx``
imports neither mlx, mlx-lm, numpy, torch nor vllm, and works where they are missing.
"""

from __future__ import annotations

import importlib

# First, before any submodule can import mlx: let an optimised BLAS serve MLX's CPU matmuls
# (Linux only; VLLM_MLX_FAST_BLAS=0 turns it off). Imports neither mlx nor numpy.
from vllm_mlx.platform.cpu_backend import preload_fast_blas as _preload_fast_blas

_preload_fast_blas()

__version__ = "0.4.1"

__all__ = [
    # vLLM integration components (require torch)
    "MLXPlatform",
    "MLXWorker",
    "MLXModelRunner",
    "MLXAttentionBackend",
    # Request management
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    # Scheduler
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    # Engine
    "EngineCore",
    "AsyncEngineCore",
    "EngineConfig",
    # Model registry
    "get_registry",
    "ModelOwnershipError",
    # Prefix cache
    "PrefixCacheManager",
    "PrefixCacheStats",
    "BlockAwarePrefixCache",
    # Paged cache
    "PagedCacheManager",
    "CacheBlock",
    "BlockTable",
    "CacheStats",
    # MLLM cache (with legacy VLM aliases)
    "MLLMCacheManager",
    "MLLMCacheStats",
    "VLMCacheManager",
    "VLMCacheStats",
    # Version
    "__version__",
]

# Public name -> (submodule of vllm_mlx, attribute in that submodule).
_EXPORTS: dict[str, tuple[str, str]] = {
    "Request": ("core.request", "Request"),
    "RequestOutput": ("core.request", "RequestOutput"),
    "RequestStatus": ("core.request", "RequestStatus"),
    "SamplingParams": ("core.request", "SamplingParams"),
    "Scheduler": ("core.sched.scheduler", "Scheduler"),
    "SchedulerConfig": ("core.sched.scheduler", "SchedulerConfig"),
    "SchedulerOutput": ("core.sched.scheduler", "SchedulerOutput"),
    "EngineCore": ("engine.core", "EngineCore"),
    "AsyncEngineCore": ("engine.async_engine", "AsyncEngineCore"),
    "EngineConfig": ("engine.core", "EngineConfig"),
    "PrefixCacheManager": ("core.kv.prefix_cache", "PrefixCacheManager"),
    "PrefixCacheStats": ("core.kv.prefix_cache", "PrefixCacheStats"),
    "BlockAwarePrefixCache": ("core.kv.prefix_cache", "BlockAwarePrefixCache"),
    "PagedCacheManager": ("core.kv.paged_cache", "PagedCacheManager"),
    "CacheBlock": ("core.kv.block_pool", "CacheBlock"),
    "BlockTable": ("core.kv.block_pool", "BlockTable"),
    "CacheStats": ("core.kv.paged_cache", "CacheStats"),
    "MLLMCacheManager": ("multimodal.cache", "MLLMCacheManager"),
    "MLLMCacheStats": ("multimodal.cache", "MLLMCacheStats"),
    # Legacy names kept for compatibility.
    "VLMCacheManager": ("multimodal.cache", "MLLMCacheManager"),
    "VLMCacheStats": ("multimodal.cache", "MLLMCacheStats"),
    "get_registry": ("models.registry", "get_registry"),
    "ModelOwnershipError": ("models.registry", "ModelOwnershipError"),
    # The vLLM platform plugin: torch and vllm are imported only by these two modules.
    "MLXPlatform": ("plugin.platform", "MLXPlatform"),
    "MLXWorker": ("plugin.worker", "MLXWorker"),
    "MLXModelRunner": ("executor.model_runner", "MLXModelRunner"),
    "MLXAttentionBackend": ("executor.attention", "MLXAttentionBackend"),
    # High-level offline API and vLLM-shaped helpers; not part of the seed's __all__.
    "LLM": ("llm", "LLM"),
    "StructuredOutputsParams": ("structured.params", "StructuredOutputsParams"),
}

# Names whose modules import torch and vllm (the `vllm` extra).
_NEEDS_VLLM = frozenset({"MLXPlatform", "MLXWorker"})


def __getattr__(name: str):
    """Lazy load all components to avoid mlx_lm import on non-Apple platforms.

    Raises AttributeError for names this package does not export, and ImportError
    for exported names whose module cannot be imported (a submodule not written
    yet, or a missing dependency such as torch, whose error propagates as is).
    """
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

    qualified = f"{__name__}.{module_name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as exc:
        if name in _NEEDS_VLLM and (exc.name or "").split(".")[0] in ("vllm", "torch"):
            raise ImportError(
                f"vllm_mlx.{name} is part of the vLLM platform plugin, which needs vLLM "
                f"(missing: {exc.name}); install it with: pip install \"vllm-mlx[vllm]\"",
                name=qualified,
            ) from exc
        if exc.name != qualified:
            raise  # a dependency of the submodule is missing: keep its message
        raise ImportError(
            f"vllm_mlx.{name} is not available yet: module {qualified} "
            "is not implemented in this version",
            name=qualified,
        ) from exc

    try:
        value = getattr(module, attr)
    except AttributeError as exc:
        # An exported name must never look like a missing attribute to callers.
        message = f"cannot import name {attr!r} from {qualified!r}"
        raise ImportError(message, name=qualified) from exc
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "LLM"])

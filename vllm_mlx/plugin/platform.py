"""MLXPlatform: vLLM's platform plugin for MLX (``vllm.LLM(...)`` and ``vllm serve`` on MLX).

vLLM finds this module through the entry point ``vllm.platform_plugins: mlx`` and calls
``register()``. When MLX is importable the platform is active, and vLLM's engine (its scheduler,
prefix cache, tokenizer, OpenAI server) drives our ``MLXWorker`` (``vllm_mlx/plugin/worker.py``), which
runs the same ``MLXModelRunner`` and paged attention as our own engine. vLLM's own model code,
attention kernels and torch weights are never used: torch is only vLLM's carrier for configs.

The plugin is written against one vLLM release (``SUPPORTED_VLLM_VERSION``): the worker and
scheduler-output interfaces it implements change between vLLM minor releases, so the ``vllm``
extra pins it exactly.

torch and vllm are imported only here and in ``worker.py``; ``register()`` itself imports
neither mlx nor torch (it runs in every vLLM process, the API server's included).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSION = "0.33.0"
"""The vLLM release this plugin implements (the ``vllm`` extra pins it)."""

DEFAULT_BLOCK_SIZE = 16
"""KV block size when the user sets none (our engine's default too)."""

WORKER_CLS = "vllm_mlx.plugin.worker.MLXWorker"
ATTENTION_BACKEND_CLS = "vllm_mlx.plugin.worker.MLXPagedAttentionBackend"


def register() -> str | None:
    """The ``vllm.platform_plugins`` entry point: MLXPlatform's path when MLX is importable.

    Returns None otherwise, so vLLM falls back to its built-in platforms (only one out-of-tree
    platform may be active). Checks the module spec only: importing ``mlx.core`` here would do
    it in processes that never run a model (vLLM's API server).
    """
    try:
        found = importlib.util.find_spec("mlx.core") is not None
    except (ImportError, ValueError):
        found = False
    return f"{__name__}.MLXPlatform" if found else None


class UnsupportedVllmFeatureError(ValueError):
    """A vLLM option or request feature that the MLX plugin does not implement."""


class MLXPlatform(Platform):
    """vLLM's view of MLX: a host-memory device, one in-process worker, our model runner.

    ``device_type`` is ``"cpu"`` because that is the torch device vLLM may place its few host
    tensors on; the model, the KV cache and the sampler live in MLX (Metal, CUDA or CPU).
    """

    _enum = PlatformEnum.OOT
    device_name = "mlx"
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"
    simple_compile_backend = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # vLLM's model dtype is only a label here: MLX weights keep their own dtype.
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        # Asked in vLLM's API-server process too, before it forks the engine core: no MLX there.
        return "mlx"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return host_total_memory()

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        import mlx.core as mx

        return float(mx.get_active_memory())

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Nothing to select: MLX has one default device per process."""

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """Nothing to seed: our sampler seeds every request on its own (``sampling.py``)."""

    @classmethod
    def import_kernels(cls) -> None:
        """No vLLM kernels run on this platform (vLLM's default imports its CUDA ops)."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # vLLM resolves a backend class even though our runner does attention itself.
        return ATTENTION_BACKEND_CLS

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Select our worker and the in-process executor; refuse what we do not implement."""
        check_vllm_version()
        _refuse_unsupported(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        elif parallel.worker_cls != WORKER_CLS:
            raise UnsupportedVllmFeatureError(
                f"worker_cls={parallel.worker_cls!r}: the MLX platform runs only {WORKER_CLS}"
            )
        # One worker in the engine-core process: MLX streams are thread-local, and there is no
        # second device to shard onto.
        parallel.distributed_executor_backend = "uni"
        _disable_torch_compilation(vllm_config)
        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        """Keep the block size chosen in ``check_and_update_config``: our paged attention takes any."""

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Refuse request features our sampler or runner does not implement, before queueing."""
        refused = unsupported_request_features(processed_inputs, params)
        if refused:
            raise UnsupportedVllmFeatureError(
                f"not supported by the MLX platform plugin: {', '.join(refused)}"
            )


def check_vllm_version() -> None:
    import vllm

    if vllm.__version__ != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "vllm-mlx's plugin is written against vLLM %s but vLLM %s is installed; install "
            "the pinned release with: pip install \"vllm-mlx[vllm]\"",
            SUPPORTED_VLLM_VERSION,
            vllm.__version__,
        )


def _refuse_unsupported(vllm_config: VllmConfig) -> None:
    """Raise ``UnsupportedVllmFeatureError`` naming every engine option we cannot honour."""
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    refused = []
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            refused.append(f"{name}={getattr(parallel, name)} (one MLX device per engine)")
    if parallel.distributed_executor_backend not in (None, "uni", "mp"):
        refused.append(f"distributed_executor_backend={parallel.distributed_executor_backend!r}")
    if vllm_config.speculative_config is not None:
        refused.append("speculative decoding")
    if vllm_config.lora_config is not None:
        refused.append("LoRA adapters")
    if vllm_config.kv_transfer_config is not None:
        refused.append("KV transfer connectors")
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        refused.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} (KV keeps the model's dtype)")
    if model is not None:
        if model.runner_type != "generate":
            refused.append(f"runner={model.runner_type!r} (text generation only)")
        if model.is_multimodal_model:
            refused.append("multimodal models (use vllm-mlx's own server for images)")
        if model.quantization is not None:
            refused.append(f"vLLM quantization {model.quantization!r} (MLX models bring their own)")
    if refused:
        raise UnsupportedVllmFeatureError(
            "the MLX platform plugin does not support: " + "; ".join(refused)
        )


def _disable_torch_compilation(vllm_config: VllmConfig) -> None:
    """No torch model runs, so nothing to compile or capture."""
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    if vllm_config.model_config is not None:
        vllm_config.model_config.enforce_eager = True


def unsupported_request_features(processed_inputs, params) -> list[str]:
    """What a request asks for that we cannot do (empty when it is fine)."""
    refused = []
    if isinstance(processed_inputs, dict):
        if processed_inputs.get("type") == "embeds" or processed_inputs.get("prompt_embeds") is not None:
            refused.append("prompt embeddings")
        if processed_inputs.get("mm_kwargs") or processed_inputs.get("mm_features"):
            refused.append("multimodal inputs")
    if params is None or not hasattr(params, "temperature"):
        return refused + ["pooling requests"]
    checks = {
        "structured outputs": params.structured_outputs is not None,
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": bool(params.allowed_token_ids),
        "bad_words": bool(params.bad_words),
        "prompt_logprobs": params.prompt_logprobs is not None,
        "logprobs=-1 or > 20": params.logprobs is not None and not 0 <= params.logprobs <= 20,
        "logits processors": bool(getattr(params, "logits_processors", None)),
    }
    return refused + [name for name, asked in checks.items() if asked]


def host_total_memory() -> int:
    """Physical memory in bytes (MLX shares it with the CPU on Apple silicon and on Linux CPU)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

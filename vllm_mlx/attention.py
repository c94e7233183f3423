"""The public path ``vllm_mlx.attention``: a face of ``vllm_mlx.executor.attention``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.executor.attention``."""

# face: the code lives in vllm_mlx/executor/attention.py; edit it there.
from vllm_mlx.executor.attention import (  # noqa: F401
    NULL_SLOT,
    RECURRENT_ARCHITECTURES,
    UnsupportedModelError,
    layer_specs,
    check_supported,
    model_type_of,
    RowSpec,
    KeyView,
    KeyRanges,
    GroupSlots,
    BatchLayout,
    KVPool,
    PagedLayerCache,
    MLXAttentionBackend,
)

__all__ = [
    "NULL_SLOT",
    "RECURRENT_ARCHITECTURES",
    "UnsupportedModelError",
    "layer_specs",
    "check_supported",
    "model_type_of",
    "RowSpec",
    "KeyView",
    "KeyRanges",
    "GroupSlots",
    "BatchLayout",
    "KVPool",
    "PagedLayerCache",
    "MLXAttentionBackend",
]

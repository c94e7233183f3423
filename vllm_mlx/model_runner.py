"""The public path ``vllm_mlx.model_runner``: a face of ``vllm_mlx.executor.model_runner``, where the code lives.

Kept so documented imports keep working; code inside the package imports ``vllm_mlx.executor.model_runner``."""

# face: the code lives in vllm_mlx/executor/model_runner.py; edit it there.
from vllm_mlx.executor.model_runner import (  # noqa: F401
    CALL_COST_TOKENS,
    NULL_BLOCK,
    group_for_padding,
    SplitModel,
    MLXModelRunner,
    measure_kv_layout,
    mllm_cache_key,
    row_spec,
    sampling_row,
)

__all__ = [
    "CALL_COST_TOKENS",
    "NULL_BLOCK",
    "group_for_padding",
    "SplitModel",
    "MLXModelRunner",
    "measure_kv_layout",
    "mllm_cache_key",
    "row_spec",
    "sampling_row",
]

"""The weight format to run, decided by memory before the weights are loaded.

A format's need is its weights (``models/weight_sizes.py``: from the safetensors headers) plus
the pools the engine fills beside them: the KV pool (``kv_pool_bytes``) and, for a
vision-language model, the vision-feature cache. It fits when the need is within the memory
the engine may use (``EngineMemory``: ``memory_limit``, or the memory available at start less a
margin; with several ranks, the least any rank has). Then:

* "auto" on the CPU backend: the fastest format that fits (float32, bfloat16, the quantized
  checkpoint as is; ``cpu_backend.choose_weight_format``), said in one log line with the figures
  (a warning when it is not float32).
* "auto" elsewhere: "quantized", as before.
* An explicit format, or "auto" when nothing fits: ``ModelMemoryError`` with the figures, raised
  before loading, instead of the kernel's out-of-memory killer later.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mlx.core.kv.sizing import EngineMemory, format_bytes, kv_bytes_per_token
from vllm_mlx.core.kv.spec import blocks_for_bytes
from vllm_mlx.models import read_config
from vllm_mlx.models.weight_sizes import WeightSizes, weight_sizes
from vllm_mlx.platform.errors import ModelMemoryError

if TYPE_CHECKING:
    from vllm_mlx.config import EngineConfig

__all__ = ["FormatNeed", "WeightPlan", "kv_pool_bytes", "plan_weight_format"]

logger = logging.getLogger(__name__)

FORMATS = ("float32", "bfloat16", "quantized")


@dataclass(frozen=True)
class FormatNeed:
    """What running in ``weight_format`` takes: its weights, its KV pool and other caches."""

    weight_format: str
    weights: int
    kv: int
    caches: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.caches

    def describe(self) -> str:
        """"X GB = weights Y + KV pool Z" (+ the vision cache when there is one)."""
        parts = f"weights {format_bytes(self.weights)} + KV pool {format_bytes(self.kv)}"
        if self.caches:
            parts += f" + vision cache {format_bytes(self.caches)}"
        return f"{format_bytes(self.total)} = {parts}"


@dataclass(frozen=True)
class WeightPlan:
    """The format chosen for ``requested``, the needs of every format and the memory they were
    measured against. ``preferred``: what ``requested`` means by speed alone, before memory
    (float32 for "auto" on the CPU backend, "quantized" on Metal and CUDA)."""

    weight_format: str
    requested: str
    sizes: WeightSizes
    memory: EngineMemory
    needs: tuple[FormatNeed, ...]
    preferred: str = ""

    @property
    def gave_up_speed(self) -> bool:
        """Whether memory made "auto" pick a slower format than it prefers."""
        return self.sizes.is_quantized and bool(self.preferred) and self.weight_format != self.preferred

    def need(self, weight_format: str) -> FormatNeed:
        return next(n for n in self.needs if n.weight_format == weight_format)

    def fits(self, weight_format: str) -> bool:
        return self.need(weight_format).total <= self.memory.limit

    @property
    def budget(self) -> str:
        """"the 19.8 GB the engine may use (22.0 GB available less a 2.2 GB margin)"."""
        return f"the {format_bytes(self.memory.limit)} the engine may use ({self.memory.describe()})"

    def line(self) -> str:
        """One line: the format, and why (the figures)."""
        chosen = self.need(self.weight_format)
        name = f"{self.weight_format} weights" if self.sizes.is_quantized else f"{self.sizes.float_dtype} weights as stored"
        head = f"{name} ({self.requested}): {chosen.describe()}, within {self.budget}"
        if not self.gave_up_speed:
            return head
        faster = self.needs[FORMATS.index(self.preferred) : FORMATS.index(self.weight_format)]
        over = "; ".join(f"{n.weight_format} would need {format_bytes(n.total)}" for n in faster)
        return f"{head}; {over}"


def kv_pool_bytes(config: EngineConfig, model_config: dict, dtype_bytes: int) -> int:
    """Bytes of the KV pool the engine will fill beside the weights (``EngineCore`` sizes it so;
    the pool's arrays are allocated whole on the first write, ``executor/attention.KVPool``):

    * ``num_kv_blocks``: that many blocks;
    * ``kv_cache_memory`` in bytes (the default, 1 GiB): the blocks that budget buys;
    * ``kv_cache_memory`` as a fraction: the pool takes that share of what the weights leave, so
      the need is the smallest workable pool divided by the fraction. The smallest workable pool
      is one request of ``max_model_len`` tokens when it is set, else one full step
      (``max_num_batched_tokens``), plus the null block: smaller, a prompt of that length can
      never be admitted.

    Bytes per token come from the config (``kv_bytes_per_token``, all layers counted as
    attention: an upper bound for hybrids and sliding windows). A config it cannot read (no
    head counts) leaves the budget in bytes as the estimate, and 0 for the other two.
    """
    try:
        per_token = kv_bytes_per_token(model_config, dtype_bytes)
    except (KeyError, TypeError, ZeroDivisionError):
        per_token = 0
    block = config.block_size * per_token
    if config.num_kv_blocks:
        return config.num_kv_blocks * block
    if isinstance(config.kv_cache_memory, float):
        tokens = config.max_model_len or config.max_num_batched_tokens
        smallest = (math.ceil(tokens / config.block_size) + 1) * block
        return math.ceil(smallest / config.kv_cache_memory)
    if not block or config.kv_cache_memory < block:
        # A budget that buys no block is the engine's sizing's to refuse, with its own reason
        # (e.g. recurrent states that do not fit); here it only counts as what it is.
        return int(config.kv_cache_memory)
    return blocks_for_bytes(int(config.kv_cache_memory), config.block_size, per_token) * block


def _cache_bytes(config: EngineConfig, model_config: dict) -> int:
    """The vision-feature cache's most (vision-language models with the MLLM cache on)."""
    from vllm_mlx.multimodal.vlm_models import is_vision_language_config

    if config.enable_mllm_cache and is_vision_language_config(model_config):
        return int(config.mllm_cache_memory)
    return 0


def format_needs(config: EngineConfig, model_config: dict, sizes: WeightSizes) -> tuple[FormatNeed, ...]:
    """Every format's need (weights + KV pool in that format's activation dtype + caches)."""
    caches = _cache_bytes(config, model_config)
    return tuple(
        FormatNeed(fmt, sizes.bytes_of(fmt), kv_pool_bytes(config, model_config, sizes.activation_bytes(fmt)), caches)
        for fmt in FORMATS
    )


def _refusal(plan: WeightPlan, weight_format: str) -> ModelMemoryError:
    need = plan.need(weight_format)
    smaller = [n for n in plan.needs if n.total < need.total and plan.fits(n.weight_format)]
    options = [f"weight_format={smaller[0].weight_format!r} (needs {format_bytes(smaller[0].total)})"] if smaller else []
    options += ["a smaller kv_cache_memory or num_kv_blocks", "a larger memory_limit if the machine has the memory"]
    name = weight_format if plan.sizes.is_quantized else f"{plan.sizes.float_dtype} (as stored)"
    return ModelMemoryError(
        f"the model does not fit in memory as {name} weights: needed {need.describe()}, available "
        f"{format_bytes(plan.memory.limit)} ({plan.memory.describe()}); try {', '.join(options)}"
    )


def plan_weight_format(
    config: EngineConfig, model_dir: Path, *, available: int | None = None, group=None
) -> WeightPlan:
    """The weight format for ``config.weight_format`` and the model in ``model_dir``, decided
    before loading (see the module). ``available``: the memory available now (default: read it).
    With a distributed ``group`` (collectively: every rank calls this) the ranks agree on the
    smallest format any rank chose, so that they all run the same one; each rank's own memory
    must then hold it (every rank loads and converts the whole model before keeping its shard
    or stage, so the whole model's weights are the right figure).

    Raises:
        ModelMemoryError: The format asked for cannot fit; or, for "auto", not even the smallest.
        ModelSourceError: ``model_dir`` holds no readable safetensors weights.
    """
    from vllm_mlx.platform.cpu_backend import choose_weight_format
    from vllm_mlx.platform.errors import ModelSourceError

    memory = _within_device(EngineMemory.of(config.memory_limit, available))
    model_config = read_config(Path(model_dir)) or {}
    try:
        sizes = weight_sizes(model_dir, model_config)
    except (OSError, ValueError) as exc:
        sizes, error = None, exc
    needs = format_needs(config, model_config, sizes) if sizes else ()
    plan = WeightPlan("quantized", config.weight_format, sizes, memory, needs)
    chosen = choose_weight_format(config.weight_format, fits=plan.fits if sizes else None)
    preferred = choose_weight_format(config.weight_format)
    if group is not None:  # before any raise: every rank must reach the collective
        from vllm_mlx.distributed.group import most_of

        chosen = FORMATS[most_of(group, FORMATS.index(chosen))]
    if sizes is None:
        raise ModelSourceError(f"cannot load the model in {model_dir}: {error}".splitlines()[0])
    plan = WeightPlan(chosen, plan.requested, sizes, memory, needs, preferred)
    if not plan.fits(chosen):
        raise _refusal(plan, chosen)
    return plan


def log_plan(plan: WeightPlan) -> None:
    """The one line that says which format runs and why: a warning when "auto" gave up the
    fastest format for memory, else at info level."""
    logger.log(logging.WARNING if plan.gave_up_speed else logging.INFO, "vllm-mlx: %s", plan.line())


def _within_device(memory: EngineMemory) -> EngineMemory:
    """On an accelerator with memory of its own (CUDA), the least of it and the host's figure;
    MLX reports ``memory_size`` there (on Metal it is the unified memory, above what is free)."""
    import mlx.core as mx

    try:
        device = int(mx.device_info().get("memory_size", 0))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        device = 0
    if not device or device >= memory.limit:
        return memory
    return EngineMemory(device, memory.available, memory.margin, memory.explicit)

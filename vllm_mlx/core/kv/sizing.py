"""Memory sizing: how many bytes the KV cache may take, and what one token or request costs.

Plain arithmetic over the model's config and the machine's memory (no MLX): the engine sizes
its pool from the budget ``kv_budget_bytes`` returns; ``StateBudget`` carves the recurrent-state
slots out of that budget first. ``kv_bytes_per_token`` is an estimate from the config for callers
that cannot run the model (the vLLM worker); the engine measures the real layout instead
(``model_runner.measure_kv_layout``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol


class StatePlanConfig(Protocol):
    """What ``StateBudget.plan`` reads of an ``EngineConfig`` (a protocol: vllm_mlx.config sits
    above core, which may not import it)."""

    max_num_seqs: int
    max_state_checkpoints: int | None
    enable_prefix_caching: bool


def available_memory() -> int:
    """Bytes of memory available now (Linux: MemAvailable; elsewhere: physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# The share of the available memory kept back from the engine's weights and pools, and its floor.
# What it covers, none of which the weights or the KV pool account for: each step's activations
# (for an 8B model at the default 512-token budget, a few tens of MB per MLP intermediate, and
# the sampling rows' logits), MLX's cache of freed buffers, the tokenizer and Python's objects,
# one layer's quantized copy while the weights are converted (at most the embedding: ~0.3 GB for
# a 128k-token vocabulary of 4096 at 4 bits), and the other processes growing after the check
# (MemAvailable is a snapshot, nothing is reserved). The floor covers the fixed part on a small
# machine; the share, what grows with the model and the machine.
MEMORY_MARGIN_SHARE = 0.10
MEMORY_MARGIN_FLOOR = 1 << 30


@dataclass(frozen=True)
class EngineMemory:
    """The bytes the engine may use for its weights and pools (``limit``), and where the figure
    comes from: ``memory_limit`` when set (``explicit``; no margin is taken off), else the memory
    available at start (``available``) less ``margin``."""

    limit: int
    available: int
    margin: int
    explicit: bool

    @classmethod
    def of(cls, memory_limit: int | None, available: int | None = None) -> EngineMemory:
        """``memory_limit`` (bytes; None: the available memory less the margin)."""
        available = available_memory() if available is None else available
        if memory_limit is not None:
            return cls(int(memory_limit), available, 0, True)
        margin = max(MEMORY_MARGIN_FLOOR, int(available * MEMORY_MARGIN_SHARE))
        return cls(max(available - margin, 0), available, margin, False)

    def describe(self) -> str:
        """Where ``limit`` comes from, for messages: "memory_limit" or "X available less Y"."""
        if self.explicit:
            return "memory_limit"
        return f"{format_bytes(self.available)} available less a {format_bytes(self.margin)} margin"


def format_bytes(n: int) -> str:
    """``n`` bytes for people: "1.3 GB", "512 MB", "4 KB" (decimal units)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if unit == "GB" else f"{n / size:.0f} {unit}"
    return f"{n} B"


def kv_budget_bytes(kv_cache_memory: int | float, available_bytes: int | None = None) -> int:
    """An absolute byte count, or a fraction of the available memory (``available_bytes``, by
    default ``available_memory()``)."""
    if isinstance(kv_cache_memory, float):
        if not 0 < kv_cache_memory <= 1:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
        return int(kv_cache_memory * (available_memory() if available_bytes is None else available_bytes))
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory}")
    return int(kv_cache_memory)


@dataclass(frozen=True)
class MemoryNeeds:
    """What sizing the pools needs to know of a process: what one token of one KV block id costs
    (``KVLayout.bytes_per_block_token``), what one request's recurrent state costs (0: none),
    and the memory available. Over several ranks (``distributed.combine_memory_needs``): the
    most any rank's layers cost and the least memory any rank has, so that rank 0's sizing,
    which every rank allocates, fits each (a pipeline stage holds only its own layers)."""

    kv_bytes_per_token: int
    state_bytes_per_request: int
    available_bytes: int


@dataclass(frozen=True)
class KVShape:
    """The KV cache's shape per token: ``num_layers`` caches of ``num_kv_heads`` x ``head_dim``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_shape(model_config: dict, model=None, num_layers: int | None = None) -> KVShape:
    """The KV shape from the (text) config; keys the config leaves out take the values the model
    was built with (mlx-lm's ``model.args`` holds its architecture's defaults, e.g. gemma3's
    ``head_dim``). ``num_layers``: the attention layers, when not all layers are (hybrids)."""
    config = model_config.get("text_config", model_config)
    args = getattr(model, "args", None)
    if args is not None and hasattr(args, "__dict__"):
        config = {**config, **{k: v for k, v in vars(args).items() if v is not None}}
    heads = config["num_attention_heads"]
    return KVShape(
        num_layers=num_layers if num_layers is not None else config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
    )


def kv_bytes_per_token(model_config: dict, dtype_bytes: int, model=None, num_layers: int | None = None) -> int:
    """Keys + values of one token across all (``num_layers``: that many) attention layers, from
    the config (see ``kv_shape``): for callers that know the dtype but cannot run the model. The
    engine sizes its pool from the measured layout instead (``model_runner.measure_kv_layout``),
    which is exact (dtype, latent attention, layers that share keys).

    Sliding-window layers count in full here (an upper bound: with block groups they hold only
    the blocks their window reaches; kv_spec.py).
    """
    shape = kv_shape(model_config, model, num_layers)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


@dataclass(frozen=True)
class StateBudget:
    """How the KV budget is shared with the recurrent-state pool (all zeros but
    ``kv_bytes_left`` for a model without recurrent layers): one slot per running request plus
    the null slot, then the checkpoint slots, all of ``bytes_per_request``."""

    num_running_slots: int  # the null slot included
    num_checkpoints: int
    kv_bytes_left: int

    @property
    def num_slots(self) -> int:
        return self.num_running_slots + self.num_checkpoints

    @classmethod
    def plan(cls, config: StatePlanConfig, budget_bytes: int, bytes_per_request: int) -> StateBudget:
        """Raises ``ValueError`` when the budget cannot hold the running requests' states."""
        if not bytes_per_request:
            return cls(0, 0, budget_bytes)
        running = config.max_num_seqs + 1
        left = budget_bytes - running * bytes_per_request
        if left <= 0:
            raise ValueError(
                f"kv_cache_memory={budget_bytes} bytes cannot hold the recurrent state of {running - 1} "
                f"requests ({bytes_per_request} bytes each): raise it or lower max_num_seqs"
            )
        wanted = config.max_state_checkpoints
        if wanted is None:  # automatic: never more than half of what the KV blocks would get
            wanted = min(2 * config.max_num_seqs, left // 2 // bytes_per_request)
        num_checkpoints = wanted if config.enable_prefix_caching else 0
        left -= num_checkpoints * bytes_per_request
        if left <= 0:
            raise ValueError(
                f"kv_cache_memory={budget_bytes} bytes cannot hold {num_checkpoints} state checkpoints "
                f"besides the running requests' states ({bytes_per_request} bytes each): lower "
                "max_state_checkpoints"
            )
        return cls(running, num_checkpoints, left)

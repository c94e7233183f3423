"""The engine's stats as one typed aggregate (``EngineCore.stats()``).

``EngineStats.to_dict()`` is what the documented ``EngineCore.get_stats()`` returns; observers in
the process read the attributes, and serialise only where the data leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mlx.core.kv.observation import CacheStats
from vllm_mlx.core.sched.observation import SchedulerStats
from vllm_mlx.core.snapshot import MLLMStats
from vllm_mlx.engine.kv_disk import DiskTierStats
from vllm_mlx.structured.grammar import GrammarCacheStats


@dataclass
class EngineStats:
    """Counters of the whole engine, taken between two steps."""

    scheduler: SchedulerStats
    """Running and waiting requests, preemptions, steps (with the KV pool's counts)."""
    kv_cache: CacheStats
    """The KV block pool, state slots and checkpoints."""
    structured_outputs: GrammarCacheStats
    """The compiled-grammar cache."""
    mllm: MLLMStats | None = None
    """The multimodal cache, for a vision-language model; None for a text model (then
    ``to_dict`` has no ``"mllm"`` key)."""
    kv_disk: DiskTierStats | None = None
    """The KV disk tier's, when the engine has one (``kv_disk_path``); else no ``"kv_disk"`` key."""

    def to_dict(self) -> dict:
        data = {
            "scheduler": self.scheduler.to_dict(),
            "kv_cache": self.kv_cache.to_dict(),
            "structured_outputs": self.structured_outputs.to_dict(),
        }
        if self.mllm is not None:
            data["mllm"] = self.mllm.to_dict()
        if self.kv_disk is not None:
            data["kv_disk"] = self.kv_disk.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> EngineStats:
        mllm, kv_disk = data.get("mllm"), data.get("kv_disk")
        return cls(
            SchedulerStats.from_dict(data["scheduler"]),
            CacheStats.from_dict(data["kv_cache"]),
            GrammarCacheStats.from_dict(data["structured_outputs"]),
            MLLMStats.from_dict(mllm) if mllm is not None else None,
            DiskTierStats(**kv_disk) if kv_disk is not None else None,
        )

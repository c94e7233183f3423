"""What observers read of the scheduler: its counters and one view per unfinished request.

Dataclasses with one ``to_dict()`` each (the plain-data form the engine's ``get_stats()`` and
``cache_snapshot()`` return) and a ``from_dict()`` where a remote side rebuilds them from JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllm_mlx.core.fields import known_fields
from vllm_mlx.core.kv.observation import CacheStats


@dataclass
class SchedulerStats:
    """The scheduler's counters, with the KV pool's (``get_stats()["scheduler"]``)."""

    running: int
    """Requests in the running batch."""
    waiting: int
    """Requests waiting for admission (new or preempted)."""
    preemptions: int
    """Requests preempted so far (their blocks freed, their tokens to be recomputed)."""
    steps: int
    """Steps scheduled so far (the last step's id)."""
    kv_cache: CacheStats

    def to_dict(self) -> dict:
        return {"running": self.running, "waiting": self.waiting, "preemptions": self.preemptions,
                "steps": self.steps, "kv_cache": self.kv_cache.to_dict()}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> SchedulerStats:
        return cls(data["running"], data["waiting"], data["preemptions"], data["steps"],
                   CacheStats.from_dict(data["kv_cache"]))  # fmt: skip


@dataclass
class RequestView:
    """One unfinished request as observers see it (``cache_snapshot()["requests"][id]``)."""

    status: str
    """``RequestStatus`` name: ``"RUNNING"``, ``"WAITING"``, ``"PREEMPTED"``, ..."""
    num_prompt_tokens: int
    num_computed_tokens: int
    """Tokens whose KV is in the cache (prompt and output)."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at admission."""
    num_output_tokens: int
    num_preemptions: int
    block_ids: list[int] = field(default_factory=list)
    """Its block table (the first block group's); empty while it holds none."""
    num_disk_tokens: int = 0
    """Prompt tokens whose KV the disk tier read back for it (of ``num_cached_tokens``)."""

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["block_ids"] = list(self.block_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> RequestView:
        """The inverse of ``to_dict``; a server's view leaves out ``num_computed_tokens`` and
        ``num_preemptions`` (0)."""
        return cls(**{"num_computed_tokens": 0, "num_preemptions": 0, **known_fields(cls, data)})


def requests_to_dict(requests: dict[str, RequestView]) -> dict[str, dict]:
    """``{request id: view}`` as plain data (order kept: running first, then waiting)."""
    return {request_id: view.to_dict() for request_id, view in requests.items()}


def requests_from_dict(data: dict[str, dict]) -> dict[str, RequestView]:
    return {request_id: RequestView.from_dict(view) for request_id, view in data.items()}

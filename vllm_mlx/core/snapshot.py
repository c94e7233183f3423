"""Typed views of the KV cache for observers (stats endpoint, metrics, notebook inspector).

Observers read only these snapshots, never cache internals. A snapshot is cheap enough to take
a few times per second while generating: one pass over the blocks, and block texts decoded once
per distinct token tuple (memoised).

``CacheSnapshot`` is the whole view; its ``to_dict()`` is what ``EngineCore.cache_snapshot()``
returns (the documented plain data), and ``from_dict()`` rebuilds it from that JSON. Serialise
only where the data leaves the process (an HTTP response, a widget's traits); in between,
read attributes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

from vllm_mlx.core.fields import known_fields
from vllm_mlx.core.kv.observation import BlockGroupUsage, BlockView, CacheStats
from vllm_mlx.core.kv.prefix_cache import PrefixCacheStats
from vllm_mlx.core.kv.spec import KVGroupView
from vllm_mlx.core.kv.tenant_stats import TenantCacheStats
from vllm_mlx.core.sched.observation import RequestView, requests_from_dict, requests_to_dict
from vllm_mlx.core.sched.scheduler import Scheduler

MAX_BLOCK_TEXT = 64
_TEXT_MEMO_SIZE = 8192


@dataclass
class MLLMCacheStats:
    """Multimodal cache effectiveness and occupancy (counters since creation). Kept by
    ``multimodal.cache.MLLMCacheManager``; here, beside ``MLLMStats``, so the counters are
    declared once."""

    queries: int = 0
    """Lookups by image hash (``get``, and ``get_or_compute`` through it)."""
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    """Sum of the hit entries' ``num_tokens``: image placeholder tokens not re-encoded."""
    evictions: int = 0
    """Entries dropped to make room for a new one (not ``remove``/``clear``)."""
    oversized: int = 0
    """Entries not cached because they alone exceed the whole budget."""
    memory_used: int = 0
    """Bytes of the cached features (equals the sum of the entries' ``nbytes``)."""
    max_memory_bytes: int = 0
    num_entries: int = 0

    @property
    def encoder_runs_skipped(self) -> int:
        return self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "encoder_runs_skipped": self.encoder_runs_skipped,
            "hit_rate": self.hit_rate,
        }



@dataclass
class MLLMStats(MLLMCacheStats):
    """The multimodal cache's counters (``MLLMCacheStats``), whether it is on, and the
    vision-encoder runs so far. All zero for a text model or with the cache off."""

    enabled: bool = False
    encoder_runs: int = 0
    """Vision-encoder runs of the runner (cache misses and uncached images)."""

    def to_dict(self) -> dict:
        """``MLLMCacheStats.to_dict()``, then ``enabled`` and ``encoder_runs``."""
        counters = {f.name: getattr(self, f.name) for f in fields(MLLMCacheStats)}
        derived = {"encoder_runs_skipped": self.encoder_runs_skipped, "hit_rate": self.hit_rate}
        return counters | derived | {"enabled": self.enabled, "encoder_runs": self.encoder_runs}

    @classmethod
    def from_dict(cls, data: dict) -> MLLMStats:
        return cls(**known_fields(cls, data))


@dataclass
class MLLMEntryView:
    """One cached image (``multimodal.cache.MLLMCacheEntry``) as observers see it."""

    hash: str
    """The image's content hash, cut to 12 hex digits."""
    width: int | None
    height: int | None
    thumbnail_png: bytes | None
    """A small PNG of the image (not JSON: ``thumbnail_base64`` is its text form)."""
    thumbnail_base64: str | None
    bytes: int
    """Bytes of its cached vision features."""
    num_tokens: int
    """Placeholder tokens the image occupies in a prompt."""
    hits: int
    created: float
    """Wall-clock time (``time.time()``) of insertion."""
    last_used: float

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> MLLMEntryView:
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass
class MLLMSnapshot:
    """The multimodal cache: entries (most recently used first) and stats."""

    entries: list[MLLMEntryView] = field(default_factory=list)
    stats: MLLMStats = field(default_factory=MLLMStats)

    def to_dict(self) -> dict:
        return {"entries": [entry.to_dict() for entry in self.entries], "stats": self.stats.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> MLLMSnapshot:
        entries = [MLLMEntryView.from_dict(entry) for entry in data.get("entries", [])]
        return cls(entries, MLLMStats.from_dict(data.get("stats", {})))


@dataclass
class SnapshotStats(CacheStats):
    """``cache_snapshot()["stats"]``: the KV pool's counts (``CacheStats``), the scheduler's
    counters, the prefix cache's and, per tenant label, its prefix-cache counters
    (``tenant_stats.py``). ``to_dict`` is flat: the pool's keys, then the scheduler's."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    steps: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    prefix_cache_tenants: dict[str, TenantCacheStats] = field(default_factory=dict)

    def to_dict(self, tenants: bool = True) -> dict:
        """Plain data; ``tenants=False`` leaves out ``prefix_cache_tenants`` (they tell of other
        tenants' traffic: see ``entrypoints/openai/cache_disclosure.py``)."""
        data = CacheStats.to_dict(self)
        data |= {"running": self.running, "waiting": self.waiting, "preemptions": self.preemptions,
                 "steps": self.steps, "prefix_cache": self.prefix_cache.to_dict()}  # fmt: skip
        if tenants:
            data["prefix_cache_tenants"] = {label: s.to_dict() for label, s in self.prefix_cache_tenants.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SnapshotStats:
        """The inverse of ``to_dict``; what the data leaves out (a server's public stats have no
        prefix-cache counters) is 0, or empty."""
        counts = {"num_blocks": 0, "block_size": 0, **known_fields(CacheStats, data)}
        tenants = data.get("prefix_cache_tenants", {})
        return cls(
            **counts, running=data.get("running", 0), waiting=data.get("waiting", 0),
            preemptions=data.get("preemptions", 0), steps=data.get("steps", 0),
            prefix_cache=PrefixCacheStats.from_dict(data.get("prefix_cache", {})),
            prefix_cache_tenants={label: TenantCacheStats.from_dict(s) for label, s in tenants.items()},
        )  # fmt: skip


@dataclass
class CacheSnapshot:
    """What ``EngineCore.snapshot()`` returns; ``to_dict()`` is ``cache_snapshot()``'s plain data.

    Without blocks (``include_blocks=False``) ``blocks`` and ``free_queue`` are empty and the
    cost is independent of the pool's size.
    """

    block_size: int
    blocks: list[BlockView]
    """Every block by id (block 0: the null block), with its decoded ``text``."""
    requests: dict[str, RequestView]
    """Per unfinished request id: running first, then waiting in queue order."""
    free_queue: list[int]
    """Free block ids in eviction order, head first."""
    stats: SnapshotStats
    mllm: MLLMSnapshot
    kv_groups: list[KVGroupView]
    """The model's layer groups (``kv_spec.GroupLayout``), fixed for the engine's life."""
    block_groups: list[BlockGroupUsage]
    """Per block group (``kv_spec.BlockGroups``): its window and the blocks its tables hold now."""

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "blocks": [block.to_dict() for block in self.blocks],
            "requests": requests_to_dict(self.requests),
            "free_queue": list(self.free_queue),
            "stats": self.stats.to_dict(),
            "mllm": self.mllm.to_dict(),
            "kv_groups": [group.to_dict() for group in self.kv_groups],
            "block_groups": [group.to_dict() for group in self.block_groups],
        }

    @classmethod
    def from_dict(cls, data: dict) -> CacheSnapshot:
        """The inverse of ``to_dict``; what a server's view leaves out (``mllm``, ``kv_groups``,
        ``block_groups``, counters it does not disclose) is empty or 0."""
        return cls(
            block_size=data.get("block_size", 0),
            blocks=[BlockView.from_dict(block) for block in data.get("blocks", [])],
            requests=requests_from_dict(data.get("requests", {})),
            free_queue=list(data.get("free_queue", [])),
            stats=SnapshotStats.from_dict(data.get("stats", {})),
            mllm=MLLMSnapshot.from_dict(data.get("mllm", {})),
            kv_groups=[KVGroupView.from_dict(group) for group in data.get("kv_groups", [])],
            block_groups=[BlockGroupUsage.from_dict(group) for group in data.get("block_groups", [])],
        )


class CacheSnapshotter:
    """Builds ``CacheSnapshot``s from the scheduler, its KV manager, the engine's MLLM view
    (``mllm_snapshot``) and the layer groups (``kv_groups``, fixed for the engine's life)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        mllm_snapshot: Callable[[], MLLMSnapshot],
        kv_groups: list[KVGroupView] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.mllm_snapshot = mllm_snapshot
        self.kv_groups = kv_groups or []
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()

    def snapshot(self, include_blocks: bool = True) -> CacheSnapshot:
        """The whole view; without ``include_blocks`` only requests and stats (cost independent
        of the pool size: ``blocks`` and ``free_queue`` come back empty)."""
        requests = self.scheduler.request_views()
        cache = self.scheduler.kv  # observers read the KV cache through its manager
        kv = cache.view(include_blocks)
        if include_blocks:
            self._fill_block_tokens(kv.blocks, kv.tables)
            for block in kv.blocks:
                block.text = self._text(block.token_ids) if block.token_ids else ""
        sched = self.scheduler.stats_view()
        counts = {f.name: getattr(kv.stats, f.name) for f in fields(CacheStats)}
        stats = SnapshotStats(
            **counts, running=sched.running, waiting=sched.waiting, preemptions=sched.preemptions, steps=sched.steps,
            prefix_cache=cache.prefix_cache_stats(), prefix_cache_tenants=cache.tenant_stats(),
        )  # fmt: skip
        kv_groups = [replace(group, layers=list(group.layers)) for group in self.kv_groups]  # callers' copies
        return CacheSnapshot(
            kv.block_size, kv.blocks, requests, kv.free_queue, stats, self.mllm_snapshot(), kv_groups, kv.block_groups
        )

    def _fill_block_tokens(self, blocks: list[BlockView], tables: dict[str, list[list[int]]]) -> None:
        """Blocks still being filled carry no token ids of their own: take them from an owner
        (any of its block groups' tables; block 0 is the null block)."""
        size = self.scheduler.block_size
        for request_id, group_tables in tables.items():
            request = self.scheduler.get_request(request_id)
            if request is None:
                continue
            tokens = request.all_token_ids[: request.num_computed_tokens]
            for table in group_tables:
                for index, block_id in enumerate(table):
                    block = blocks[block_id]
                    if block_id and block.token_ids is None:
                        block.token_ids = tokens[index * size : (index + 1) * size]

    def _text(self, token_ids: list[int]) -> str:
        key = tuple(token_ids)
        text = self._texts.get(key)
        if text is None:
            text = self.tokenizer.decode(list(key))[:MAX_BLOCK_TEXT]
            self._texts[key] = text
            if len(self._texts) > _TEXT_MEMO_SIZE:
                self._texts.popitem(last=False)
        else:
            self._texts.move_to_end(key)
        return text

"""Plain-data views of the KV cache for observers (stats endpoint, notebook inspector).

Observers read only these snapshots, never cache internals. A snapshot is cheap enough to take
a few times per second while generating: one pass over the blocks, and block texts decoded once
per distinct token tuple (memoised).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from vllm_mlx.core.sched.scheduler import Scheduler

MAX_BLOCK_TEXT = 64
_TEXT_MEMO_SIZE = 8192


class CacheSnapshotter:
    """Builds ``cache_snapshot()`` dicts: ``blocks``, ``requests``, ``free_queue``, ``stats``,
    ``mllm`` (``{"entries": [...], "stats": {...}}`` from ``mllm_snapshot``) and ``kv_groups``:
    one dict per layer group (``kind``, ``window``, ``layers``, ``bytes_per_token``, ``dtype``,
    ``num_blocks``; see ``kv_spec.GroupLayout``), fixed for the engine's life; ``block_groups``:
    per block group (``kv_spec.BlockGroups``) its window and the blocks its tables hold now.
    ``stats["prefix_cache_tenants"]``: prefix-cache counters per tenant (``tenant_stats.py``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        mllm_snapshot: Callable[[], dict],
        kv_groups: list[dict] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.mllm_snapshot = mllm_snapshot
        self.kv_groups = kv_groups or []
        self._texts: OrderedDict[tuple[int, ...], str] = OrderedDict()

    def snapshot(self, include_blocks: bool = True) -> dict:
        """The whole view; without ``include_blocks`` only requests and stats (cost independent
        of the pool size: ``blocks`` and ``free_queue`` come back empty)."""
        requests = self.scheduler.snapshot()
        cache = self.scheduler.kv  # observers read the KV cache through its manager
        kv = cache.snapshot(include_blocks)
        if include_blocks:
            self._fill_block_tokens(kv["blocks"], kv["tables"])
            for block in kv["blocks"]:
                block["text"] = self._text(block["token_ids"]) if block["token_ids"] else ""
        stats = kv["stats"]
        stats.update(self.scheduler.stats())
        stats.pop("kv_cache", None)
        stats["prefix_cache"] = cache.prefix_cache_stats().to_dict()
        stats["prefix_cache_tenants"] = cache.tenant_stats()
        return {
            "block_size": kv["block_size"],
            "blocks": kv["blocks"],
            "requests": requests,
            "free_queue": kv["free_queue"],
            "stats": stats,
            "mllm": self.mllm_snapshot(),
            "kv_groups": [dict(group, layers=list(group["layers"])) for group in self.kv_groups],
            "block_groups": kv["block_groups"],
        }

    def _fill_block_tokens(self, blocks: list[dict], tables: dict[str, list[list[int]]]) -> None:
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
                    if block_id and block["token_ids"] is None:
                        block["token_ids"] = tokens[index * size : (index + 1) * size]

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

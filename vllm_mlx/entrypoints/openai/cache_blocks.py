"""``GET /v1/cache/blocks``: the KV block grid for a remote cache inspector, tenant-safe.

A notebook connected to a server (``%vllm_mlx connect``) draws the server's blocks from this.
What it shows, and why each part is safe to show any client:

- ``block_states``: one letter per block id (``n`` null, ``f`` free, ``c`` cached, ``u`` used),
  ``free_queue`` (eviction order) and ``stats``. Which blocks are cached, the queue's order and
  the counters all move with prefix hits, so by default (``disclose_hits`` off) the grid shows
  only lengths: the null block, as many ``u`` as the running requests' lengths fill, then ``f``;
  the queue is empty and the stats are ``cache_disclosure.public_stats`` (see there). No
  hashes, token ids or text, ever.
- ``requests``: only the requests whose ids the caller names (``?request_id=...``, repeatable).
  A request id is the response ``id`` its client got (a random uuid), so only that client knows
  it. With the operator's ``cache_stats_per_request`` switch, every live request.
- ``blocks``: reference and token counts of the blocks those requests hold, nothing of others'.
  Reference counts are those requests' own holds: a count above that would tell that another
  tenant holds the same prefix.
- Prefix hits (``num_cached_tokens``, which block ids a table shares, the grid's real states,
  ``disk_blocks``: the blocks whose KV was read back from disk) tell whether another tenant's
  prompt began the same way; they are disclosed only where the operator allows
  (``ServingOptions.discloses_prefix_hits``). Otherwise the tables are left out
  (``tables_disclosed: false``), cached-token counts are 0 and ``disk_blocks`` is empty.
- The per-tenant counters only with ``per_tenant`` (``--enable-cache-stats-disclosure``).
- The multimodal cache (image thumbnails) is never shown.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_mlx.core.kv.observation import BlockView
from vllm_mlx.core.sched.observation import RequestView
from vllm_mlx.core.snapshot import CacheSnapshot
from vllm_mlx.entrypoints.openai.cache_disclosure import public_block_states, public_stats, visible_stats

STATE_LETTERS = {"null": "n", "free": "f", "cached": "c", "used": "u"}


def block_view(
    snapshot: CacheSnapshot,
    request_ids: Iterable[str],
    *,
    per_request: bool = False,
    disclose_hits: bool = False,
    per_tenant: bool = False,
) -> dict:
    """The endpoint's body for an engine ``snapshot()`` (see the module docstring)."""
    live = snapshot.requests
    wanted = list(live) if per_request else [rid for rid in dict.fromkeys(request_ids) if rid in live]
    tables = per_request or disclose_hits
    shown = {rid: live[rid] for rid in wanted}
    return {
        "block_size": snapshot.block_size,
        "block_states": _grid(snapshot) if tables else _public_grid(snapshot),
        "free_queue": list(snapshot.free_queue) if tables else [],
        "disk_blocks": [block.id for block in snapshot.blocks if block.from_disk] if tables else [],
        "requests": {rid: _request(view, tables) for rid, view in shown.items()},
        "blocks": _held_blocks(snapshot.blocks, shown if tables else {}, real_refs=per_request),
        "tables_disclosed": tables,
        "stats": visible_stats(snapshot.stats, live, disclose=tables, per_tenant=per_tenant),
        "kv_groups": [group.to_dict() for group in snapshot.kv_groups],
        # distinct blocks held per block group: shared ones once
        "block_groups": [group.to_dict() for group in snapshot.block_groups] if tables else [],
    }


def _grid(snapshot: CacheSnapshot) -> str:
    return "".join(STATE_LETTERS[block.state] for block in snapshot.blocks)


def _public_grid(snapshot: CacheSnapshot) -> str:
    used = public_stats(snapshot.stats, snapshot.requests).num_used_blocks
    return public_block_states(len(snapshot.blocks), used)


def _request(view: RequestView, tables: bool) -> dict:
    """What a caller reads of one request: its status and lengths; cached tokens and block ids
    only with ``tables`` (else 0 and [])."""
    return {
        "status": view.status,
        "num_prompt_tokens": view.num_prompt_tokens,
        "num_output_tokens": view.num_output_tokens,
        "num_cached_tokens": view.num_cached_tokens if tables else 0,
        "block_ids": list(view.block_ids) if tables else [],
    }


def _held_blocks(blocks: list[BlockView], requests: dict[str, RequestView], real_refs: bool) -> dict[str, dict]:
    """``{block id: {ref_cnt, num_tokens}}`` for the blocks the listed requests hold."""
    holds: dict[int, int] = {}
    for view in requests.values():
        for block_id in set(view.block_ids):
            if block_id:  # block 0 is the null block
                holds[block_id] = holds.get(block_id, 0) + 1
    return {
        str(block_id): {
            "ref_cnt": blocks[block_id].ref_cnt if real_refs else count,
            "num_tokens": blocks[block_id].num_tokens,
        }
        for block_id, count in sorted(holds.items())
        if block_id < len(blocks)
    }

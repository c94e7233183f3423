"""``GET /v1/cache/blocks``: the KV block grid for a remote cache inspector, tenant-safe.

A notebook connected to a server (``%vllm_mlx connect``) draws the server's blocks from this.
What it shows, and why each part is safe to show any client:

- ``block_states``: one letter per block id (``n`` null, ``f`` free, ``c`` cached, ``u`` used)
  and ``free_queue`` (eviction order): the same facts ``/v1/cache/stats`` counts, per block. No
  hashes, token ids or text, ever.
- ``requests``: only the requests whose ids the caller names (``?request_id=...``, repeatable).
  A request id is the response ``id`` its client got (a random uuid), so only that client knows
  it. With the operator's ``cache_stats_per_request`` switch, every live request.
- ``blocks``: reference and token counts of the blocks those requests hold, nothing of others'.
  Reference counts are those requests' own holds: a count above that would tell that another
  tenant holds the same prefix.
- Prefix hits (``num_cached_tokens``, and which block ids a table shares) tell whether another
  tenant's prompt began the same way; they are disclosed only where the operator allows
  (``enable_prompt_tokens_details`` or ``cache_stats_per_request``). Otherwise the tables are
  left out (``tables_disclosed: false``) and cached-token counts are 0.
- The multimodal cache (image thumbnails) is never shown.
"""

from __future__ import annotations

from collections.abc import Iterable

STATE_LETTERS = {"null": "n", "free": "f", "cached": "c", "used": "u"}
_REQUEST_FIELDS = ("status", "num_prompt_tokens", "num_output_tokens")


def block_view(
    snapshot: dict, request_ids: Iterable[str], *, per_request: bool = False, disclose_hits: bool = False
) -> dict:
    """The endpoint's body for an engine ``cache_snapshot()`` (see the module docstring)."""
    live = snapshot["requests"]
    wanted = list(live) if per_request else [rid for rid in dict.fromkeys(request_ids) if rid in live]
    tables = per_request or disclose_hits
    requests = {rid: _request(live[rid], tables) for rid in wanted}
    return {
        "block_size": snapshot["block_size"],
        "block_states": "".join(STATE_LETTERS[block["state"]] for block in snapshot["blocks"]),
        "free_queue": snapshot["free_queue"],
        "requests": requests,
        "blocks": _held_blocks(snapshot["blocks"], requests, real_refs=per_request),
        "tables_disclosed": tables,
        "stats": snapshot["stats"],
        "kv_groups": snapshot.get("kv_groups", []),
        "block_groups": snapshot.get("block_groups", []),
    }


def _request(view: dict, tables: bool) -> dict:
    out = {key: view[key] for key in _REQUEST_FIELDS}
    out["num_cached_tokens"] = view["num_cached_tokens"] if tables else 0
    out["block_ids"] = view["block_ids"] if tables else []
    return out


def _held_blocks(blocks: list[dict], requests: dict[str, dict], real_refs: bool) -> dict[str, dict]:
    """``{block id: {ref_cnt, num_tokens}}`` for the blocks the listed requests hold."""
    holds: dict[int, int] = {}
    for view in requests.values():
        for block_id in set(view["block_ids"]):
            if block_id:  # block 0 is the null block
                holds[block_id] = holds.get(block_id, 0) + 1
    return {
        str(block_id): {
            "ref_cnt": blocks[block_id]["ref_cnt"] if real_refs else count,
            "num_tokens": blocks[block_id]["num_tokens"],
        }
        for block_id, count in sorted(holds.items())
        if block_id < len(blocks)
    }

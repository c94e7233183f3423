"""A server's ``/v1/cache/blocks`` answer as an engine ``cache_snapshot()``, every field checked.

Connected (``%vllm_mlx connect``), the cache inspector draws what a server says, and its static
picture is saved with the notebook: the server is not trusted to send the types it should.
Counts are coerced to non-negative ints (``markup.as_int``: ``"<script>"`` becomes 0), block ids
outside the grid are dropped (a negative one would index the grid from its end), names and
states become text, and anything else a server adds is left out. What comes out has the shape
and the types of a local engine's snapshot, so ``inspector.encode_snapshot`` can trust it.
"""

from __future__ import annotations

from vllm_mlx_jupyter.views.markup import as_float, as_int

STATE_NAMES = {"n": "null", "f": "free", "c": "cached", "u": "used"}
_REQUEST_COUNTS = ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
_GROUP_COUNTS = ("bytes_per_token", "bytes_per_request", "state_slots", "state_checkpoints", "num_blocks")


def snapshot_from_view(view: dict, ours: dict[str, str]) -> dict:
    """``/v1/cache/blocks`` as an engine ``cache_snapshot()`` (``ours``: server id -> our id).

    Blocks nobody here holds have no token or reference counts on the wire: a used one counts
    one reference, and none has a hash or text. ``ValueError`` when the answer is not a block
    view at all (no ``block_states`` string).
    """
    letters = view.get("block_states") if isinstance(view, dict) else None
    if not isinstance(letters, str):
        raise ValueError("/v1/cache/blocks: the answer has no block_states")
    num_blocks = len(letters)
    held = _mapping(view.get("blocks"))
    from_disk = set(_block_ids(view.get("disk_blocks"), num_blocks))
    blocks = []
    for block_id, letter in enumerate(letters):
        state = STATE_NAMES.get(letter, "null")
        info = _mapping(held.get(str(block_id)))
        blocks.append({"id": block_id, "state": state, "ref_cnt": _count(info.get("ref_cnt"), int(state == "used")),
                       "owners": [], "hash": None, "num_tokens": _count(info.get("num_tokens")), "text": "",
                       "from_disk": block_id in from_disk})  # fmt: skip
    requests = {ours.get(rid, rid): _request(request, num_blocks)
                for rid, request in _mapping(view.get("requests")).items()}  # fmt: skip
    return {"block_size": _count(view.get("block_size")), "blocks": blocks, "requests": requests,
            "free_queue": _block_ids(view.get("free_queue"), num_blocks), "stats": numbers(view.get("stats")),
            "mllm": {"entries": []}, "kv_groups": [_kv_group(g) for g in _dicts(view.get("kv_groups"))],
            "block_groups": [_block_group(g) for g in _dicts(view.get("block_groups"))]}  # fmt: skip


def numbers(stats: object) -> dict:
    """A stats dict with only its numbers (coerced) and nested dicts of numbers; other values
    are left out (readers default them)."""
    out: dict = {}
    for key, value in _mapping(stats).items():
        if isinstance(value, dict):
            out[str(key)] = numbers(value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[str(key)] = value if isinstance(value, int) else as_float(value)
        else:
            number = as_float(value, None)
            if number is not None:
                out[str(key)] = number
    return out


def _request(request: object, num_blocks: int) -> dict:
    request = _mapping(request)
    out = {key: _count(request.get(key)) for key in _REQUEST_COUNTS}
    out.update(status=_text(request.get("status")) or "unknown", num_computed_tokens=0, num_preemptions=0,
               block_ids=_block_ids(request.get("block_ids"), num_blocks))  # fmt: skip
    return out


def _kv_group(group: dict) -> dict:
    """A layer group (``inspector.group_label`` reads it): kind and dtype as text, layers as
    ints, counts as counts (a missing or 0 window stays falsy)."""
    out = {"kind": _text(group.get("kind")) or "?", "window": _count(group.get("window")),
           "layers": [as_int(n) for n in _list(group.get("layers"))]}  # fmt: skip
    if group.get("dtype"):
        out["dtype"] = _text(group["dtype"])
    out.update({key: _count(group[key]) for key in _GROUP_COUNTS if group.get(key) is not None})
    return out


def _block_group(group: dict) -> dict:
    return {"window": _count(group.get("window")), "num_used_blocks": _count(group.get("num_used_blocks"))}


def _block_ids(ids: object, num_blocks: int) -> list[int]:
    """The ids that are blocks of the grid (0 <= id < num_blocks), in order."""
    return [block for block in (as_int(i, -1) for i in _list(ids)) if 0 <= block < num_blocks]


def _count(value: object, fallback: int = 0) -> int:
    return max(as_int(value, fallback), 0)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _dicts(value: object) -> list[dict]:
    return [item for item in _list(value) if isinstance(item, dict)]

"""CacheInspector: a live picture of the engine's paged KV cache (an anywidget).

It reads only ``cache_snapshot()`` (of an ``AsyncEngineCore``, an ``LLM``, or the notebook
session) and pushes it a few times per second from a background thread. Everything
interactive — hover details, highlighting a request's block table — happens in the widget's
JavaScript (``static/inspector.js``), because Python-side callbacks wait for the busy cell;
Python handles only actions: pause/resume and "reset prefix cache".

Synced state (small, binary where it is per block; little-endian):
- ``block_state`` uint8 (0 null, 1 free, 2 cached = evictable prefix block, 3 used),
  ``block_ref`` uint8 (ref count, capped at 255), ``block_owner`` int32 (index in ``requests``
  of the first owner, -1 none), ``block_tokens`` uint16, ``block_evict`` int32 (position in the
  eviction queue, -1 when not queued), ``block_disk`` uint8 (1: its KV was read back from disk,
  the KV disk tier or a prefix file); at most ``MAX_GRID_BLOCKS`` blocks (``num_blocks`` counts
  them all).
- ``block_info``: ``{block id: [hash, text]}`` for blocks that hold tokens.
- ``requests``: table rows ``{id, name, adapter (its LoRA adapter's name, or None), status,
  prompt_tokens, cached_tokens, disk_tokens (of the cached ones, read back by the disk tier),
  output_tokens, num_blocks, offset, color}``; ``block_tables`` int32 holds their tables back to back
  (``offset``/``num_blocks`` index it).
- ``stats`` (usage, hit rate, evictions, tokens saved, ...) and ``mllm``: the multimodal cache
  entries (hash, size, tokens, hits, base64 thumbnail) from ``cache_snapshot()["mllm"]``, an
  empty list while the engine's snapshot has none.
- ``kv_groups``: the model's layer groups from ``cache_snapshot()["kv_groups"]`` (kind, window,
  layers, bytes per token, dtype, blocks), each with a one-line ``label`` the widget shows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import anywidget
import numpy as np
import traitlets
from ipywidgets.widgets.trait_types import bytes_serialization

from vllm_mlx_jupyter.views.markup import as_float, as_int, escape

STATIC = Path(__file__).parent.parent / "static"  # the package's, beside the views
STATE_CODES = {"null": 0, "free": 1, "cached": 2, "used": 3}
STATE_NAMES = {v: k for k, v in STATE_CODES.items()}
MAX_GRID_BLOCKS = 8192
DISK_MARK = "#7b3fa0"  # the corner of a block read back from disk (inspector.css has the same)
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
           "#b07aa1", "#ff9da7", "#9c755f", "#17becf", "#bcbd22", "#8c564b"]  # fmt: skip
_ARRAYS = {"block_state": "u1", "block_ref": "u1", "block_owner": "<i4", "block_tokens": "<u2",
           "block_evict": "<i4", "block_disk": "u1", "block_tables": "<i4"}  # fmt: skip
_STAT_KEYS = ("num_blocks", "num_used_blocks", "num_cached_free_blocks", "num_free_blocks", "usage",
              "evictions", "running", "waiting", "preemptions", "steps")  # fmt: skip


def encode_snapshot(snapshot: dict, rows: Iterable[dict] = (), colors: dict[str, int] | None = None) -> dict:
    """The widget's trait values for a ``cache_snapshot()`` dict.

    ``rows`` name requests and add ones the engine no longer lists (finished); ``colors`` maps
    request ids to palette slots and is extended in place, so colours stay put across pushes.
    """
    colors = {} if colors is None else colors
    blocks = snapshot["blocks"][:MAX_GRID_BLOCKS]
    n = len(blocks)
    requests, tables = _request_rows(snapshot["requests"], rows, colors)
    owner = np.full(n, -1, dtype="<i4")
    for index, request in reversed(list(enumerate(requests))):  # first owner wins
        ids = np.asarray(tables[request["offset"] : request["offset"] + request["num_blocks"]], dtype=np.int64)
        owner[ids[ids < n]] = index
    evict = np.full(n, -1, dtype="<i4")
    queue = np.asarray(snapshot["free_queue"], dtype=np.int64)
    shown = queue < n
    evict[queue[shown]] = np.arange(len(queue), dtype="<i4")[shown]
    return {
        "num_blocks": len(snapshot["blocks"]),
        "block_size": snapshot["block_size"],
        "block_state": bytes(np.fromiter((STATE_CODES[b["state"]] for b in blocks), "u1", n)),
        "block_ref": bytes(np.fromiter((_clamp(b["ref_cnt"], 255) for b in blocks), "u1", n)),
        "block_owner": owner.tobytes(),
        "block_tokens": bytes(np.fromiter((_clamp(b["num_tokens"], 65535) for b in blocks), "<u2", n)),
        "block_evict": evict.tobytes(),
        "block_disk": bytes(np.fromiter((bool(b.get("from_disk")) for b in blocks), "u1", n)),
        "block_info": {str(b["id"]): [b["hash"] or "", b.get("text") or ""] for b in blocks if b["num_tokens"]},
        "requests": requests,
        "block_tables": np.asarray(tables, dtype="<i4").tobytes(),
        "stats": _stats(snapshot["stats"]),
        "mllm": _mllm_entries(snapshot.get("mllm")),
        "kv_groups": [dict(group, label=group_label(group)) for group in snapshot.get("kv_groups", [])]
        + _block_group_lines(snapshot.get("block_groups", [])),
    }


def _clamp(count: int, most: int) -> int:
    """``count`` within 0..``most``, the range of its array's dtype (numpy refuses the rest)."""
    return min(max(count, 0), most)


def _block_group_lines(block_groups: list[dict]) -> list[dict]:
    """With several block groups, one line each: e.g. "block group 2 · window 512 · 33 blocks held"."""
    if len(block_groups) < 2:
        return []
    lines = []
    for index, group in enumerate(block_groups):
        window = f"window {group['window']}" if group["window"] else "all blocks"
        lines.append({"label": f"block group {index} · {window} · {group['num_used_blocks']} blocks held"})
    return lines


def group_label(group: dict) -> str:
    """One line for a layer group, e.g. "sliding window 512 · 20 layers: 0–4, 6–10, … · 4096 B/token
    (bfloat16) · 640 blocks". Keys a group lacks are left out (state groups may add their own)."""
    kind = group.get("kind", "?").replace("_", " ")
    parts = [f"{kind} {group['window']}" if group.get("window") else kind]
    layers = group.get("layers", [])
    parts.append(f"{len(layers)} layer{'s' if len(layers) != 1 else ''}: {_ranges(layers)}")
    if group.get("bytes_per_token"):
        dtype = f" ({group['dtype']})" if group.get("dtype") else ""
        parts.append(f"{group['bytes_per_token']} B/token{dtype}")
    units = (("bytes_per_request", "B/request"), ("state_slots", "state slots"),
             ("state_checkpoints", "checkpoints"), ("num_blocks", "blocks"))  # fmt: skip
    for key, unit in units:
        if group.get(key) is not None:
            parts.append(f"{group[key]} {unit}")
    return " · ".join(parts)


def _ranges(numbers: list[int], most: int = 4) -> str:
    """``[0, 1, 2, 5]`` -> "0–2, 5"; more than ``most`` runs end in "…"."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = [str(a) if a == b else f"{a}–{b}" for a, b in runs[:most]]
    return ", ".join(text + (["…"] if len(runs) > most else []))


_MLLM_FIELDS = ("hash", "width", "height", "bytes", "num_tokens", "hits", "thumbnail_base64")


def _mllm_entries(mllm) -> list[dict]:
    """Multimodal cache entries (``{"entries": [...]}`` or a list), JSON fields only."""
    entries = mllm.get("entries", []) if isinstance(mllm, dict) else (mllm or [])
    return [{k: e[k] for k in _MLLM_FIELDS if k in e} for e in entries]


def _request_rows(live: dict, rows: Iterable[dict], colors: dict[str, int]) -> tuple[list[dict], list[int]]:
    """Table rows (known rows in order, then live requests nobody named) and their tables."""
    known = {r["id"]: r for r in rows}
    order = list(known) + [rid for rid in live if rid not in known]
    requests, tables = [], []
    for rid in order:
        view, row = live.get(rid), known.get(rid, {})
        block_ids = view["block_ids"] if view is not None else []
        status = row.get("status") or view["status"].lower()
        if view is not None and status in ("done", "aborted", "error"):
            status = view["status"].lower()  # the engine still lists it: not finished yet
        requests.append({
            "id": rid, "name": row.get("name", rid), "adapter": row.get("adapter"), "status": status,
            "prompt_tokens": view["num_prompt_tokens"] if view else row.get("prompt_tokens", 0),
            "cached_tokens": view["num_cached_tokens"] if view else row.get("cached_tokens", 0),
            "disk_tokens": view.get("num_disk_tokens", 0) if view else row.get("disk_tokens", 0),
            "output_tokens": view["num_output_tokens"] if view else row.get("output_tokens", 0),
            "num_blocks": len(block_ids), "offset": len(tables),
            "color": color_slot(colors, rid),
        })  # fmt: skip
        tables.extend(block_ids)
    return requests, tables


def color_slot(colors: dict[str, int], request_id: str) -> int:
    """The request's palette slot: the next one on first sight, then always the same (the
    timeline shares this assignment, so a request has one colour in both widgets)."""
    return colors.setdefault(request_id, len(colors)) % len(PALETTE)


def _stats(stats: dict) -> dict:
    prefix = stats.get("prefix_cache")
    prefix = prefix if isinstance(prefix, dict) else {}  # a server may send none, or a number
    out = {k: stats[k] for k in _STAT_KEYS if k in stats}
    out.update(hit_rate=prefix.get("hit_rate", 0.0), queries=prefix.get("queries", 0), hits=prefix.get("hits", 0),
               tokens_saved=prefix.get("tokens_saved", 0), prefix_evictions=prefix.get("evictions", 0))  # fmt: skip
    return out


def decode_state(state: dict) -> dict:
    """Binary traits back to lists (tests, the HTML fallback); other keys as they are."""
    out = dict(state)
    for key, dtype in _ARRAYS.items():
        if key in out:
            out[key] = np.frombuffer(bytes(out[key]), dtype=dtype).tolist()
    return out


class WidgetFallbacks:
    """For the engine's live widgets (mixed in before ``anywidget.AnyWidget``): a text summary
    and a static HTML picture beside the widget, for frontends that cannot show widgets; and
    ``close`` stops the widget's polling thread (``_closed``). The widget defines ``summary``
    and ``_repr_html_``."""

    def close(self) -> None:
        self._closed.set()
        super().close()

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)  # anywidget: (data, metadata)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        if isinstance(data, dict):
            data["text/plain"] = self.summary()
            data["text/html"] = self._repr_html_()
        return bundle

    def __repr__(self) -> str:
        return self.summary()


class CacheInspector(WidgetFallbacks, anywidget.AnyWidget):
    """A grid of KV blocks by state, a request table and cache stats, updated live.

    ``CacheInspector(engine)`` works with anything that has ``cache_snapshot()`` (and
    ``reset_prefix_cache()`` for the button); ``rows()`` may name requests (see
    ``encode_snapshot``). Pushes come every ``interval`` seconds while requests run (1 s when
    idle), never more often than 20x a snapshot's cost. ``colors`` (request id -> palette slot,
    see ``color_slot``) may be shared with a ``SchedulerTimeline``. ``close()`` stops the thread.
    """

    _esm = STATIC / "inspector.js"
    _css = STATIC / "inspector.css"

    num_blocks = traitlets.Int(0).tag(sync=True)
    block_size = traitlets.Int(0).tag(sync=True)
    block_state = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_ref = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_owner = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_tokens = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_evict = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_disk = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    block_info = traitlets.Dict().tag(sync=True)
    requests = traitlets.List().tag(sync=True)
    block_tables = traitlets.Bytes(b"").tag(sync=True, **bytes_serialization)
    stats = traitlets.Dict().tag(sync=True)
    mllm = traitlets.List().tag(sync=True)
    kv_groups = traitlets.List().tag(sync=True)
    paused = traitlets.Bool(False).tag(sync=True)
    engine_state = traitlets.Unicode("no engine").tag(sync=True)

    def __init__(
        self,
        source,
        *,
        rows: Callable[[], list[dict]] | None = None,
        interval: float = 0.3,
        colors: dict[str, int] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self._source = source
        self._rows = rows
        self._interval = interval
        self._colors = {} if colors is None else colors  # shared with the session's timeline
        self._push_lock = threading.Lock()
        self._closed = threading.Event()
        self.on_msg(self._on_message)
        self.refresh()
        threading.Thread(target=self._loop, name="vllm-mlx-inspector", daemon=True).start()

    def refresh(self) -> bool:
        """Snapshot now and push it (one message); False when there is no engine to read."""
        with self._push_lock:
            try:
                snapshot = self._source.cache_snapshot()
            except Exception as exc:  # noqa: BLE001 - no engine (yet, or any more): say so
                self.engine_state = f"no engine: {exc}"
                return False
            values = encode_snapshot(snapshot, self._rows() if self._rows else (), self._colors)
            with self.hold_sync():
                for name, value in values.items():
                    setattr(self, name, value)
                self.engine_state = "running"
            return True

    def _loop(self) -> None:
        period = self._interval
        while not self._closed.wait(period):
            if self.paused:
                period = self._interval
                continue
            start = time.monotonic()
            ok = self.refresh()
            busy = ok and (self.stats.get("running", 0) or self.stats.get("waiting", 0) or self._rows_active())
            period = max(self._interval if busy else 1.0, 20 * (time.monotonic() - start))

    def _rows_active(self) -> bool:
        return any(r["status"] in ("queued", "prefilling", "generating") for r in self.requests)

    def _on_message(self, _widget, content: dict, _buffers) -> None:
        if content.get("type") == "reset":
            try:
                self._source.reset_prefix_cache()
            except Exception as exc:  # noqa: BLE001 - shown in the widget, not raised into a cell
                self.engine_state = f"reset failed: {exc}"
        self.refresh()

    def summary(self) -> str:
        s = self.stats
        if not s:
            return f"CacheInspector ({self.engine_state})"
        return (f"KV cache: {as_int(s.get('num_used_blocks'))} used, {as_int(s.get('num_cached_free_blocks'))} cached, "
                f"{as_int(s.get('num_free_blocks'))} free of {as_int(s.get('num_blocks'))} blocks; "
                f"hit rate {as_float(s.get('hit_rate')):.0%}, {as_int(s.get('tokens_saved'))} tokens saved, "
                f"{as_int(s.get('evictions'))} evictions; {len(self.requests)} requests")  # fmt: skip

    def _repr_html_(self) -> str:
        return static_html(self.get_state())


_FALLBACK_COLORS = {0: "#555", 1: "#e8e8e8", 2: "#b9dcb9"}


def static_html(state: dict, max_blocks: int = 2048) -> str:
    """A static HTML picture of the widget state (for nbconvert, GitHub, ...). Every value is
    escaped or coerced (``markup``): connected, the counts and names come from a server."""
    data = decode_state(state)
    requests = data.get("requests", [])
    cells = []
    from_disk = data.get("block_disk", [])
    for i, code in enumerate(data.get("block_state", [])[:max_blocks]):
        owner, ref = data["block_owner"][i], data["block_ref"][i]
        disk = i < len(from_disk) and from_disk[i]
        color = (
            PALETTE[as_int(requests[owner].get("color")) % len(PALETTE)]
            if code == 3 and 0 <= owner < len(requests)
            else _FALLBACK_COLORS.get(code, "#ccc")
        )
        border = "outline:1px solid #000;" if ref > 1 else ""
        corner = f"background-image:linear-gradient(135deg,transparent 55%,{DISK_MARK} 55%);" if disk else ""
        title = f"block {i}: {STATE_NAMES.get(code, '?')}, ref {ref}{', from disk' if disk else ''}"
        cells.append(f'<span title="{title}" style="display:inline-block;'
                     f'width:9px;height:9px;margin:1px;background-color:{color};{corner}{border}"></span>')  # fmt: skip
    rows = "".join(
        f"<tr><td>{escape(request_label(r))}</td><td>{escape(r.get('status', ''))}</td>"
        f"<td>{as_int(r.get('prompt_tokens'))}</td><td>{cached_cell(r)}</td>"
        + "".join(f"<td>{as_int(r.get(key))}</td>" for key in ("output_tokens", "num_blocks"))
        + "</tr>"
        for r in requests
    )
    s = data.get("stats", {})
    head = (f"KV cache — usage {as_float(s.get('usage')):.0%} of {as_int(s.get('num_blocks'))} blocks, "
            f"hit rate {as_float(s.get('hit_rate')):.0%}, {as_int(s.get('tokens_saved'))} tokens saved, "
            f"{as_int(s.get('evictions'))} evictions")  # fmt: skip
    table = ("<table><tr><th>name</th><th>status</th><th>prompt</th><th>cached</th><th>generated</th>"
             f"<th>blocks</th></tr>{rows}</table>") if rows else ""  # fmt: skip
    groups = "".join(f"<div>{escape(g.get('label', ''))}</div>" for g in data.get("kv_groups", []))
    grid = f'<div style="max-width:640px">{"".join(cells)}</div>'
    return f'<div class="vllm-mlx-inspector-static"><div>{escape(head)}</div>{groups}{grid}{table}</div>'


def cached_cell(row: dict) -> str:
    """A request's cached prompt tokens, and how many of them came from the disk tier."""
    cached, disk = as_int(row.get("cached_tokens")), as_int(row.get("disk_tokens"))
    return f"{cached} ({disk} from disk)" if disk else str(cached)


def request_label(row: dict) -> str:
    """A request's name, and its LoRA adapter's when it has one."""
    adapter = row.get("adapter")
    return f"{row.get('name', '')} · {adapter}" if adapter else str(row.get("name", ""))


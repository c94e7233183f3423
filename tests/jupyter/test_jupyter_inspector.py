"""CacheInspector: snapshot encoding, widget state round trips, actions, a live engine."""

from __future__ import annotations

import threading
import time

import numpy as np
from ipywidgets.widgets.widget import _put_buffers, _remove_buffers

from vllm_mlx_jupyter.views.inspector import (
    MAX_GRID_BLOCKS,
    CacheInspector,
    decode_state,
    encode_snapshot,
    group_label,
    static_html,
)


def block(id, state, ref=0, owners=(), hash=None, tokens=0, text=""):
    return {"id": id, "state": state, "ref_cnt": ref, "owners": list(owners), "hash": hash,
            "num_tokens": tokens, "token_ids": list(range(tokens)) or None, "text": text}  # fmt: skip


def request(block_ids, status="RUNNING", prompt=20, cached=0, output=3):
    return {"status": status, "num_prompt_tokens": prompt, "num_computed_tokens": prompt, "num_cached_tokens": cached,
            "num_output_tokens": output, "num_preemptions": 0, "block_ids": list(block_ids)}  # fmt: skip


SNAPSHOT = {
    "block_size": 16,
    "blocks": [
        block(0, "null"),
        block(1, "used", 2, ["a", "b"], "h1", 16, "shared prefix"),
        block(2, "used", 1, ["a"], None, 5, "tail of a"),
        block(3, "used", 1, ["b"], None, 7, "tail of b"),
        block(4, "cached", 0, [], "h4", 16, "old prefix"),
        block(5, "free"),
        block(6, "free"),
    ],
    "requests": {"a": request([1, 2], cached=16), "b": request([1, 3])},
    "free_queue": [4, 5, 6],
    "stats": {"num_blocks": 6, "num_used_blocks": 3, "num_cached_free_blocks": 1, "num_free_blocks": 3,
              "usage": 0.5, "evictions": 2, "running": 2, "waiting": 0,
              "prefix_cache": {"hit_rate": 0.25, "tokens_saved": 16, "queries": 4, "hits": 1, "evictions": 2}},
}  # fmt: skip


class FakeSource:
    def __init__(self, snapshot=SNAPSHOT):
        self.snapshot = snapshot
        self.snapshots = 0
        self.resets = 0

    def cache_snapshot(self):
        self.snapshots += 1
        return self.snapshot

    def reset_prefix_cache(self):
        self.resets += 1
        return True


def test_encode_snapshot_exact_arrays():
    colors: dict = {}
    state = decode_state(
        encode_snapshot(SNAPSHOT, rows=[{"id": "b", "name": "second", "status": "generating"}], colors=colors)
    )
    assert state["num_blocks"] == 7 and state["block_size"] == 16
    assert state["block_state"] == [0, 3, 3, 3, 2, 1, 1]
    assert state["block_ref"] == [0, 2, 1, 1, 0, 0, 0]
    assert [r["id"] for r in state["requests"]] == ["b", "a"]  # named rows first, then the rest
    assert state["block_owner"] == [-1, 0, 1, 0, -1, -1, -1]  # index of the first owner in the table
    assert state["block_tokens"] == [0, 16, 5, 7, 16, 0, 0]
    assert state["block_evict"] == [-1, -1, -1, -1, 0, 1, 2]
    b, a = state["requests"]
    assert (b["name"], b["status"], b["num_blocks"], b["offset"]) == ("second", "generating", 2, 0)
    assert (a["name"], a["status"], a["cached_tokens"], a["offset"]) == ("a", "running", 16, 2)
    assert state["block_tables"] == [1, 3, 1, 2]
    assert state["block_info"] == {"1": ["h1", "shared prefix"], "2": ["", "tail of a"], "3": ["", "tail of b"],
                                   "4": ["h4", "old prefix"]}  # fmt: skip
    assert state["stats"]["hit_rate"] == 0.25 and state["stats"]["tokens_saved"] == 16
    assert state["mllm"] == []
    # colours stick to requests across pushes, whatever the table order
    again = encode_snapshot(SNAPSHOT, colors=colors)
    assert {r["id"]: r["color"] for r in again["requests"]} == {r["id"]: r["color"] for r in state["requests"]}


def test_finished_rows_stay_listed_without_blocks():
    snapshot = {**SNAPSHOT, "requests": {}}
    rows = [{"id": "old", "name": "old", "status": "done", "prompt_tokens": 9, "cached_tokens": 0, "output_tokens": 4}]
    state = decode_state(encode_snapshot(snapshot, rows))
    assert state["requests"][0]["status"] == "done" and state["requests"][0]["num_blocks"] == 0
    assert state["requests"][0]["output_tokens"] == 4 and state["block_owner"] == [-1] * 7


def test_rows_name_their_adapter_and_what_came_from_disk():
    from vllm_mlx_jupyter.views.inspector import cached_cell, request_label

    rows = [{"id": "b", "name": "second", "status": "generating", "adapter": "sql", "disk_tokens": 16}]
    state = decode_state(encode_snapshot(SNAPSHOT, rows=rows))
    b = next(r for r in state["requests"] if r["id"] == "b")
    assert b["adapter"] == "sql" and request_label(b) == "second · sql"
    a = next(r for r in state["requests"] if r["id"] == "a")
    assert a["adapter"] is None and request_label(a) == "a"
    assert cached_cell({"cached_tokens": 32, "disk_tokens": 16}) == "32 (16 from disk)"
    assert cached_cell({"cached_tokens": 32, "disk_tokens": 0}) == "32"


def test_blocks_read_from_disk_are_marked_in_the_grid():
    blocks = [dict(b) for b in SNAPSHOT["blocks"]]
    blocks[1]["from_disk"] = blocks[4]["from_disk"] = True
    state = decode_state(encode_snapshot({**SNAPSHOT, "blocks": blocks}))
    assert state["block_disk"] == [0, 1, 0, 0, 1, 0, 0]
    assert decode_state(encode_snapshot(SNAPSHOT))["block_disk"] == [0] * 7
    html = static_html(encode_snapshot({**SNAPSHOT, "blocks": blocks}))
    assert html.count(", from disk") == 2 and "block 1: used, ref 2, from disk" in html


def test_a_servers_disk_blocks_reach_the_grid_only_where_hits_are_disclosed():
    from vllm_mlx.core.snapshot import CacheSnapshot
    from vllm_mlx.entrypoints.openai.cache_blocks import block_view
    from vllm_mlx_jupyter.views.server_view import snapshot_from_view

    blocks = [dict(b) for b in SNAPSHOT["blocks"]]
    blocks[1]["from_disk"] = blocks[4]["from_disk"] = True
    typed = CacheSnapshot.from_dict({**SNAPSHOT, "blocks": blocks, "stats": {**SNAPSHOT["stats"], "block_size": 16}})
    assert block_view(typed, [])["disk_blocks"] == []  # which blocks came back tells of other prompts
    shown = block_view(typed, [], disclose_hits=True)
    assert shown["disk_blocks"] == [1, 4]
    state = decode_state(encode_snapshot(snapshot_from_view(shown, {})))
    assert state["block_disk"] == [0, 1, 0, 0, 1, 0, 0]


def test_multimodal_entries_keep_json_fields_only():
    entry = {"hash": "abc123", "width": 32, "height": 16, "thumbnail_png": b"\x89PNG", "thumbnail_base64": "iVBO",
             "bytes": 4096, "num_tokens": 64, "hits": 2, "created": 1.0, "last_used": 2.0}  # fmt: skip
    for mllm in ({"entries": [entry], "stats": {}}, [entry]):
        (kept,) = encode_snapshot({**SNAPSHOT, "mllm": mllm})["mllm"]
        assert kept == {"hash": "abc123", "width": 32, "height": 16, "bytes": 4096, "num_tokens": 64, "hits": 2,
                        "thumbnail_base64": "iVBO"}  # fmt: skip
    assert encode_snapshot(SNAPSHOT)["mllm"] == []


def test_grid_is_capped_but_counts_every_block():
    blocks = [block(i, "free") for i in range(MAX_GRID_BLOCKS + 10)]
    snapshot = {**SNAPSHOT, "blocks": blocks, "requests": {"a": request([MAX_GRID_BLOCKS + 5])},
                "free_queue": list(range(MAX_GRID_BLOCKS + 10))}  # fmt: skip
    state = encode_snapshot(snapshot)
    assert state["num_blocks"] == MAX_GRID_BLOCKS + 10 and len(state["block_state"]) == MAX_GRID_BLOCKS
    assert len(np.frombuffer(state["block_evict"], "<i4")) == MAX_GRID_BLOCKS


def test_widget_state_round_trips_through_the_wire():
    widget = CacheInspector(FakeSource())
    try:
        state = widget.get_state()
        assert isinstance(state["block_state"], (bytes, memoryview))
        # what the kernel sends: JSON plus binary buffers; what comes back from a frontend
        wire, paths, buffers = _remove_buffers(state)
        assert {p[0] for p in paths} >= {"block_state", "block_owner", "block_tables"}
        _put_buffers(wire, paths, [memoryview(bytes(b)) for b in buffers])
        other = CacheInspector(FakeSource({**SNAPSHOT, "blocks": SNAPSHOT["blocks"][:1], "requests": {}}))
        try:
            other.set_state(wire)
            for name in ("block_state", "block_owner", "block_tables", "block_info", "requests", "stats"):
                assert getattr(other, name) == getattr(widget, name), name
            assert decode_state(other.get_state())["block_owner"] == [-1, 0, 0, 1, -1, -1, -1]
        finally:
            other.close()
    finally:
        widget.close()


def test_actions_reset_and_pause():
    source = FakeSource()
    widget = CacheInspector(source, interval=0.05)
    try:
        widget._on_message(widget, {"type": "reset"}, [])  # what the JS "Reset prefix cache" sends
        assert source.resets == 1
        widget.paused = True
        time.sleep(0.2)
        count = source.snapshots
        time.sleep(0.3)
        assert source.snapshots == count  # paused: no pushes
        widget.paused = False
        deadline = time.monotonic() + 5
        while source.snapshots == count and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.snapshots > count
    finally:
        widget.close()
    count = source.snapshots
    time.sleep(1.2)
    assert source.snapshots == count  # closed: the thread ended


def test_no_engine_state_and_fallback_repr():
    class Dead:
        def cache_snapshot(self):
            raise RuntimeError("no model is loaded")

    widget = CacheInspector(Dead())
    try:
        assert widget.engine_state.startswith("no engine")
        assert "no engine" in widget.summary()
    finally:
        widget.close()
    widget = CacheInspector(FakeSource())
    try:
        bundle = widget._repr_mimebundle_()
        bundle = bundle[0] if isinstance(bundle, tuple) else bundle
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert bundle["text/plain"].startswith("KV cache: 3 used, 1 cached")
        assert bundle["text/html"].count("<span title=") == 7 and "tail" not in bundle["text/html"]
        assert static_html(widget.get_state()) == widget._repr_html_()
    finally:
        widget.close()


GROUPS = [
    {"kind": "sliding_window", "window": 512, "layers": [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16],
     "bytes_per_token": 4096, "dtype": "bfloat16", "num_blocks": 640},
    {"kind": "full_attention", "window": None, "layers": [3], "bytes_per_token": 512, "dtype": "bfloat16",
     "num_blocks": 640},
]  # fmt: skip


def test_layer_groups_one_line_each():
    assert [group_label(g) for g in GROUPS] == [
        "sliding window 512 · 13 layers: 0–2, 4–6, 8–10, 12–14, … · 4096 B/token (bfloat16) · 640 blocks",
        "full attention · 1 layer: 3 · 512 B/token (bfloat16) · 640 blocks",
    ]
    state = encode_snapshot({**SNAPSHOT, "kv_groups": GROUPS})
    assert [g["label"] for g in state["kv_groups"]] == [group_label(g) for g in GROUPS]
    assert encode_snapshot(SNAPSHOT)["kv_groups"] == []  # an engine without groups in its snapshot
    widget = CacheInspector(FakeSource({**SNAPSHOT, "kv_groups": GROUPS}), interval=60)
    try:
        assert "sliding window 512 · 13 layers" in widget._repr_html_()
    finally:
        widget.close()


def test_live_engine_blocks_owned_then_cached(tiny_model_dir):
    from vllm_mlx import AsyncEngineCore, SamplingParams

    with AsyncEngineCore(model=str(tiny_model_dir), num_kv_blocks=32) as engine:
        widget = CacheInspector(engine, interval=0.05)
        try:
            prompt = "A prompt long enough to fill more than one block of sixteen tokens, for the inspector."
            stream = engine.add_request(prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True), "live")
            outputs = iter(stream)
            next(outputs)
            widget.refresh()
            state = decode_state(widget.get_state())
            (row,) = state["requests"]
            assert row["id"] == "live" and row["num_blocks"] >= 2
            table = state["block_tables"][row["offset"] : row["offset"] + row["num_blocks"]]
            assert all(state["block_state"][b] == 3 and state["block_owner"][b] == 0 for b in table)
            assert state["block_info"][str(table[0])][1].startswith("A prompt")
            [group] = state["kv_groups"]  # the tiny llama: one full-attention group of 2 layers
            assert group["label"].startswith("full attention · 2 layers: 0–1 · ")
            assert group["num_blocks"] == 32
            for _ in outputs:
                pass
            widget.refresh()
            state = decode_state(widget.get_state())
            assert state["requests"] == [] and 3 not in state["block_state"]
            assert state["block_state"][table[0]] == 2  # its full blocks stay cached (evictable)
        finally:
            widget.close()


def test_pushes_from_a_thread_while_generating(tiny_model_dir):
    """The background thread pushes on its own: no refresh() calls from the test."""
    from vllm_mlx import AsyncEngineCore, SamplingParams

    with AsyncEngineCore(model=str(tiny_model_dir), num_kv_blocks=32) as engine:
        widget = CacheInspector(engine, interval=0.05)
        seen = threading.Event()
        widget.observe(lambda change: seen.set() if change["new"] else None, "requests")
        try:
            stream = engine.add_request("Hello", SamplingParams(max_tokens=400, ignore_eos=True))
            assert seen.wait(10), "no push while the request ran"
            stream.result()
        finally:
            widget.close()

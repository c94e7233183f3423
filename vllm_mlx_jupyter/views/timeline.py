"""SchedulerTimeline: the engine's steps, one column each, scrolling live (an anywidget).

It reads only the engine's ``recent_step_records()`` (``StepRecord``s the engine keeps anyway, a bounded
deque), polling a few times per second from a background thread; with no widget on screen
nothing reads them. Each push sends only the records newer than the last one sent (at most
``MAX_RECORDS``); the widget's JavaScript (``static/timeline.js``) appends them to its own
bounded set of columns, and does the hover details itself, because Python-side callbacks wait
for the busy cell. A view opened later starts from the latest push.

Synced state (plain JSON):
- ``records``: the newest records not sent before, oldest first, each
  ``{step, ms, budget, used, calls, reqs: [{id, color, prefill, decode, start, prompt, proposed,
  accepted}],
  preempted: [{id, color}], resumed: [id], hits: {id: cached tokens}}``.
- ``epoch``: bumped when the engine changes (a new model, a restart): the view starts over.
- ``max_columns``: how many steps the view keeps; ``engine_state``: "running" or why not.

Colours are palette slots from the cache inspector's assignment (``inspector.color_slot``);
give both widgets the same ``colors`` dict and a request has one colour in both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import anywidget
import traitlets

from vllm_mlx.core.outputs import StepRecord, recent_step_records
from vllm_mlx_jupyter.views.inspector import PALETTE, STATIC, WidgetFallbacks, color_slot
from vllm_mlx_jupyter.views.markup import as_float, as_int, escape

MAX_RECORDS = 256  # per push: a burst of steps between two polls is cut to the newest
MAX_COLUMNS = 400


def recent_records(records: Sequence[StepRecord], after: int, limit: int = MAX_RECORDS) -> list[StepRecord]:
    """The newest ``limit`` records with ``step_id > after``, oldest first (records are in
    step order; ``core.outputs.recent_step_records``)."""
    return recent_step_records(records, after, limit)


def encode_record(record: StepRecord, colors: dict[str, int]) -> dict:
    """One step as the widget's plain data (see the module docstring); extends ``colors``."""
    return {
        "step": record.step_id,
        "ms": round(record.wall_time * 1000, 3),
        "budget": record.token_budget,
        "used": record.num_scheduled_tokens,
        "calls": record.num_forward_calls,
        "reqs": [
            {"id": q.request_id, "color": color_slot(colors, q.request_id), "prefill": q.num_prefill_tokens,
             "decode": q.num_decode_tokens, "start": q.num_computed_tokens, "prompt": q.num_prompt_tokens,
             "proposed": q.num_draft_tokens, "accepted": q.num_accepted_tokens}
            for q in record.requests
        ],  # fmt: skip
        "preempted": [{"id": rid, "color": color_slot(colors, rid)} for rid in record.preempted],
        "resumed": record.resumed,
        "hits": record.prefix_hits,
    }


def read_records(source, after: int, limit: int = MAX_RECORDS) -> tuple[object, list[StepRecord]]:
    """(the engine, its records after step ``after``) from a notebook ``Session``, an
    ``AsyncEngineCore`` (read on its thread), an ``EngineCore`` or an ``LLM``."""
    engine = source.require_engine() if hasattr(source, "require_engine") else source
    if hasattr(engine, "call"):  # an AsyncEngineCore: read on its thread
        return engine, engine.recent_step_records(after, limit, timeout=5)
    core = getattr(engine, "engine", engine)  # LLM -> its EngineCore
    for _ in range(3):  # the engine's thread may append while we read
        try:
            if hasattr(core, "recent_step_records"):
                return engine, core.recent_step_records(after, limit)
            return engine, recent_records(core.step_records, after, limit)  # anything keeping records
        except RuntimeError:
            continue
    return engine, []


class SchedulerTimeline(WidgetFallbacks, anywidget.AnyWidget):
    """One column per engine step: the batch's requests (stacked prefill and decode tokens,
    coloured per request), preemptions, resumes, prefix hits, step time and token budget.

    ``SchedulerTimeline(source)`` polls ``source`` (see ``read_records``) every ``interval``
    seconds while steps arrive (1 s when idle); ``close()`` stops the thread.
    """

    _esm = STATIC / "timeline.js"
    _css = STATIC / "timeline.css"

    records = traitlets.List().tag(sync=True)
    epoch = traitlets.Int(0).tag(sync=True)
    max_columns = traitlets.Int(MAX_COLUMNS).tag(sync=True)
    engine_state = traitlets.Unicode("no engine").tag(sync=True)

    def __init__(self, source, *, colors: dict[str, int] | None = None, interval: float = 0.3, **kwargs) -> None:
        super().__init__(**kwargs)
        self._source = source
        self._colors = {} if colors is None else colors
        self._interval = interval
        self._engine = None
        self._last_step = 0
        self._history: list[dict] = []  # what the views hold, for the HTML fallback
        self._push_lock = threading.Lock()
        self._closed = threading.Event()
        self.refresh()
        threading.Thread(target=self._loop, name="vllm-mlx-timeline", daemon=True).start()

    def refresh(self) -> int:
        """Read the records not sent yet and push them (nothing when there are none); returns
        how many were sent."""
        with self._push_lock:
            try:
                engine, records = read_records(self._source, self._last_step)
            except Exception as exc:  # noqa: BLE001 - no engine (yet, or any more): say so
                self.engine_state = f"no engine: {exc}"
                return 0
            if engine is not self._engine:
                return self._start_over(engine)
            self.engine_state = "running"
            if not records:
                return 0
            self._push([encode_record(r, self._colors) for r in records])
            return len(records)

    def _start_over(self, engine) -> int:
        """A new engine: its step ids start again at 1, so the view starts over too."""
        engine, records = read_records(engine, 0)
        self._engine, self._last_step, self._history = engine, 0, []
        with self.hold_sync():
            self.epoch += 1
            self.engine_state = "running"
            self._push([encode_record(r, self._colors) for r in records])
        return len(records)

    def _push(self, encoded: list[dict]) -> None:
        if encoded:
            self._last_step = encoded[-1]["step"]
            self._history = (self._history + encoded)[-self.max_columns :]
        self.records = encoded

    def _loop(self) -> None:
        period = self._interval
        while not self._closed.wait(period):
            start = time.monotonic()
            busy = self.refresh() > 0
            period = max(self._interval if busy else 1.0, 20 * (time.monotonic() - start))

    def summary(self) -> str:
        steps = self._history
        if not steps:
            return f"SchedulerTimeline ({self.engine_state}): no steps yet"
        used = sum(s["used"] for s in steps) / len(steps)
        ms = sum(s["ms"] for s in steps) / len(steps)
        preempted = sum(len(s["preempted"]) for s in steps)
        proposed = sum(q.get("proposed", 0) for s in steps for q in s["reqs"])
        accepted = sum(q.get("accepted", 0) for s in steps for q in s["reqs"])
        speculation = f", {accepted} of {proposed} proposed tokens kept" if proposed else ""
        return (f"Scheduler timeline: steps {steps[0]['step']}–{steps[-1]['step']}, {used:.1f} of "
                f"{steps[-1]['budget']} tokens per step, {ms:.1f} ms per step, {preempted} preemptions"
                f"{speculation}")  # fmt: skip

    def _repr_html_(self) -> str:
        return static_html(self._history)


def static_html(steps: list[dict], height: int = 60) -> str:
    """A static HTML picture of encoded steps (for nbconvert, GitHub, ...): one column per
    step, stacked per request (prefill solid, decode faded), a red top on preemption. Values
    go in escaped, and numbers coerced (``markup``), like every HTML builder's."""
    columns = []
    for s in steps:
        used, budget = as_int(s.get("used")), as_int(s.get("budget"))
        scale = max(budget, used, 1)
        parts = []
        for q in reversed(s.get("reqs", [])):  # the first request at the bottom
            color = PALETTE[as_int(q.get("color")) % len(PALETTE)]
            for tokens, opacity in ((as_int(q.get("decode")), 0.5), (as_int(q.get("prefill")), 1.0)):
                if tokens > 0:
                    px = max(1, round(tokens / scale * height))
                    parts.append(f'<div style="height:{px}px;background:{color};opacity:{opacity}"></div>')
        top = "border-top:2px solid #e53935;" if s.get("preempted") else ""
        title = escape(f"step {as_int(s.get('step'))}: {used}/{budget} tokens, {as_float(s.get('ms')):.1f} ms, "
                       f"{len(s.get('reqs', []))} requests")  # fmt: skip
        columns.append(f'<div title="{title}" style="display:flex;flex-direction:column;justify-content:flex-end;'
                       f'width:5px;height:{height}px;margin-right:1px;{top}">{"".join(parts)}</div>')  # fmt: skip
    head = f"Scheduler timeline — {len(steps)} steps" if steps else "Scheduler timeline — no steps yet"
    return (f'<div class="vllm-mlx-timeline-static"><div>{escape(head)}</div>'
            f'<div style="display:flex;align-items:flex-end">{"".join(columns)}</div></div>')  # fmt: skip

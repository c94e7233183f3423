"""The scheduler timeline widget and the ``--logprobs`` token view."""

from __future__ import annotations

import math
from collections import deque

import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from ipywidgets.widgets.widget import _put_buffers, _remove_buffers

from vllm_mlx.core.outputs import Admission, StepRecord, StepRequestRecord
from vllm_mlx.core.request import CompletionOutput, RequestOutput
from vllm_mlx_jupyter.session.generation import DONE, Generation
from vllm_mlx_jupyter.views.inspector import CacheInspector
from vllm_mlx_jupyter.views.render import LiveView
from vllm_mlx_jupyter.views.timeline import SchedulerTimeline, encode_record, recent_records, static_html
from vllm_mlx_jupyter.views.token_view import TOKENS, TokenLog, token_html
from notebook_shell import loaded_shell

TIMEOUT = 60.0


def record(step: int, preempted=(), admitted=()) -> StepRecord:
    """Step ``step``: "a" decodes one token, "b" prefills 6 tokens of its 20-token prompt."""
    requests = [StepRequestRecord("a", 30, 1, 20, True), StepRequestRecord("b", 8, 6, 20, False)]
    return StepRecord(step, ["a", "b"], [1, 6], 1, requests, list(preempted), list(admitted), 8, 0.0125)


class FakeEngine:
    def __init__(self, steps=range(1, 4)):
        self.step_records = deque((record(s) for s in steps), maxlen=16)


class FakeSession:
    """Like the notebook session: ``require_engine()`` gives whatever engine is loaded."""

    def __init__(self, engine):
        self.engine = engine

    def require_engine(self):
        return self.engine


def test_encode_record_plain_data():
    colors = {"b": 0}
    step = record(7, preempted=["c"], admitted=[Admission("b", 16, False), Admission("d", 0, True)])
    assert encode_record(step, colors) == {
        "step": 7, "ms": 12.5, "budget": 8, "used": 7, "calls": 1,
        "reqs": [{"id": "a", "color": 1, "prefill": 0, "decode": 1, "start": 30, "prompt": 20, "proposed": 0,
                  "accepted": 0},
                 {"id": "b", "color": 0, "prefill": 6, "decode": 0, "start": 8, "prompt": 20, "proposed": 0,
                  "accepted": 0}],
        "preempted": [{"id": "c", "color": 2}], "resumed": ["d"], "hits": {"b": 16},
    }  # fmt: skip
    assert colors == {"b": 0, "a": 1, "c": 2}


def test_recent_records_newest_after_a_step():
    records = [record(s) for s in range(1, 11)]
    assert [r.step_id for r in recent_records(records, after=7)] == [8, 9, 10]
    assert [r.step_id for r in recent_records(records, after=0, limit=3)] == [8, 9, 10]
    assert recent_records(records, after=10) == []


def test_only_new_records_are_sent():
    engine = FakeEngine()
    widget = SchedulerTimeline(FakeSession(engine), interval=3600)
    pushes = []
    widget.observe(lambda change: pushes.append([s["step"] for s in change["new"]]), "records")
    try:
        assert [s["step"] for s in widget.records] == [1, 2, 3] and widget.epoch == 1
        engine.step_records.extend([record(4), record(5)])
        assert widget.refresh() == 2
        assert pushes == [[4, 5]]
        assert widget.refresh() == 0 and pushes == [[4, 5]]  # nothing new: nothing sent
        assert "steps 1–5" in widget.summary() and "7.0 of 8 tokens" in widget.summary()
    finally:
        widget.close()


def test_a_new_engine_starts_over():
    session = FakeSession(FakeEngine(range(1, 6)))
    widget = SchedulerTimeline(session, interval=3600)
    try:
        session.engine = FakeEngine(range(1, 3))  # a reload: step ids start again
        assert widget.refresh() == 2
        assert widget.epoch == 2 and [s["step"] for s in widget.records] == [1, 2]
        session.engine = None
        session.require_engine = lambda: (_ for _ in ()).throw(ValueError("no model is loaded"))
        assert widget.refresh() == 0 and widget.engine_state == "no engine: no model is loaded"
    finally:
        widget.close()


def test_widget_state_round_trips_through_the_wire():
    widget = SchedulerTimeline(FakeEngine(), interval=3600)
    other = SchedulerTimeline(FakeEngine(range(0)), interval=3600)
    try:
        wire, paths, buffers = _remove_buffers(widget.get_state())
        assert paths == []  # plain JSON
        _put_buffers(wire, paths, buffers)
        other.set_state(wire)
        for name in ("records", "epoch", "max_columns", "engine_state"):
            assert getattr(other, name) == getattr(widget, name), name
    finally:
        widget.close()
        other.close()


def test_colours_are_shared_with_the_inspector():
    from test_jupyter_inspector import FakeSource

    colors: dict = {}
    inspector = CacheInspector(FakeSource(), colors=colors)  # requests "a" and "b"
    widget = SchedulerTimeline(FakeEngine(), colors=colors, interval=3600)
    try:
        by_id = {r["id"]: r["color"] for r in inspector.requests}
        assert {q["id"]: q["color"] for q in widget.records[0]["reqs"]} == by_id
    finally:
        inspector.close()
        widget.close()


def test_fallback_html_and_repr():
    widget = SchedulerTimeline(FakeEngine(), interval=3600)
    try:
        data = widget._repr_mimebundle_()[0]
        assert data["text/plain"].startswith("Scheduler timeline: steps 1–3")
        page = data["text/html"]
        assert page.count('title="step ') == 3 and "7/8 tokens" in page
        assert "no steps yet" in static_html([])
    finally:
        widget.close()


# -- the token view --------------------------------------------------------------------------

HOSTILE = ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", ' a"b', "\n"]


def hostile_output(n: int, finished: bool) -> RequestOutput:
    ids = list(range(n))
    logprobs = [{i: -0.5, (i + 1) % 4: -1.5, (i + 2) % 4: -2.5, (i + 3) % 4: -3.5} for i in ids]
    completion = CompletionOutput(0, "".join(HOSTILE[i] for i in ids), ids, logprobs=logprobs,
                                  finish_reason="length" if finished else None)  # fmt: skip
    return RequestOutput("g", "p", [1], [completion], finished=finished)


class HostileEngine:
    def add_request(self, prompt, params, request_id):
        return [hostile_output(2, False), hostile_output(4, True)]

    def abort(self, request_id) -> None:
        pass


def test_token_view_escapes_hostile_token_text():
    InteractiveShell.instance()
    gen = Generation("g", HostileEngine(), None, lambda: [1], format=TOKENS)
    gen.token_log = TokenLog(HOSTILE.__getitem__, 2)
    with capture_output() as out:
        LiveView.show(gen)
        gen.start()
        assert gen.wait(30)
    assert gen.state == DONE and [t.text for t in gen.tokens] == HOSTILE
    pages = [o.data["text/html"] for o in out.outputs if "text/html" in o.data and "vllm-mlx-tokens" in o.data["text/html"]]
    assert pages and pages[-1].count('class="vllm-mlx-tok"') == 4
    for page in pages:
        for tag in ("<img", "<script", 'a"b'):
            assert tag not in page, tag
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages[-1] and "&lt;script&gt;" in pages[-1]
    assert "\\n" in pages[-1]  # a newline alternative is shown, not lost


def test_token_info_top_k():
    log = TokenLog(str, 2)
    [first, *_] = log.update(hostile_output(4, True))
    assert (first.token_id, first.logprob) == (0, -0.5)
    assert [(a.token_id, a.logprob) for a in first.top] == [(0, -0.5), (1, -1.5)]
    assert math.isclose(first.prob, math.exp(-0.5))
    assert len(log.update(None)) == 4  # kept
    assert "vllm-mlx-alt-sampled" in token_html([first])


# -- in a real shell, on the tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def ip(tiny_model_dir):
    with loaded_shell(tiny_model_dir, {"num_kv_blocks": 64}) as shell:
        yield shell


def test_timeline_magic_returns_the_widget_and_sees_generations(ip):
    with capture_output():
        widget = ip.run_line_magic("vllm_mlx", "timeline")
        gen = ip.run_cell_magic("generate", "-n seen --max-tokens 6 --temperature 0 --wait", "Hello there")
    assert isinstance(widget, SchedulerTimeline) and gen.state == DONE
    assert widget is ip.run_line_magic("vllm_mlx", "timeline")  # one per session
    widget.refresh()
    steps = widget._history
    assert any(q["id"] == "seen" and q["prefill"] for s in steps for q in s["reqs"])
    assert sum(q["decode"] for s in steps for q in s["reqs"] if q["id"] == "seen") == 5


def test_logprobs_handle_keeps_the_tokens(ip):
    with capture_output():
        gen = ip.run_cell_magic("generate", "-n lp --logprobs 3 --max-tokens 8 --temperature 1 --seed 3 --wait", "Hi")
    assert gen.state == DONE, gen.error
    completion = gen.output.outputs[0]
    tokens = gen.tokens
    assert len(tokens) == len(completion.token_ids) > 0
    for token, token_id, entry in zip(tokens, completion.token_ids, completion.logprobs):
        assert token.token_id == token_id and token.logprob == entry[token_id]
        assert 1 <= len(token.top) <= 3 and all(0 < alt.prob <= 1 for alt in token.top)
        assert [a.logprob for a in token.top] == sorted((a.logprob for a in token.top), reverse=True)
    assert gen.params.logprobs == 3

"""``%%generate --over VAR`` (and ``generate_over``) in a real IPython shell, on the tiny llama.

What the engine did is read from its step records and stats (``engine.call``), never from the
handle alone. Every wait is bounded: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from vllm_mlx_jupyter import generate_over
from vllm_mlx_jupyter.session.generation import ABORTED, DONE
from vllm_mlx_jupyter.views.render import status_bundle
from notebook_shell import loaded_shell

TIMEOUT = 120.0
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ip(tiny_model_dir):
    with loaded_shell(tiny_model_dir, {"num_kv_blocks": 256, "max_num_seqs": 8}, max_tokens=8, temperature=0.0) as shell:
        yield shell


@pytest.fixture
def engine(ip):
    from vllm_mlx_jupyter import get_session

    return get_session(ip).engine


def cell(ip, line: str, body: str):
    with capture_output():
        return ip.run_cell_magic("generate", line, body)


def finished(handle):
    assert handle.wait(TIMEOUT), handle
    return handle


def last_step(engine) -> int:
    return engine.call(lambda core: core.step_records[-1].step_id if core.step_records else -1)


def records_since(engine, step: int) -> list:
    return engine.call(lambda core: [r for r in core.step_records if r.step_id > step])


def over_rows(record, name: str) -> set[int]:
    return {int(rid.split("/")[1]) for rid in record.request_ids if rid.startswith(name + "/")}


def test_results_keep_input_order_and_equal_solo_runs(ip):
    ip.user_ns["sentences"] = [f"Sentence number {i} is about {'cats' if i % 2 else 'the weather'}." for i in range(12)]
    handle = finished(cell(ip, "--over sentences -o classified --max-tokens 6", "Classify: {item}"))
    assert ip.user_ns["classified"] is handle and handle.state == DONE
    assert len(handle.results) == 12 and all(isinstance(t, str) and t for t in handle.results)
    assert handle.max_in_flight == 16  # default: twice the engine's max_num_seqs (8)
    p = handle.progress
    assert (p.total, p.done, p.failed, p.in_flight) == (12, 12, 0, 0) and p.tokens == sum(
        r.output_tokens for r in handle.row_results
    )
    for i in (0, 5, 11):  # batched = solo, so row i's text is its own prompt's answer
        solo = finished(cell(ip, "--max-tokens 6 --wait", f"Classify: {ip.user_ns['sentences'][i]}"))
        assert handle.results[i] == solo.text
    status = status_bundle(handle)["text/plain"]
    assert "12/12 rows" in status and " · done · " in status


def test_dataframe_rows_columns_and_parsed(ip):
    frame = pd.DataFrame({"name": ["Ada", "Bo", "Cy"], "city": ["Paris", "Oslo", "Lima"]})
    ip.user_ns["people"], ip.user_ns["verdict"] = frame, SCHEMA
    line = "--over people --schema verdict --compact-json --max-tokens 24"
    handle = finished(cell(ip, line, "Does {name} live in {city}?"))
    table = handle.results
    assert list(frame.columns) == ["name", "city"]  # the input is left alone
    assert list(table.columns) == ["name", "city", "output", "finish_reason", "prompt_tokens", "output_tokens",
                                   "parsed", "parse_error"]  # fmt: skip
    assert list(table["name"]) == ["Ada", "Bo", "Cy"]
    for i, row in table.iterrows():
        assert row.parsed == handle.parsed[i] and isinstance(row.parsed["ok"], bool), row.output
        assert row.output_tokens > 0 and row.prompt_tokens > 0 and row.finish_reason == "stop"
    assert handle.errors == {} and table.parse_error.isna().all()
    solo = finished(cell(ip, "--schema verdict --compact-json --max-tokens 24 --wait", "Does Bo live in Oslo?"))
    assert table.output[1] == solo.text  # row 1 was rendered from its own columns


def test_a_failing_row_is_reported_and_the_others_finish(ip):
    ip.user_ns["mixed"] = ["short one", "word " * 3000, "short two"]  # row 1 exceeds the 2048-token context
    handle = finished(cell(ip, "--over mixed", "{item}"))
    assert handle.state == DONE and set(handle.errors) == {1}
    assert handle.results[0] and handle.results[2] and handle.results[1] is None
    assert handle.progress.failed == 1 and handle.progress.done == 2
    assert "1 error" in status_bundle(handle)["text/plain"]


def test_cancel_then_resume_runs_only_the_remaining_rows(ip, engine):
    ip.user_ns["many"] = [f"Story {i}" for i in range(10)]
    line = "--over many -o stories --max-in-flight 2 --min-tokens 150 --max-tokens 150"
    first = cell(ip, line, "Tell {item}")
    deadline = time.monotonic() + TIMEOUT
    while first.progress.done < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.cancel()
    finished(first)
    kept = first.kept_results
    assert first.state == ABORTED and 2 <= len(kept) < 10
    step = last_step(engine)
    second = finished(cell(ip, line + " --resume", "Tell {item}"))
    assert second.state == DONE and second.name == first.name and second.progress.kept == len(kept)
    ran = set().union(*(over_rows(r, second.name) for r in records_since(engine, step)))
    assert ran == set(range(10)) - set(kept)  # the kept rows never went to the engine again
    assert all(second.row_results[i] == result for i, result in kept.items())
    assert all(len(r.text) > 0 for r in second.row_results)


def test_backpressure_bounds_the_engine_requests(ip, engine):
    ip.user_ns["rows"] = [f"Row {i}" for i in range(24)]
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            s = engine.get_stats()["scheduler"]
            seen.append(s["running"] + s["waiting"])
            time.sleep(0.005)

    step = last_step(engine)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        handle = finished(cell(ip, "--over rows --max-in-flight 3 --min-tokens 12 --max-tokens 12", "{item}"))
    finally:
        stop.set()
        poller.join(5)
    batches = [len(over_rows(r, handle.name)) for r in records_since(engine, step)]
    assert max(batches) == 3 and max(seen) <= 3 and handle.in_flight_peak == 3
    assert handle.progress.done == 24


def test_rows_share_batches_with_a_normal_cell(ip, engine):
    ip.user_ns["batch"] = [f"Item {i}" for i in range(6)]
    step = last_step(engine)
    handle = cell(ip, "--over batch --max-in-flight 2 --min-tokens 60 --max-tokens 60", "{item}")
    solo = cell(ip, "-n solo-beside --min-tokens 40 --max-tokens 40", "Hello")
    finished(handle), finished(solo)
    shared = [r for r in records_since(engine, step) if "solo-beside" in r.request_ids and over_rows(r, handle.name)]
    assert shared, "no step carried both the --over rows and the other cell"


def test_per_row_seeds_are_reproducible(ip):
    ip.user_ns["seeded"] = ["Pick a word", "Pick a word", "Pick a word", "Pick a number"]
    line = "--over seeded --temperature 1.0 --seed 7 --max-tokens 8"
    one_at_a_time = finished(cell(ip, line + " --max-in-flight 1", "{item}")).results
    all_at_once = finished(cell(ip, line + " --max-in-flight 4", "{item}")).results
    assert one_at_a_time == all_at_once
    assert len(set(one_at_a_time[:3])) > 1  # same prompt, seeds 7, 8, 9: different samples
    solo = finished(cell(ip, "--temperature 1.0 --seed 9 --max-tokens 8 --wait", "Pick a word"))
    assert one_at_a_time[2] == solo.text  # row i samples with seed + i


def test_python_function_and_refusals(ip):
    frame = pd.DataFrame({"text": ["good day", "bad day"]})
    with capture_output():
        handle = generate_over(frame, "Sentiment of: {text}", choice=["positive", "negative"], max_tokens=4, wait=True)
    assert handle.state == DONE and set(handle.results["output"]) <= {"positive", "negative"}
    assert "parsed" not in handle.results.columns  # a choice is its text
    with pytest.raises(UsageError, match="--chat cannot go with --over"):
        cell(ip, "--over seeded --chat c1", "{item}")
    ip.user_ns["not_rows"] = 42
    with pytest.raises(UsageError, match="a list"):
        cell(ip, "--over not_rows", "{item}")
    with pytest.raises(UsageError, match="no variable"):
        cell(ip, "--over missing_var", "{item}")
    with pytest.raises(UsageError, match="max_in_flight must be at least 1"):
        cell(ip, "--over seeded --max-in-flight 0", "{item}")
    with pytest.raises(UsageError, match="--resume"):
        cell(ip, "--over seeded --resume", "{item}")
    with pytest.raises(TypeError, match="unexpected option"):
        generate_over(["a"], "{item}", chat="c1")


def test_image_column_gives_each_row_its_image_and_a_bad_path_fails_alone(ip, tiny_qwen2_vl_dir, tmp_path):
    """Last in the module: it swaps the engine for a tiny Qwen2-VL."""
    from PIL import Image

    from vllm_mlx_jupyter import get_session

    paths = []
    for color in ("red", "blue"):
        paths.append(str(tmp_path / f"{color}.png"))
        Image.new("RGB", (64, 64), color).save(paths[-1])
    missing = str(tmp_path / "missing.png")
    ip.user_ns["pictures"] = [{"picture": paths[0], "q": "this"}, {"picture": missing, "q": "that"},
                              {"picture": paths[1], "q": "this"}]  # fmt: skip
    with capture_output():
        ip.run_line_magic("vllm_mlx", f"load {tiny_qwen2_vl_dir} --num-kv-blocks 256")
    handle = finished(cell(ip, "--over pictures --image picture --max-tokens 4", "What colour is {q}?"))
    assert set(handle.errors) == {1} and handle.results[0] is not None and handle.results[2] is not None
    entries = get_session(ip).engine.cache_snapshot()["mllm"]["entries"]
    assert len(entries) == 2  # two rows, two different images: each row had its own


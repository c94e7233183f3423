"""Per-step records (``EngineCore.step_records``) match what the scheduler did.

A scripted scenario on the tiny model: a prompt long enough to be prefilled in chunks, a second
prompt sharing its first blocks (a prefix-cache hit), then three requests too big for the KV
pool together (a preemption, then a resume).
"""

from __future__ import annotations

import pytest

from vllm_mlx import SamplingParams
from vllm_mlx.core.outputs import StepRecord
from vllm_mlx.engine.core import EngineCore

BUDGET = 8  # max_num_batched_tokens: a 20-token prompt takes three steps
PREFIX = list(range(100, 116))  # four blocks of 4 tokens


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 12 usable blocks of 4 tokens: three requests of 8 + 16 tokens cannot all stay.
    engine = EngineCore(model=str(tiny_model_dir), block_size=4, num_kv_blocks=13, max_num_batched_tokens=BUDGET)
    yield engine
    engine.shutdown()


def recorded_steps(engine: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> list[StepRecord]:
    """Run ``prompts`` to the end; return the records of the steps this took."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id)
    first = engine.scheduler.step_id
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return [r for r in engine.step_records if r.step_id > first]


def shares(records: list[StepRecord], request_id: str):
    return [(r, q) for r in records for q in r.requests if q.request_id == request_id]


def test_chunked_prefill_then_prefix_hit(engine):
    records = recorded_steps(engine, {"long": [*PREFIX, 200, 201, 202, 203]}, max_tokens=3)
    long = shares(records, "long")
    assert [q.num_prefill_tokens for _, q in long] == [8, 8, 4, 0, 0]  # chunks, then decodes
    assert [q.num_decode_tokens for _, q in long] == [0, 0, 0, 1, 1]
    assert [q.num_computed_tokens for _, q in long] == [0, 8, 16, 20, 21]
    assert records[0].admitted[0].request_id == "long" and records[0].prefix_hits == {}

    records = recorded_steps(engine, {"hit": [*PREFIX, 300, 301, 302, 303, 304, 305]}, max_tokens=2)
    assert records[0].prefix_hits == {"hit": 16} and records[0].resumed == []
    hit = shares(records, "hit")
    assert sum(q.num_prefill_tokens for _, q in hit) == 22 - 16
    assert hit[0][1].num_computed_tokens == 16


def test_preemption_and_resume(engine):
    prompts = {name: list(range(start, start + 8)) for name, start in (("c", 400), ("d", 500), ("e", 600))}
    records = recorded_steps(engine, prompts, max_tokens=16)
    preempted = [(r.step_id, rid) for r in records for rid in r.preempted]
    assert preempted, "the pool is too small for all three: someone must be preempted"
    for step_id, rid in preempted:
        resumes = [r for r in records if rid in r.resumed]
        assert resumes and resumes[0].step_id > step_id  # re-admitted later, recomputing
        assert all(rid not in r.request_ids for r in records if step_id <= r.step_id < resumes[0].step_id)
    for rid, prompt in prompts.items():
        steps = shares(records, rid)
        decodes = sum(q.num_decode_tokens for _, q in steps)
        prefills = sum(q.num_prefill_tokens for _, q in steps)
        if rid in {p for _, p in preempted}:
            assert prefills > len(prompt)  # the prompt and the output so far, again
        else:
            assert prefills == len(prompt) and decodes == 16 - 1  # the first token comes from the prefill
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_budget_time_and_order(engine):
    records = list(engine.step_records)
    assert records and [r.step_id for r in records] == sorted({r.step_id for r in records})
    for record in records:
        assert record.token_budget == BUDGET
        assert 0 < record.num_scheduled_tokens <= BUDGET
        assert record.num_scheduled_tokens == sum(q.num_prefill_tokens + q.num_decode_tokens for q in record.requests)
        assert record.request_ids == [q.request_id for q in record.requests]
        assert record.wall_time > 0 and record.num_forward_calls >= 1

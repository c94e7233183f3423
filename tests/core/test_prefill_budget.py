"""The prefill budget in cost units (vllm_mlx/core/sched/prefill_budget.py) on the scheduler, without a model:
the exact chunk sizes chosen at given context positions, the old policy at 0, and outputs that
match the sequential reference whatever the chunks."""

from __future__ import annotations

import math

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, reference_output, run_scheduler, step

from vllm_mlx.core.sched.prefill_budget import PrefillCost


def chunk_cost(n: int, p: int, attention_tokens: int) -> int:
    """The documented price, written out independently of ``PrefillCost``."""
    return n + math.floor(n * (p + n / 2) / attention_tokens)


def prefill_beside_a_stream(attention_tokens: int, steps: int) -> list[tuple[int, int]]:
    """A 7,400-token prompt arriving while a short request decodes, budget 512: the long prompt's
    (context position, chunk) in each of the next ``steps`` steps."""
    sched = make_scheduler(num_blocks=600, max_num_batched_tokens=512, prefill_attention_tokens=attention_tokens)
    runner = FakeRunner(sched.kv.coordinator)
    sched.add_request(make_request("stream", 10, max_tokens=500))
    step(sched, runner)  # the stream's prompt: from now on it decodes, one token a step
    sched.add_request(make_request("long", 7400, max_tokens=1))
    chunks = []
    for _ in range(steps):
        out, _ = step(sched, runner)
        rows = {s.request_id: s for s in out.scheduled}
        assert rows["stream"].num_new_tokens == 1  # the stream decodes in every step
        chunks.append((rows["long"].num_computed_tokens, rows["long"].num_new_tokens))
    return chunks


def test_prefill_chunks_shrink_as_the_context_grows():
    chunks = prefill_beside_a_stream(2048, 6)
    assert chunks == [(0, 460), (460, 388), (848, 341), (1189, 309), (1498, 284), (1782, 264)]
    for position, n in chunks:  # each is the longest chunk the 511 units left by the decode buy
        assert chunk_cost(n, position, 2048) <= 511 < chunk_cost(n + 1, position, 2048)


def test_deep_in_a_long_prompt_a_chunk_is_a_quarter_of_the_budget():
    cost = PrefillCost(2048)
    assert cost.fit(511, 7000, 400) == 115
    assert chunk_cost(115, 7000, 2048) <= 511 < chunk_cost(116, 7000, 2048)
    assert cost.fit(511, 7300, 100) == 100  # the rest of the prompt, when it fits


def test_zero_charges_tokens_only_as_before():
    assert prefill_beside_a_stream(0, 3) == [(0, 511), (511, 511), (1022, 511)]
    assert PrefillCost(0).fit(512, 7000, 7400) == 512


def test_a_prefill_always_moves_while_budget_is_left():
    assert PrefillCost(2048).fit(1, 7000, 400) == 1
    assert PrefillCost(2048).fit(0, 7000, 400) == 0


def test_without_chunked_prefill_a_prompt_costs_its_tokens():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64, enable_chunked_prefill=False,
                           prefill_attention_tokens=16)  # fmt: skip
    sched.add_request(make_request("whole", 60))
    out, _ = step(sched, FakeRunner(sched.kv.coordinator))
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("whole", 60)]


def test_short_contexts_cost_exactly_their_tokens():
    cost = PrefillCost(1024)
    assert cost.cost(8, 0) == 8 and cost.fit(8, 0, 20) == 8  # attention adds under a unit
    assert cost.cost(16, 100) == 17 and cost.fit(16, 100, 100) == 15


def test_negative_is_refused():
    with pytest.raises(ValueError, match="prefill_attention_tokens must be >= 0"):
        make_scheduler(prefill_attention_tokens=-1)


@pytest.mark.parametrize("attention_tokens", [1, 16, 2048])
def test_outputs_equal_the_sequential_reference_whatever_the_chunks(attention_tokens):
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                           prefill_attention_tokens=attention_tokens)  # fmt: skip
    requests = [make_request(f"r{i}", n, max_tokens=6) for i, n in enumerate((3, 40, 17, 60, 5))]
    for request in requests:
        sched.add_request(request)
    run_scheduler(sched, FakeRunner(sched.kv.coordinator))
    for request in requests:
        assert request.output_token_ids == reference_output(request, sched.max_model_len)[0]


def test_engine_config_checks_the_option():
    from vllm_mlx.engine.core import EngineConfig

    for bad in (-1, 1.5, True, "1024"):
        with pytest.raises(ValueError, match="prefill_attention_tokens must be an int >= 0"):
            EngineConfig(prefill_attention_tokens=bad).normalize()
    config = EngineConfig(prefill_attention_tokens=0)
    config.normalize()
    assert config.scheduler_config(64, None).prefill_attention_tokens == 0

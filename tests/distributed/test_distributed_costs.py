"""The tensor-parallel cost model (``step_traffic``, docs/distributed.md) against the real code:
the collectives a decode step of the engine issues through a sharded model, and those the step
message's broadcast issues, counted by wrapping ``mx.distributed.all_sum``.

One process suffices: over a 1-rank group mlx-lm's ``shard`` still puts ``all_sum``-ending
layers where the ranks would all-reduce, and each call gets the whole [tokens, hidden]
activation whatever the rank count (the ranks differ in the weights they hold, not in what they
hand the collective). A real 2-rank run then checks every step of a prefill and decodes on
rank 0, the padded forward calls of a prefill included."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from vllm_mlx.core.request import SamplingParams
from vllm_mlx.distributed.protocol import StepEncoder, broadcast_bytes
from vllm_mlx.distributed.traffic import step_traffic

BATCH = 3


@contextmanager
def counted_all_sums():
    """Record the bytes of every ``mx.distributed.all_sum`` input while inside."""
    import mlx.core as mx

    stock, calls = mx.distributed.all_sum, []

    def all_sum(x, *args, **kwargs):
        calls.append(x.nbytes)
        return stock(x, *args, **kwargs)

    mx.distributed.all_sum = all_sum
    try:
        yield calls
    finally:
        mx.distributed.all_sum = stock


@pytest.fixture
def sharded_engine(tiny_model_dir):
    """The ordinary engine on the tiny llama, its model sharded over a 1-rank group afterwards
    (numerically the same model), every step's message encoded as rank 0 would send it."""
    import mlx.core as mx

    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=str(tiny_model_dir), force_model_takeover=True, block_size=4, seed=0)
    group = mx.distributed.init(strict=False)
    assert group.size() == 1
    engine.runner.model.shard(group)
    encoder, messages, stock = StepEncoder(), [], engine.runner.execute_model

    def execute_model(scheduler_output):
        messages.append(encoder.encode(scheduler_output))
        return stock(scheduler_output)

    engine.runner.execute_model = execute_model
    try:
        yield engine, messages
    finally:
        engine.shutdown()


def test_a_decode_step_exchanges_what_the_cost_model_counts(tiny_model_dir, sharded_engine):
    import mlx.core as mx

    engine, messages = sharded_engine
    config = json.loads((tiny_model_dir / "config.json").read_text())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(f"prompt number {i} is a little longer", params, request_id=f"r{i}")
    while len(messages) < 3 or messages[-1].rows[0].num_new_tokens != 1:
        engine.step()  # until the step just run was a decode of every request
    with counted_all_sums() as calls:
        engine.step()
    decode = messages[-1]
    assert [r.num_new_tokens for r in decode.rows] == [1] * BATCH and not decode.new_requests
    data = decode.to_bytes()
    with counted_all_sums() as sent:
        broadcast_bytes(mx.distributed.init(strict=False), data)
    predicted = step_traffic(config, BATCH, len(data))
    assert len(calls) + len(sent) == predicted.collectives == 2 * config["num_hidden_layers"] + 2
    assert sum(calls) + sum(sent) == predicted.nbytes
    assert set(calls) == {BATCH * config["hidden_size"] * 4}  # float32 [B, 1, hidden] each
    assert sent == [4, len(data)]  # int32 length, then the payload


def test_ring_wire_bytes_and_predicted_seconds():
    traffic = step_traffic({"num_hidden_layers": 2, "hidden_size": 8}, 1, 28)
    assert (traffic.collectives, traffic.nbytes) == (6, 4 * 8 * 4 + 4 + 28)
    assert traffic.wire_bytes(2) == traffic.nbytes and traffic.wire_bytes(4) == 1.5 * traffic.nbytes
    assert traffic.seconds(1e-5, 1e9) == pytest.approx(6e-5 + 160e-9)


def test_two_ranks_hand_their_collectives_what_the_cost_model_counts(tiny_model_dir, tmp_path):
    """A real 2-rank run (tests/distributed/tp_driver.py's ``traffic`` scenario, the module's only
    launch): on rank 0 each step's all_sum calls and bytes equal ``step_traffic`` of its forward
    calls, padded tokens and real message size, for the prefill step of four prompts of different
    lengths and for the decode steps after it."""
    from rank_scenarios import TESTS, Scenario, launch_scenarios
    from tp_driver import TRAFFIC_PROMPTS

    config = json.loads((tiny_model_dir / "config.json").read_text())
    scenario = Scenario("traffic", "traffic", str(tiny_model_dir))
    launched = launch_scenarios(tmp_path, [scenario], TESTS / "tp_driver.py")
    steps = launched.results("traffic")[0]["steps"]  # (rank 1's result: it ran to rank 0's stop)
    prefill, decodes = steps[0], steps[1:]
    assert prefill["forward_calls"] == 2 and len(decodes) >= 5
    assert {d["padded_tokens"] for d in decodes} == {len(TRAFFIC_PROMPTS)}  # one row per request
    assert {d["forward_calls"] for d in decodes} == {1}
    for step in steps:
        predicted = step_traffic(config, step["padded_tokens"], step["message_bytes"], forward_calls=step["forward_calls"])
        print(f"{step['forward_calls']} calls, {step['padded_tokens']:4d} tokens, message {step['message_bytes']:4d} B: "
              f"{len(step['all_sum_bytes'])} all_sums, {sum(step['all_sum_bytes'])} B, "
              f"{step['collective_seconds'] * 1e3:.1f} ms in collectives")  # fmt: skip
        assert len(step["all_sum_bytes"]) == predicted.collectives
        assert sum(step["all_sum_bytes"]) == pytest.approx(predicted.nbytes, rel=0.2)
        assert sum(step["all_sum_bytes"]) == predicted.nbytes  # (exactly, in fact)

"""Tensor parallelism (vllm_mlx/distributed/: protocol.py, sharding.py, worker.py): the step
protocol is plain data, models that cannot be split are refused, and two ranks on 127.0.0.1 (ring
backend) produce the greedy tokens of the single-process engine through chunked prefill,
prefix-cache hits and preemption, for a llama and for gpt_oss (sliding windows, attention sinks,
experts)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from rank_scenarios import TESTS, LaunchedScenarios, Scenario, launch_scenarios
from repeating_models import LIKELY
from tiny_model import TINY_GPT_OSS, build_tiny_llama

from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
from vllm_mlx.core.request import Request, RequestStatus, SamplingParams
from vllm_mlx.distributed.group import TensorParallelError
from vllm_mlx.distributed.protocol import NewRequest, StepEncoder, StepMessage, StepRow, row_tables, sampling_dict
from vllm_mlx.distributed.sharding import check_shardable



def test_step_message_round_trips_as_json():
    message = StepMessage(
        "step", 7,
        new_requests=[NewRequest("a", [1, 2, 3], sampling_dict(SamplingParams(temperature=0, seed=5)), [2])],
        rows=[StepRow("a", 0, 3, [1, 2], [], block_tables=[[1, 2], [3]])],
        finished=["b"],
    )  # fmt: skip
    data = message.to_bytes()
    assert json.loads(data)["rows"][0]["block_tables"] == [[1, 2], [3]]  # plain JSON, nothing pickled
    assert StepMessage.from_bytes(data) == message
    assert SamplingParams(**message.new_requests[0].sampling).seed == 5


def test_encoder_sends_prompts_once_then_only_new_output_tokens():
    encoder = StepEncoder()
    request = Request("r", [5, 6, 7], SamplingParams(seed=1))
    first = encoder.encode(SchedulerOutput(1, [ScheduledRequest(request, 0, 3, [1])]))
    assert [n.prompt_token_ids for n in first.new_requests] == [[5, 6, 7]]
    request.append_output_token(9)
    second = encoder.encode(SchedulerOutput(2, [ScheduledRequest(request, 3, 1, [1])]))
    assert not second.new_requests and second.rows[0].new_output_token_ids == [9]
    request.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert encoder.encode(SchedulerOutput(3)).finished == ["r"]


def _tables_on_a_worker(steps: list[list[ScheduledRequest]]) -> list[list[StepRow]]:
    """Encode ``steps`` as rank 0 does, send them through JSON and rebuild every row's tables as
    a worker does; assert they are the scheduled ones. Returns the rows sent."""
    encoder, held, sent = StepEncoder(), {}, []
    for step_id, scheduled in enumerate(steps):
        message = StepMessage.from_bytes(encoder.encode(SchedulerOutput(step_id, scheduled)).to_bytes())
        for item, row in zip(scheduled, message.rows):
            held[row.request_id] = row_tables(row, held.get(row.request_id))
            assert held[row.request_id] == (item.block_tables or [item.block_ids])
        sent.append(message.rows)
    return sent


def test_rows_send_only_the_block_ids_appended_since_the_last_row():
    request = Request("r", [5, 6, 7, 8, 9, 10], SamplingParams())
    preempted = [5, 6, 7]  # re-admitted after a preemption: a new table
    first, same, grown, readmitted, next_one = _tables_on_a_worker([
        [ScheduledRequest(request, 0, 6, [3, 4])],
        [ScheduledRequest(request, 6, 1, [3, 4])],  # a decode inside block 4
        [ScheduledRequest(request, 7, 2, [3, 4, 9])],  # crosses into a new block
        [ScheduledRequest(request, 0, 9, preempted)],
        [ScheduledRequest(request, 9, 1, [*preempted, 11])],
    ])  # fmt: skip
    assert [(r[0].block_ids, r[0].whole_tables) for r in (first, same, grown, readmitted, next_one)] == [
        ([3, 4], True), ([], False), ([9], False), (preempted, True), ([11], False),
    ]  # fmt: skip


def test_sliding_window_tables_go_whole_when_blocks_leave_the_window():
    request = Request("r", list(range(12)), SamplingParams())
    rows = _tables_on_a_worker([
        [ScheduledRequest(request, 0, 8, [1, 2], block_tables=[[1, 2], [3, 4]])],
        [ScheduledRequest(request, 8, 4, [1, 2, 5], block_tables=[[1, 2, 5], [3, 4, 6]])],
        [ScheduledRequest(request, 12, 1, [1, 2, 5], block_tables=[[1, 2, 5], [0, 4, 6]])],  # block 3 left
        [ScheduledRequest(request, 13, 4, [1, 2, 5, 7], block_tables=[[1, 2, 5, 7], [0, 4, 6, 8]])],
    ])  # fmt: skip
    assert [(r[0].block_tables, r[0].whole_tables) for r in rows] == [
        ([[1, 2], [3, 4]], True), ([[5], [6]], False), ([[1, 2, 5], [0, 4, 6]], True), ([[7], [8]], False),
    ]  # fmt: skip


def test_a_decode_step_inside_blocks_sends_no_block_ids():
    """B = 32 requests with 511-token prompts (block size 16: 32-block tables), then a decode
    step that stays inside their last blocks: its rows carry no block ids at all."""
    batch, blocks = 32, 32
    requests = [Request(f"req-{i}", list(range(1000, 1511)), SamplingParams(seed=i)) for i in range(batch)]
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(batch)]
    encoder = StepEncoder()
    encoder.encode(SchedulerOutput(1, [ScheduledRequest(r, 0, 511, t) for r, t in zip(requests, tables)]))
    for request in requests:
        request.append_output_token(31337)
    decode = encoder.encode(SchedulerOutput(2, [ScheduledRequest(r, 511, 1, t) for r, t in zip(requests, tables)]))
    assert all(row.block_ids == [] and not row.whole_tables for row in decode.rows)
    whole = dataclasses.replace(decode, rows=[
        dataclasses.replace(row, block_ids=table, whole_tables=True) for row, table in zip(decode.rows, tables)
    ])  # fmt: skip  (the message as it was before deltas: every table whole)
    before, after = len(whole.to_bytes()), len(decode.to_bytes())
    print(f"decode step message, B={batch}, 32-block tables: {before} B with whole tables, {after} B with deltas")
    assert before - after > 2 * batch * blocks  # at least a digit and a comma per block id (here 36 %)


class _Shardable:
    def shard(self, group):  # pragma: no cover - never called by the checks
        raise AssertionError


def test_kv_heads_that_do_not_divide_are_refused():
    config = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3}
    with pytest.raises(TensorParallelError, match=r"2 ranks.*3 KV heads \(num_key_value_heads=3\)"):
        check_shardable(_Shardable(), config, 2)
    check_shardable(_Shardable(), {**config, "num_attention_heads": 6, "num_key_value_heads": 2}, 2)


def test_architectures_without_shard_are_refused():
    with pytest.raises(TensorParallelError, match="'lfm2' has no shard"):
        check_shardable(object(), {"model_type": "lfm2", "num_attention_heads": 4}, 2)


def test_engine_outside_a_launch_says_how_to_launch():
    from vllm_mlx.engine.core import EngineCore

    with pytest.raises(TensorParallelError, match="mlx.launch -n 2"):
        EngineCore(model="unused: refused before loading", tensor_parallel=True)


@dataclass
class TPArch:
    """An architecture of the 2-rank test: ``build_tiny_llama`` overrides (4 heads, 2 KV heads
    each) and the block groups its KV cache has."""

    overrides: dict
    block_groups: int


# gpt_oss differs from llama where sharding could go wrong: sliding-window layers (two block
# groups: ``block_tables`` in every row, blocks leaving the window), attention sinks sliced per
# rank, and a mixture of experts whose down projection's bias is split over the ranks.
TP_ARCHS = {"llama": TPArch({}, 1), "gpt_oss": TPArch(TINY_GPT_OSS, 2)}


@pytest.fixture(scope="module")
def tp_models(tiny_model_dir, default_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The model directory of each of ``TP_ARCHS``."""
    return {
        name: build_tiny_llama(tmp_path_factory.mktemp(name), default_model_dir, **arch.overrides)
        if arch.overrides else tiny_model_dir
        for name, arch in TP_ARCHS.items()
    }  # fmt: skip


@pytest.fixture(scope="module", params=list(TP_ARCHS))
def tp_arch(request, tp_models) -> tuple[str, Path, TPArch]:
    """(name, model directory, architecture) of each of ``TP_ARCHS``."""
    return request.param, tp_models[request.param], TP_ARCHS[request.param]


def corrupted_copy(model_dir: Path, other: Path) -> Path:
    """A copy of ``model_dir`` whose weight file differs in one byte of its last MiB (same size,
    same header, same config)."""
    import shutil

    shutil.copytree(model_dir, other)
    with (other / "model.safetensors").open("r+b") as f:
        f.seek(-3, 2)
        last = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([last[0] ^ 0x40]))
    return other


@pytest.fixture(scope="module")
def tp_launch(tp_models, tiny_model_dir, default_model_dir, tmp_path_factory) -> LaunchedScenarios:
    """The module's 2-rank scenarios (tp_driver.py's), on one launch: each of ``TP_ARCHS``, a
    request that fails on every rank, then the refusals (last: see rank_scenarios.py), a model
    of 3 KV heads and a rank 1 given a corrupted copy of the model."""
    root = tmp_path_factory.mktemp("tp-launch")
    kv3 = build_tiny_llama(
        root / "kv3", default_model_dir, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    corrupted = corrupted_copy(tiny_model_dir, root / "corrupted")
    repeating = build_tiny_llama(root / "repeating", default_model_dir, likely_tokens=LIKELY)  # lookup finds text
    scenarios = [
        *(Scenario(name, "batch", str(model_dir)) for name, model_dir in tp_models.items()),
        Scenario("poison", "poison", str(tiny_model_dir)),
        Scenario("spec", "spec", str(repeating)),
        Scenario("kv3", "batch", str(kv3)),
        Scenario("other_model", "batch", str(tiny_model_dir), other_model=str(corrupted)),
    ]  # fmt: skip
    return launch_scenarios(root / "out", scenarios, TESTS / "tp_driver.py")


_SINGLE_PROCESS: dict[Path, dict] = {}


def single_process(model_dir: Path) -> dict:
    """The driver's workload on the ordinary engine (computed once per model directory)."""
    import mlx.core as mx

    from tp_driver import ENGINE_OPTIONS, run_batch
    from vllm_mlx.engine.core import EngineCore

    if not mx.distributed.is_available():
        pytest.skip("mlx has no distributed backend")
    if model_dir not in _SINGLE_PROCESS:
        assert json.loads((model_dir / "config.json").read_text())["num_key_value_heads"] == 2
        engine = EngineCore(model=str(model_dir), force_model_takeover=True, **ENGINE_OPTIONS)
        try:
            _SINGLE_PROCESS[model_dir] = run_batch(engine)
        finally:
            engine.shutdown()
    return _SINGLE_PROCESS[model_dir]


def test_two_ranks_on_loopback_equal_the_single_process_engine(tp_arch, tp_launch):
    name, model_dir, arch = tp_arch
    expected = single_process(model_dir)
    rank0, rank1 = tp_launch.results(name)
    assert rank0["tokens"] == expected["tokens"]
    assert rank0["kv_heads"] == 1  # each rank holds half of the 2 KV heads
    assert rank0["block_groups"] == expected["block_groups"] == arch.block_groups
    assert rank0["preemptions"] > 0 and rank0["prefix_hits"] > 0 and rank0["chunks"] > 0
    for what in ("preemptions", "prefix_hits", "chunks"):  # rank 0 scheduled as one process does
        assert rank0[what] == expected[what], what
    # The worker ran every step, failed none, and sampled the same greedy tokens as rank 0.
    assert rank1["steps"] > 0 and rank1["errors"] == 0
    assert rank1["compared"] > 0 and rank1["mismatches"] == 0
    assert rank0["errors"] == [None] * len(expected["tokens"])


def test_a_request_that_fails_on_every_rank_fails_alone(tiny_model_dir, tp_launch):
    """Steps holding request p3 raise on both ranks: rank 0 re-runs them request by request (and
    probes when p3 ran alone), sending each re-run; the others' tokens are unchanged."""
    from tp_driver import POISON

    rank0, rank1 = tp_launch.results("poison")
    poisoned = int(POISON[1:])
    assert "ValueError" in rank0["errors"][poisoned]  # (the message to callers hides the details)
    others = [i for i in range(len(rank0["tokens"])) if i != poisoned]
    expected = single_process(tiny_model_dir)["tokens"]
    assert [rank0["tokens"][i] for i in others] == [expected[i] for i in others]
    assert rank1["errors"] > 0 and rank1["mismatches"] == 0


def test_speculation_over_two_ranks_equals_the_single_process_engine(tp_launch):
    """n-gram proposals made on rank 0 travel in the step rows; every rank verifies them in the
    same forward, and the worker's samples (after the proposals it kept) are rank 0's."""
    rank0, rank1 = tp_launch.results("spec")
    expected = single_process(Path(tp_launch.scenarios["spec"].model))["tokens"]
    assert rank0["tokens"] == expected  # greedy: as without speculation
    assert rank0["proposed"] > 0 and rank0["accepted"] > 0
    assert rank1["steps"] > 0 and rank1["errors"] == 0
    assert rank1["compared"] > 0 and rank1["mismatches"] == 0


def test_two_ranks_refuse_kv_heads_that_do_not_divide(tp_launch):
    """Both ranks check before sharding and fail alike (no rank is left waiting for the other)."""
    for refusal in tp_launch.refusals("kv3"):  # every rank raised, with this message
        assert "2 ranks needs heads that divide evenly: the model has 3 KV heads" in refusal
    assert not tp_launch.result_files("kv3")


def test_ranks_with_a_differing_weight_file_are_refused_on_both(tiny_model_dir, tp_launch):
    """Rank 1 loads a copy whose weight file differs in one byte of its last MiB (same size,
    same header, same config): both ranks refuse at start-up, naming rank 1, and neither waits."""
    other = tp_launch.scenarios["other_model"].other_model
    for rank, text in enumerate(tp_launch.refusals("other_model")):
        assert "the ranks loaded different models: rank(s) 1 differ from rank 0" in text
        assert str(other if rank else tiny_model_dir) in text
    assert not tp_launch.result_files("other_model")

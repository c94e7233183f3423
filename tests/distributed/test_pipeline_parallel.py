"""Pipeline parallelism (vllm_mlx/distributed/pipeline.py): the split is mlx-lm's, models that cannot
be split into stages are refused on every rank, and two ranks on 127.0.0.1 (ring backend), each
holding half of a tiny Qwen3.5 hybrid's layers, produce the greedy tokens of the single-process
engine through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from rank_scenarios import TESTS, LaunchedScenarios, Scenario, launch_scenarios

from vllm_mlx.core.kv.spec import FullAttentionSpec, RecurrentStateSpec
from vllm_mlx.distributed.pipeline import PipelineParallelError, StageRange, check_stages_alike, layer_split
from vllm_mlx.distributed.group import TensorParallelError

FULL, LINEAR = FullAttentionSpec(), RecurrentStateSpec(2, pads=True)


def test_the_split_is_mlx_lms_rank_0_holds_the_last_layers():
    assert layer_split(4, 2) == [StageRange(0, 2, 4), StageRange(1, 0, 2)]
    assert layer_split(5, 2) == [StageRange(0, 2, 5), StageRange(1, 0, 2)]  # low ranks take the extra
    assert [s.num_layers for s in layer_split(7, 3)] == [3, 2, 2]


def test_stages_with_different_kinds_of_layers_are_refused():
    check_stages_alike([LINEAR, FULL, LINEAR, FULL], layer_split(4, 2))
    with pytest.raises(PipelineParallelError, match=r"rank 1's layers 0..1 need caches \[RecurrentStateSpec\]"):
        check_stages_alike([LINEAR, LINEAR, LINEAR, FULL], layer_split(4, 2))


def test_tensor_and_pipeline_parallel_are_exclusive():
    from vllm_mlx.engine.core import EngineConfig

    with pytest.raises(ValueError, match="exclusive"):
        EngineConfig(tensor_parallel=True, pipeline_parallel=True).normalize()
    assert issubclass(PipelineParallelError, TensorParallelError)


@pytest.fixture(scope="module")
def pp_launch(tiny_qwen3_5_dir, tiny_model_dir, default_model_dir, tmp_path_factory) -> LaunchedScenarios:
    """The module's 2-rank scenarios (pp_driver.py's), on one launch: two stages of the tiny
    Qwen3.5, its pools sized for a rank with little memory, then (last: a refusal, see
    rank_scenarios.py) the tiny llama, which has no pipeline()."""
    from repeating_models import LIKELY
    from tiny_model import TINY_QWEN3_5, build_tiny_llama

    repeating = build_tiny_llama(tmp_path_factory.mktemp("repeating-qwen3_5"), default_model_dir,
                                 likely_tokens=LIKELY, **TINY_QWEN3_5)  # fmt: skip
    scenarios = [
        Scenario("stages", "stages", str(tiny_qwen3_5_dir)),
        Scenario("spec", "spec", str(repeating)),
        Scenario("memory", "memory", str(tiny_qwen3_5_dir)),
        Scenario("no_pipeline", "stages", str(tiny_model_dir)),
    ]
    return launch_scenarios(tmp_path_factory.mktemp("pp-launch"), scenarios, TESTS / "pp_driver.py")


def test_two_stages_on_loopback_equal_the_single_process_engine(tiny_qwen3_5_dir, pp_launch):
    from pp_driver import ENGINE_OPTIONS, pool_layers
    from tp_driver import run_batch
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=str(tiny_qwen3_5_dir), force_model_takeover=True, **ENGINE_OPTIONS)
    try:
        expected = {**run_batch(engine), **pool_layers(engine.runner)}
    finally:
        engine.shutdown()
    assert expected["kv_layers"] == 2 and expected["state_layers"] == 2  # the whole model

    rank0, rank1 = pp_launch.results("stages")
    assert rank0["tokens"] == expected["tokens"]
    assert rank0["preemptions"] > 0 and rank0["prefix_hits"] > 0 and rank0["chunks"] > 0
    for what in ("preemptions", "prefix_hits", "chunks"):  # rank 0 scheduled as one process does
        assert rank0[what] == expected[what], what
    # Each stage's pools hold its own layers only: one attention and one delta-net layer each.
    assert (rank0["kv_layers"], rank0["state_layers"]) == (1, 1)
    assert (rank1["kv_layers"], rank1["state_layers"]) == (1, 1)
    # The worker ran every step, failed none, and sampled rank 0's greedy tokens (same logits).
    assert rank1["steps"] > 0 and rank1["errors"] == 0
    assert rank1["compared"] > 0 and rank1["mismatches"] == 0


def test_speculation_over_two_stages_equals_the_engine_without_it(pp_launch):
    """The hybrid's stages verify rank 0's proposals; a row that rejects one keeps its recurrent
    state as before the step on both stages (else the next tokens would differ)."""
    from pp_driver import ENGINE_OPTIONS
    from tp_driver import run_batch
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=pp_launch.scenarios["spec"].model, force_model_takeover=True, **ENGINE_OPTIONS)
    try:
        plain = run_batch(engine)
    finally:
        engine.shutdown()
    rank0, rank1 = pp_launch.results("spec")
    assert rank0["tokens"] == plain["tokens"] and rank0["proposed"] > 0 and rank0["accepted"] > 0
    assert rank0["proposed"] > rank0["accepted"]  # some were rejected: the rollback ran
    assert rank1["errors"] == 0 and rank1["compared"] > 0 and rank1["mismatches"] == 0


def test_rank_0_sizes_the_pools_for_the_rank_with_the_least_memory(pp_launch):
    """Every rank allocates the block and state-slot counts rank 0 chose, so rank 0 sizes them
    from the most any rank's layers need and the least memory any rank has: rank 1 claims 64 MiB
    available, and rank 0's pool is what half of that holds."""
    from pp_driver import SMALL_MEMORY

    from vllm_mlx.core.kv.sizing import StateBudget
    from vllm_mlx.core.kv.spec import blocks_for_bytes
    from vllm_mlx.engine.core import EngineConfig

    rank0, rank1 = pp_launch.results("memory")
    # The collective itself: the largest costs, the smallest memory, the same on both ranks.
    expected = {"kv_bytes_per_token": 101, "state_bytes_per_request": 7, "available_bytes": 4999}
    assert rank0["combined"] == rank1["combined"] == expected
    # The engine's sizing (the two stages' layers cost the same here: rank 0's figures are the largest).
    states = StateBudget.plan(EngineConfig(), int(0.5 * SMALL_MEMORY), rank0["state_bytes_per_request"])
    assert rank0["num_state_slots"] == states.num_slots
    assert rank0["num_blocks"] == blocks_for_bytes(states.kv_bytes_left, 4, rank0["kv_bytes_per_token"])
    assert rank1["steps"] == 0 and rank1["errors"] == 0


def test_an_architecture_without_pipeline_is_refused_on_both_ranks(pp_launch):
    """The tiny llama: mlx-lm's llama has no pipeline(). Both ranks refuse before splitting."""
    for refusal in pp_launch.refusals("no_pipeline"):
        assert "'llama' has no pipeline()" in refusal
    assert not pp_launch.result_files("no_pipeline")


def test_serve_flags_choose_the_split():
    from vllm_mlx.entrypoints import cli
    from vllm_mlx.entrypoints.distributed_serve import is_pipeline

    parse = cli.build_parser().parse_args
    assert is_pipeline(parse(["serve", "m", "--pipeline-parallel-size", "2"]))
    assert is_pipeline(parse(["serve", "m", "--distributed", "--pipeline-parallel"]))
    assert not is_pipeline(parse(["serve", "m", "--distributed", "--tensor-parallel-size", "2"]))
    with pytest.raises(TensorParallelError, match="exclusive"):
        is_pipeline(parse(["serve", "m", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"]))


def test_more_ranks_than_layers_are_refused_before_any_rank_starts(tiny_model_dir, capsys):
    from vllm_mlx.entrypoints import cli

    assert cli.main(["serve", str(tiny_model_dir), "--pipeline-parallel-size", "3"]) == 1
    err = capsys.readouterr().err
    assert "pipeline parallelism over 3 ranks needs at least one layer per rank; the model has 2 layers" in err
    assert "started" not in err

"""The pipeline-parallel tests' ranks: the scenarios each rank runs (``SCENARIOS``), all of a test
module on one launch (``rank_scenarios.launch_scenarios``; ``python tests/distributed/pp_driver.py
OUT_DIR`` under ``mlx.launch -n 2``):

- ``stages``: rank 0 runs ``tp_driver.run_batch`` (the tensor-parallel tests' workload) on
  ``EngineCore(pipeline_parallel=True)``, rank 1 ``worker_loop(..., pipeline_parallel=True)``
  (its ``WorkerStats``); both report the layers their pools hold. A model without pipeline
  support is refused there, on both ranks;
- ``spec``: ``stages`` with n-gram speculation (``tp_driver.SPECULATION``), and its proposed
  and accepted token counts;
- ``memory``: ``size_with_a_small_rank_1``."""

from __future__ import annotations

import dataclasses

from rank_scenarios import Scenario, run_scenarios
from tp_driver import SPECULATION, run_batch, speculation_counts

# 13 blocks of 4 tokens cannot hold every request (preemption); 8 tokens a step (chunks).
ENGINE_OPTIONS = {"block_size": 4, "num_kv_blocks": 13, "max_num_batched_tokens": 8, "seed": 0}


def pool_layers(runner) -> dict:
    """The layers this rank's pools hold, named as ``WorkerStats`` names them."""
    from vllm_mlx.distributed.worker import held_layers

    return dict(zip(("kv_layers", "state_layers"), held_layers(runner)))


def stages(group, scenario: Scenario, options: dict | None = None) -> dict:
    from vllm_mlx.engine.core import EngineCore
    from vllm_mlx.engine.rank_worker import worker_loop

    if group.rank() > 0:
        return dataclasses.asdict(worker_loop(scenario.model, group=group, pipeline_parallel=True))
    options = {**ENGINE_OPTIONS, **(options or {})}
    engine = EngineCore(model=scenario.model, pipeline_parallel=True, force_model_takeover=True, **options)
    try:
        return {**run_batch(engine), **pool_layers(engine.runner), **speculation_counts(engine)}
    finally:
        engine.shutdown()  # sends "stop": the workers return


def spec(group, scenario: Scenario) -> dict:
    return stages(group, scenario, SPECULATION)


SMALL_MEMORY = 64 << 20  # what rank 1 claims to have available in the "memory" scenario


def size_with_a_small_rank_1(group, scenario: Scenario) -> dict:
    """Rank 1 reports ``SMALL_MEMORY`` available; rank 0 sizes its pools from a fraction of the
    memory available, with no block count given. Both first combine made-up needs directly."""
    from vllm_mlx.core.kv.sizing import MemoryNeeds
    from vllm_mlx.distributed.group import combine_memory_needs
    from vllm_mlx.engine import core as engine_core
    from vllm_mlx.engine.rank_worker import worker_loop

    rank, model_dir = group.rank(), scenario.model
    combined = combine_memory_needs(group, MemoryNeeds(100 + rank, 7 - rank, 5000 - rank))
    result = {"combined": dataclasses.asdict(combined)}
    if rank > 0:
        stock, engine_core.available_memory = engine_core.available_memory, lambda: SMALL_MEMORY
        try:
            return result | dataclasses.asdict(worker_loop(model_dir, group=group, pipeline_parallel=True))
        finally:
            engine_core.available_memory = stock  # for the scenarios after this one
    engine = engine_core.EngineCore(model=model_dir, pipeline_parallel=True, force_model_takeover=True,
                                    kv_cache_memory=0.5, block_size=4, seed=0)  # fmt: skip
    try:
        runner = engine.runner
        return result | {
            "num_blocks": engine.kv_cache.num_blocks,
            "num_state_slots": runner.state_pool.num_slots,
            "kv_bytes_per_token": engine.kv_layout.bytes_per_block_token(runner.block_groups),
            "state_bytes_per_request": runner.state_pool.layout.bytes_per_request,
        }
    finally:
        engine.shutdown()


SCENARIOS = {"stages": stages, "spec": spec, "memory": size_with_a_small_rank_1}

if __name__ == "__main__":
    run_scenarios(SCENARIOS)

"""The pipeline-parallel test's ranks: ``python tests/distributed/pp_driver.py MODEL_DIR OUT_PREFIX [MODE]``
under ``mlx.launch -n 2``. Rank 0 runs ``tp_driver.run_batch`` (the tensor-parallel test's
workload) on ``EngineCore(pipeline_parallel=True)`` and writes ``OUT_PREFIX.rank0.json``; rank 1
runs ``worker_loop(..., pipeline_parallel=True)`` and writes its ``WorkerStats``. Both write what
their pools hold. MODE ``memory``: ``size_with_a_small_rank_1`` instead. A rank refused at
start-up (``TensorParallelError``) writes the error to ``OUT_PREFIX.rankN.refused`` and exits 0,
so the launcher does not end the other rank first."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from tp_driver import run_batch

# 13 blocks of 4 tokens cannot hold every request (preemption); 8 tokens a step (chunks).
ENGINE_OPTIONS = {"block_size": 4, "num_kv_blocks": 13, "max_num_batched_tokens": 8, "seed": 0}


def pool_layers(runner) -> dict:
    """The layers this rank's pools hold, named as ``WorkerStats`` names them."""
    from vllm_mlx.distributed.worker import held_layers

    return dict(zip(("kv_layers", "state_layers"), held_layers(runner)))


def main(model_dir: str, out_prefix: str, mode: str = "") -> None:
    from vllm_mlx.distributed.group import TensorParallelError, init_group
    from vllm_mlx.engine.rank_worker import worker_loop

    group = init_group()
    try:
        if mode == "memory":
            result = size_with_a_small_rank_1(model_dir, group)
        elif group.rank() == 0:
            result = run_engine(model_dir)
        else:
            result = dataclasses.asdict(worker_loop(model_dir, group=group, pipeline_parallel=True))
    except TensorParallelError as exc:
        Path(f"{out_prefix}.rank{group.rank()}.refused").write_text(str(exc))
        return
    Path(f"{out_prefix}.rank{group.rank()}.json").write_text(json.dumps(result))


def run_engine(model_dir: str) -> dict:
    from vllm_mlx.engine.core import EngineCore

    engine = EngineCore(model=model_dir, pipeline_parallel=True, force_model_takeover=True, **ENGINE_OPTIONS)
    try:
        return {**run_batch(engine), **pool_layers(engine.runner)}
    finally:
        engine.shutdown()  # sends "stop": the workers return


SMALL_MEMORY = 64 << 20  # what rank 1 claims to have available in the "memory" mode


def size_with_a_small_rank_1(model_dir: str, group) -> dict:
    """Rank 1 reports ``SMALL_MEMORY`` available; rank 0 sizes its pools from a fraction of the
    memory available, with no block count given. Both first combine made-up needs directly."""
    from vllm_mlx.core.kv.sizing import MemoryNeeds
    from vllm_mlx.distributed.group import combine_memory_needs
    from vllm_mlx.engine import core as engine_core
    from vllm_mlx.engine.rank_worker import worker_loop

    rank = group.rank()
    combined = combine_memory_needs(group, MemoryNeeds(100 + rank, 7 - rank, 5000 - rank))
    result = {"combined": dataclasses.asdict(combined)}
    if rank > 0:
        engine_core.available_memory = lambda: SMALL_MEMORY
        return result | dataclasses.asdict(worker_loop(model_dir, group=group, pipeline_parallel=True))
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


if __name__ == "__main__":
    main(*sys.argv[1:4])

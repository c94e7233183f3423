"""A rank > 0 of a tensor- or pipeline-parallel engine: ``worker_loop`` prepares the model as rank 0
does (``prepare_engine_model``), then runs ``distributed.worker.Worker`` on rank 0's steps.

It sits above the engine it mirrors (it builds an ``EngineConfig`` and prepares the model with
the engine's own code), while the step protocol it speaks (``distributed/``) sits below: so the
engine can send steps without importing its workers.
"""

from __future__ import annotations

from vllm_mlx.config import EngineConfig
from vllm_mlx.distributed.group import TensorParallelError, init_group
from vllm_mlx.distributed.liveness import LivenessAddress, connect_to_rank_zero
from vllm_mlx.distributed.protocol import receive_message
from vllm_mlx.distributed.watchdog import DEFAULT_STARTUP_TIMEOUT_S, STARTUP, startup_deadline
from vllm_mlx.distributed.worker import Worker, WorkerStats
from vllm_mlx.engine.core import prepare_engine_model
from vllm_mlx.executor.model_runner import MLXModelRunner


def worker_loop(
    model: str,
    *,
    weight_format: str = "auto",
    trust_remote_code: bool = False,
    group=None,
    pipeline_parallel: bool = False,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> WorkerStats:
    """Run a rank > 0 until rank 0's engine shuts down; returns what it ran.

    ``model``, ``weight_format``, ``trust_remote_code`` and ``pipeline_parallel`` (stages of
    layers instead of shards: ``distributed/pipeline.py``) must be rank 0's (the model and the
    split mode are checked at start-up, on every rank); the KV pool's
    sizing comes from rank 0's start message. It prepares the model as rank 0 does
    (``prepare_engine_model``), then builds the runner: the same collectives in the same order.
    When start-up (up to rank 0's start message) outlives ``startup_timeout_s``, the process
    exits (``rank_watchdog.startup_deadline``)."""
    group = group or init_group()
    if group.rank() == 0:
        raise TensorParallelError("rank 0 runs the engine (EngineCore(tensor_parallel=True)), not worker_loop")
    config = EngineConfig(
        model=model, weight_format=weight_format, trust_remote_code=trust_remote_code,
        pipeline_parallel=pipeline_parallel,
    )  # fmt: skip
    with startup_deadline(group, startup_timeout_s, STARTUP):
        prepared = prepare_engine_model(config, group)
        start = receive_message(group)
    if start.kind != "start":
        raise TensorParallelError(f"expected rank 0's start message, got {start.kind!r}")
    sizing = start.start
    runner = MLXModelRunner(
        prepared.loaded.model, sizing["num_blocks"], sizing["block_size"], None, sizing["num_state_slots"],
        prepared.state_layout, block_groups=prepared.block_groups,
    )  # fmt: skip
    # Held open for this process's life: its end tells rank 0 at once that this rank is gone.
    liveness = connect_to_rank_zero(LivenessAddress.from_dict(sizing.get("liveness")), group.rank())
    try:
        return Worker(runner, group).run()
    finally:
        runner.release()
        if liveness is not None:
            liveness.close()

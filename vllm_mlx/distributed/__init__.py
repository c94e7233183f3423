"""More than one rank: tensor and pipeline parallelism, forming the ring, launching
and supervising ranks, and the watchdog.

``protocol``: the step messages rank 0's engine broadcasts; ``worker``: a rank > 0 replaying
them; ``group``: the group of ranks and what they must agree on at start-up; ``sharding`` and
``pipeline``: the two ways to split the model; ``traffic``: what one step costs in collectives;
``watchdog`` and ``liveness``: noticing a rank that hangs or dies; ``ring_formation``,
``launch`` and ``supervisor``: starting the ranks."""

_COMPATIBLE = {
    "init_group": "vllm_mlx.distributed.group",
    "step_traffic": "vllm_mlx.distributed.traffic",
    "worker_loop": "vllm_mlx.engine.rank_worker",
}
"""What ``vllm_mlx.distributed`` offered when it was one module, as its docs showed it (``from
vllm_mlx.distributed import init_group, worker_loop``): looked up on first use, so importing
this package never pulls in the engine (``worker_loop`` prepares the model with the engine's code,
a layer above; the one import the layers contract lets through)."""


def __getattr__(name: str):
    if name in _COMPATIBLE:
        import importlib

        return getattr(importlib.import_module(_COMPATIBLE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""More than one rank: tensor and pipeline parallelism, forming the ring, launching
and supervising ranks, and the watchdog."""

_COMPATIBLE = {
    "init_group": "vllm_mlx.distributed.tensor_parallel",
    "step_traffic": "vllm_mlx.distributed.tensor_parallel",
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

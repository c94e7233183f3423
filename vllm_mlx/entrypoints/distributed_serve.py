"""``vllm-mlx serve`` over several ranks (tensor parallelism, ``docs/distributed.md``).

Two ways in:

- ``mlx.launch --hosts H1,H2 --backend ring -- vllm-mlx serve MODEL --distributed``: every
  process is a rank (``serve_rank``). Rank 0 builds the engine with ``tensor_parallel=True`` and
  is the only one to serve HTTP; ranks > 0 run ``worker_loop`` on the same model, weight format
  and trust flag, bind nothing, and return when rank 0's engine sends "stop" on shutdown.
- ``vllm-mlx serve MODEL --tensor-parallel-size N`` on one machine (``launch_local``): this
  process checks the model can be split, starts itself N times with ``--distributed`` on a
  loopback ring (``rank_supervisor``) and stays in the foreground as their supervisor.

Pipeline parallelism (``distributed/pipeline.py``) takes the same ways in: ``--distributed
--pipeline-parallel`` on every rank, or ``--pipeline-parallel-size N`` on one machine (its ranks
get ``--distributed`` and keep the size flag, which implies the mode); rank 0's engine then gets
``pipeline_parallel=True`` instead of ``tensor_parallel=True``.
"""

from __future__ import annotations

import argparse
import signal
import sys

from vllm_mlx.distributed.group import TensorParallelError, init_group
from vllm_mlx.distributed.sharding import check_heads_divide
from vllm_mlx.distributed.supervisor import RankGroup, supervise, watch_supervisor
from vllm_mlx.engine.rank_worker import worker_loop

HOW_TO_LAUNCH = (
    "--distributed: this process is not a rank of a launch of 2 or more; start every rank with "
    "'mlx.launch --hosts HOST1,HOST2 --backend ring -- vllm-mlx serve MODEL --distributed', "
    "or on one machine use 'vllm-mlx serve MODEL --tensor-parallel-size N' (or --pipeline-parallel-size N)"
)


def is_pipeline(args: argparse.Namespace) -> bool:
    """Stages of layers (``--pipeline-parallel``, or a ``--pipeline-parallel-size``), else shards.
    Raises ``TensorParallelError`` when the flags ask for both."""
    pipeline = args.pipeline_parallel or (args.pipeline_parallel_size or 1) > 1
    if pipeline and (args.tensor_parallel_size or 1) > 1:
        raise TensorParallelError(
            "--tensor-parallel-size and --pipeline-parallel(-size) are exclusive: choose one way to split the model"
        )
    return pipeline


def _size_flag(args: argparse.Namespace) -> tuple[str, int | None]:
    if is_pipeline(args):
        return "--pipeline-parallel-size", args.pipeline_parallel_size
    return "--tensor-parallel-size", args.tensor_parallel_size


def serve_rank(args: argparse.Namespace, engine_options: dict, run_server) -> int:
    """This process is one rank of a launch: rank 0 serves (``run_server``), the others work."""
    flag, size = _size_flag(args)
    try:
        group = init_group()
    except TensorParallelError:
        raise TensorParallelError(HOW_TO_LAUNCH) from None
    if size is not None and size != group.size():
        raise TensorParallelError(f"{flag} {size}, but the launch started {group.size()} ranks")
    watch_supervisor()
    rank = group.rank()
    pipeline = is_pipeline(args)
    if rank == 0:
        print(f"vllm-mlx: rank 0 of {group.size()}: the engine and the HTTP server", file=sys.stderr, flush=True)
        mode = "pipeline_parallel" if pipeline else "tensor_parallel"
        return run_server(args, {**engine_options, mode: True})
    # A terminal's Ctrl-C reaches every rank of mlx.launch: rank 0 shuts down and sends "stop",
    # which is how a worker ends (leaving early would strand rank 0 in a collective).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"vllm-mlx: rank {rank} of {group.size()}: a worker (no HTTP port)", file=sys.stderr, flush=True)
    stats = worker_loop(
        args.model, weight_format=args.weight_format, trust_remote_code=args.trust_remote_code, group=group,
        pipeline_parallel=pipeline, **startup_timeout(engine_options),
    )  # fmt: skip
    print(f"vllm-mlx: rank {rank}: stopped after {stats.steps} steps", file=sys.stderr, flush=True)
    return 0


def startup_timeout(engine_options: dict) -> dict:
    """``worker_loop``'s ``startup_timeout_s`` from ``--distributed-startup-timeout``, if given."""
    timeout = engine_options.get("distributed_startup_timeout_s")
    return {} if timeout is None else {"startup_timeout_s": timeout}


def check_model_splits(model: str, size: int, trust_remote_code: bool, pipeline: bool = False) -> None:
    """Before starting ranks: the model resolves (downloaded or converted once, here, not by every
    rank at the same time), is a text model, and its heads divide by ``size`` (tensor
    parallelism) or it has a layer per rank (pipeline parallelism; whether the architecture has
    ``pipeline()`` the ranks check once loaded)."""
    import json

    from vllm_mlx.models import resolve_model
    from vllm_mlx.multimodal.vlm_models import is_vision_language_config

    path = resolve_model(model, trust_remote_code)
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return  # the ranks check again once loaded
    config = json.loads(config_file.read_text())
    flag, mode = ("--pipeline-parallel-size", "pipeline") if pipeline else ("--tensor-parallel-size", "tensor")
    if is_vision_language_config(config):
        raise TensorParallelError(f"{flag} {size}: {mode} parallelism does not support vision-language models yet")
    if not pipeline:
        check_heads_divide(config, size)
        return
    layers = config.get("text_config", config).get("num_hidden_layers")
    if layers is not None and layers < size:
        raise TensorParallelError(
            f"pipeline parallelism over {size} ranks needs at least one layer per rank; the model has {layers} layers"
        )


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """``--tensor-parallel-size N`` (or ``--pipeline-parallel-size N``): run this command as N
    ranks on loopback and supervise them; 0 when they all ended cleanly (after a Ctrl-C or
    SIGTERM too), else 1."""
    _, size = _size_flag(args)
    check_model_splits(args.model, size, args.trust_remote_code, is_pipeline(args))
    command = [sys.executable, "-m", "vllm_mlx.entrypoints.cli", *argv, "--distributed"]

    def started(ranks: RankGroup) -> None:
        pids = ", ".join(str(p.pid) for p in ranks.processes)
        print(f"vllm-mlx: started {size} ranks on 127.0.0.1 (pids {pids}; process group {ranks.pgid})",
              file=sys.stderr, flush=True)  # fmt: skip

    result = supervise(command, size, on_start=started)
    if result.ok:
        return 0
    for rank, code in enumerate(result.exit_codes):
        if code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            print(f"vllm-mlx: rank {rank} {how}", file=sys.stderr, flush=True)
    return 1

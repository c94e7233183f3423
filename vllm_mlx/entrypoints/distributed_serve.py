"""``vllm-mlx serve`` over several ranks (tensor parallelism, ``docs/distributed.md``).

Two ways in:

- ``mlx.launch --hosts H1,H2 --backend ring -- vllm-mlx serve MODEL --distributed``: every
  process is a rank (``serve_rank``). Rank 0 builds the engine with ``tensor_parallel=True`` and
  is the only one to serve HTTP; ranks > 0 run ``worker_loop`` on the same model, weight format
  and trust flag, bind nothing, and return when rank 0's engine sends "stop" on shutdown.
- ``vllm-mlx serve MODEL --tensor-parallel-size N`` on one machine (``launch_local``): this
  process checks the model can be split, starts itself N times with ``--distributed`` on a
  loopback ring (``rank_supervisor``) and stays in the foreground as their supervisor.
"""

from __future__ import annotations

import argparse
import signal
import sys

from vllm_mlx.distributed import TensorParallelError, check_heads_divide, init_group, worker_loop
from vllm_mlx.rank_supervisor import RankGroup, supervise, watch_supervisor

HOW_TO_LAUNCH = (
    "--distributed: this process is not a rank of a launch of 2 or more; start every rank with "
    "'mlx.launch --hosts HOST1,HOST2 --backend ring -- vllm-mlx serve MODEL --distributed', "
    "or on one machine use 'vllm-mlx serve MODEL --tensor-parallel-size N'"
)


def serve_rank(args: argparse.Namespace, engine_options: dict, run_server) -> int:
    """This process is one rank of a launch: rank 0 serves (``run_server``), the others work."""
    try:
        group = init_group()
    except TensorParallelError:
        raise TensorParallelError(HOW_TO_LAUNCH) from None
    size = args.tensor_parallel_size
    if size is not None and size != group.size():
        raise TensorParallelError(f"--tensor-parallel-size {size}, but the launch started {group.size()} ranks")
    watch_supervisor()
    rank = group.rank()
    if rank == 0:
        print(f"vllm-mlx: rank 0 of {group.size()}: the engine and the HTTP server", file=sys.stderr, flush=True)
        return run_server(args, {**engine_options, "tensor_parallel": True})
    # A terminal's Ctrl-C reaches every rank of mlx.launch: rank 0 shuts down and sends "stop",
    # which is how a worker ends (leaving early would strand rank 0 in a collective).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"vllm-mlx: rank {rank} of {group.size()}: a worker (no HTTP port)", file=sys.stderr, flush=True)
    stats = worker_loop(
        args.model, weight_format=args.weight_format, trust_remote_code=args.trust_remote_code, group=group
    )
    print(f"vllm-mlx: rank {rank}: stopped after {stats.steps} steps", file=sys.stderr, flush=True)
    return 0


def check_model_splits(model: str, size: int, trust_remote_code: bool) -> None:
    """Before starting ranks: the model resolves (downloaded or converted once, here, not by every
    rank at the same time), is a text model, and its heads divide by ``size``."""
    import json

    from vllm_mlx.models import resolve_model
    from vllm_mlx.vlm_models import is_vision_language_config

    path = resolve_model(model, trust_remote_code)
    config_file = path / "config.json" if path.is_dir() else None
    if config_file is None or not config_file.is_file():
        return  # the ranks check again once loaded
    config = json.loads(config_file.read_text())
    if is_vision_language_config(config):
        raise TensorParallelError(
            f"--tensor-parallel-size {size}: tensor parallelism does not support vision-language models yet"
        )
    check_heads_divide(config, size)


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """``--tensor-parallel-size N``: run this command as N ranks on loopback and supervise them;
    0 when they all ended cleanly (after a Ctrl-C or SIGTERM too), else 1."""
    size = args.tensor_parallel_size
    check_model_splits(args.model, size, args.trust_remote_code)
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

"""Adapter load/use/unload cycles: what each cycle leaves behind (memory, open files).

What a server with ``--enable-lora-loading`` does when clients load an adapter, use it once and
unload it, over and over (a trainer's checkpoints being evaluated, say): on the default model, one
engine with ``enable_lora``, each cycle reads a rank-``--rank`` adapter (mlx-lm's format, on the
attention's q and v and the MLP's down projections) under a new id, generates ``--tokens``
tokens with it, and unloads it. Printed every ``--every`` cycles: the process's resident memory
and open files, and at the end the growth per cycle after the first ``--warmup`` cycles (MLX's
allocator keeps freed buffers for reuse, so the first cycles grow it once).

    python bench/lora_cycles.py [--cycles 200] [--rank 64] [--tokens 4] [--every 25] [--warmup 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psutil
from lora import write_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()

    from vllm_mlx import EngineCore, SamplingParams
    from vllm_mlx.lora import LoRARequest
    from vllm_mlx.models import resolve_model

    model_dir = resolve_model("default")
    adapter = write_adapter(model_dir, Path(tempfile.mkdtemp()) / "adapter", rank=args.rank, seed=0)
    engine = EngineCore(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=args.rank)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    process = psutil.Process()
    samples: dict[int, tuple[float, int]] = {}
    start = time.perf_counter()
    for cycle in range(1, args.cycles + 1):
        lora = LoRARequest(f"cycle-{cycle}", cycle, str(adapter))
        engine.register_lora(lora)
        engine.add_request("Tell me about lighthouses.", params, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        engine.unregister_lora(lora.lora_int_id)
        if cycle == args.warmup or cycle % args.every == 0 or cycle == args.cycles:
            samples[cycle] = (process.memory_info().rss / 2**20, process.num_fds())
            print(f"cycle {cycle:4d}: RSS {samples[cycle][0]:8.1f} MiB, open files {samples[cycle][1]}, "
                  f"adapters held {len(engine.lora.known)}", flush=True)  # fmt: skip
    elapsed = time.perf_counter() - start
    (rss0, fds0), (rss1, fds1) = samples[args.warmup], samples[args.cycles]
    cycles = args.cycles - args.warmup
    print(f"after cycle {args.warmup}: {(rss1 - rss0) * 1024 / cycles:+.1f} KiB and {(fds1 - fds0) / cycles:+.2f} "
          f"open files per cycle ({elapsed / args.cycles * 1000:.0f} ms a cycle, rank {args.rank})")  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()

"""What tensor parallelism's communication costs, measured on loopback (``docs/distributed.md``).

* collectives -- two ranks (``mlx.launch -n 2 --backend ring`` on 127.0.0.1, this script again
  with ``--child``) time ``mx.distributed.all_sum`` of float32 arrays from 4 B to 64 MiB: the
  median of repeated evaluated calls, after warm-up calls. Both ranks run the same calls (a
  collective needs them all), sizes interleaved over 3 rounds; rank 0 writes the timings. Latency:
  the median over messages up to 1 KiB; bandwidth: the best bytes / time from 1 MiB on (each
  rank's input bytes, as the cost model counts). Both from the medians ("typical": what the
  shared cores gave) and from the fastest calls ("floor": the software alone).
* one step    -- the bytes and collectives of a decode step of B requests (``step_traffic``:
  2 all-reduces of a [B, hidden] float32 activation per layer, plus the step message's two),
  on the default model and on the tests' tiny llama; the message's size is the real one,
  ``StepEncoder``'s encoding of a decode step of B requests with 512-token contexts.
  Predicted communication per step: latency x collectives + bytes / bandwidth, for both links.

* on paper   -- the speed-up of 2 and 4 machines over one for a 30B and a 70B dense model over
  10 GbE and Thunderbolt 5 RDMA, from the cost model and published figures (``--paper`` alone).

Loopback measures the software's share (MLX's ring backend, TCP on one host, the collective
count); a real link's latency and bandwidth replace it on a cluster.

    python bench/distributed.py [--quick] [--json] [--paper]     (~40 s; --quick ~15 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 240  # seconds: the whole two-rank run, after which its process group is killed
CONTEXT_TOKENS = 512  # each decode request's context (its block table's length in the message)
BLOCK_SIZE = 16
BATCHES = (1, 8, 32)
ROUNDS = 3
LATENCY_BYTES = 1024  # messages up to this size take the latency alone
BANDWIDTH_BYTES = 1 << 20  # messages from this size on are mostly bytes
TINY_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2}  # tests/tiny_model.py's TINY_CONFIG


@dataclass
class Timing:
    nbytes: int
    calls: int
    median_s: float
    best_s: float


def message_sizes(quick: bool) -> list[int]:
    """4 B to 64 MiB (4 MiB with ``--quick``) in steps of x4 (float32 elements)."""
    top = 4 << 20 if quick else 64 << 20
    sizes, size = [], 4
    while size <= top:
        sizes.append(size)
        size *= 4
    return sizes


def calls_for(nbytes: int, quick: bool) -> int:
    """Fixed per size (every rank must make the same calls): many for small messages, where a
    call is short and noisy, at least 5 for the largest."""
    budget = (8 if quick else 64) << 20
    return max(ROUNDS * 2, min(100 if quick else 300, budget // nbytes))


# -- the ranks ---------------------------------------------------------------------------------


def time_all_sums(quick: bool) -> list[Timing]:
    """Every rank runs this; only rank 0's result is kept. The sizes are swept ``ROUNDS``
    times, interleaved, so a burst of other work on the shared cores lands on every size
    rather than on one."""
    import mlx.core as mx

    group = mx.distributed.init(strict=True)
    sizes = message_sizes(quick)
    arrays = {n: mx.ones((n // 4,), dtype=mx.float32) for n in sizes}
    mx.eval(list(arrays.values()))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for nbytes, x in arrays.items():
            for _ in range(2):  # warm-up: connections, buffers
                mx.eval(mx.distributed.all_sum(x, group=group))
            for _ in range(max(1, calls_for(nbytes, quick) // ROUNDS)):
                start = time.perf_counter()
                mx.eval(mx.distributed.all_sum(x, group=group))
                times[nbytes].append(time.perf_counter() - start)
    return [Timing(n, len(t), statistics.median(t), min(t)) for n, t in times.items()]


def child(out: str, quick: bool) -> None:
    import mlx.core as mx

    timings = time_all_sums(quick)
    if mx.distributed.init().rank() == 0:
        Path(out).write_text(json.dumps([asdict(t) for t in timings]))


# -- the launcher ------------------------------------------------------------------------------


def launch(quick: bool) -> list[Timing]:
    """Run the two ranks (``ring_launch``: their own session, killed whole on timeout)."""
    from vllm_mlx.distributed.launch import LaunchError, launch_ring

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        args = ["--child", str(out), *(["--quick"] if quick else [])]
        try:
            done = launch_ring(str(Path(__file__).resolve()), args, timeout=LAUNCH_TIMEOUT, pythonpath=[str(ROOT)])
        except LaunchError as exc:
            sys.exit(str(exc))
        if not out.exists():  # (mlx.launch exits 0 whatever its ranks do)
            sys.exit(f"the two ranks wrote no timings:\n{done.output[-3000:]}")
        return [Timing(**t) for t in json.loads(out.read_text())]


# -- one step's traffic ------------------------------------------------------------------------


def decode_message_bytes(batch: int) -> int:
    """The length of ``StepEncoder``'s message for a decode step of ``batch`` requests (each
    already known to the workers, one new output token each, a 512-token block table)."""
    from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
    from vllm_mlx.core.request import Request, SamplingParams
    from vllm_mlx.distributed.protocol import StepEncoder

    encoder = StepEncoder()
    blocks = CONTEXT_TOKENS // BLOCK_SIZE
    requests = [Request(f"req-{i}", list(range(1000, 1000 + CONTEXT_TOKENS - 1)), SamplingParams(seed=i))
                for i in range(batch)]  # fmt: skip
    tables = {r.request_id: list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i, r in enumerate(requests)}

    def step(step_id: int, computed: int, new: int) -> SchedulerOutput:
        return SchedulerOutput(step_id, [ScheduledRequest(r, computed, new, tables[r.request_id]) for r in requests])

    encoder.encode(step(1, 0, CONTEXT_TOKENS - 1))  # the prefill: prompts sent once
    for request in requests:
        request.append_output_token(31337)
    return len(encoder.encode(step(2, CONTEXT_TOKENS - 1, 1)).to_bytes())


@dataclass
class Link:
    """A link's cost as the model sees it: seconds per collective, input bytes per second."""

    latency_s: float
    bandwidth: float


def fit_link(timings: list[Timing], best: bool) -> Link:
    """Latency: the median over messages up to ``LATENCY_BYTES``; bandwidth: the best rate
    (bytes over time) of messages from ``BANDWIDTH_BYTES`` on. ``best``: from the fastest calls
    (the software's floor, the cores to itself) rather than the medians (what the shared
    machine gave)."""
    seconds = (lambda t: t.best_s) if best else (lambda t: t.median_s)
    latency = statistics.median(seconds(t) for t in timings if t.nbytes <= LATENCY_BYTES)
    return Link(latency, max(t.nbytes / seconds(t) for t in timings if t.nbytes >= BANDWIDTH_BYTES))


@dataclass
class StepRow:
    model: str
    batch: int
    collectives: int
    message_bytes: int
    nbytes: int
    typical_ms: float  # from the medians
    floor_ms: float  # from the fastest calls


def step_rows(typical: Link, floor: Link) -> list[StepRow]:
    from vllm_mlx.distributed.traffic import step_traffic
    from vllm_mlx.models import resolve_model

    default = json.loads((resolve_model("default") / "config.json").read_text())
    rows = []
    for name, config in (("default (SmolLM2-135M)", default), ("tiny llama", TINY_CONFIG)):
        for batch in BATCHES:
            message = decode_message_bytes(batch)
            traffic = step_traffic(config, batch, message)
            ms = [traffic.seconds(link.latency_s, link.bandwidth) * 1e3 for link in (typical, floor)]
            rows.append(StepRow(name, batch, traffic.collectives, message, traffic.nbytes, *ms))
    return rows


# -- a cluster, on paper (docs/distributed.md states and cites these assumptions) ----------------


@dataclass
class Dense:
    name: str
    params: float
    hidden: int
    layers: int


MODELS = (Dense("30B (LLaMA-33B shape)", 32.5e9, 6656, 60), Dense("70B (Llama-3-70B shape)", 70.6e9, 8192, 80))
LINKS = {  # per-collective latency (s), all_sum bandwidth (input bytes/s)
    "10 GbE, TCP ring": Link(300e-6, 1.25e9),
    "TB5, RDMA (JACCL)": Link(50e-6, 6.5e9),
}
MEMORY_BANDWIDTH = 819e9  # M3 Ultra, Apple's figure: decode reads every weight once per step
GPU_FLOPS = 30e12  # assumed bf16 matmul rate of an M3 Ultra GPU (no published figure found)
PREFILL_TOKENS = 2048


def speedup(model: Dense, link: Link, machines: int, weight_bytes: float, tokens: int) -> float:
    """One machine's step time over ``machines``' (each 1 / N of the weights and FLOPs, plus the
    step's all-reduces: 2 per layer of [tokens, hidden] bf16, ring-scaled; no overlap)."""
    def compute(n: int) -> float:
        memory = model.params * weight_bytes / n / MEMORY_BANDWIDTH
        return max(memory, 2 * model.params * tokens / n / GPU_FLOPS)

    collectives = 2 * model.layers
    nbytes = collectives * tokens * model.hidden * 2 * 2 * (machines - 1) / machines
    communication = collectives * link.latency_s + nbytes / link.bandwidth
    return compute(1) / (compute(machines) + communication)


def print_cluster() -> None:
    print(f"\non paper: speed-up of N machines over one (M3 Ultra {MEMORY_BANDWIDTH / 1e9:.0f} GB/s, "
          f"assumed {GPU_FLOPS / 1e12:.0f} TFLOP/s; bf16 activations)")  # fmt: skip
    print(f"{'model':<24} {'weights':>7} {'link':<18} {'decode N=2':>10} {'N=4':>5} "
          f"{'prefill N=2':>11} {'N=4':>5}")  # fmt: skip
    for model in MODELS:
        for weights, weight_bytes in (("bf16", 2.0), ("4-bit", 0.5625)):
            for name, link in LINKS.items():
                cells = [speedup(model, link, n, weight_bytes, t) for t in (1, PREFILL_TOKENS) for n in (2, 4)]
                print(f"{model.name:<24} {weights:>7} {name:<18} {cells[0]:>10.2f} {cells[1]:>5.2f} "
                      f"{cells[2]:>11.2f} {cells[3]:>5.2f}")  # fmt: skip


# -- report ------------------------------------------------------------------------------------


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024 or unit == "MiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def report(timings: list[Timing], rows: list[StepRow], typical: Link, floor: Link) -> None:
    print("all_sum on loopback, 2 ranks (ring backend), float32 (GB/s: input bytes / median)")
    print(f"{'bytes':>10} {'calls':>6} {'median us':>10} {'best us':>9} {'GB/s':>8}")
    for t in timings:
        print(f"{human(t.nbytes):>10} {t.calls:>6} {t.median_s * 1e6:>10.1f} {t.best_s * 1e6:>9.1f} "
              f"{t.nbytes / t.median_s / 1e9:>8.3f}")  # fmt: skip
    for name, link in (("typical (medians)", typical), ("floor (fastest)", floor)):
        print(f"{name:<18} latency {link.latency_s * 1e6:8.1f} us (messages <= {human(LATENCY_BYTES)}), "
              f"bandwidth {link.bandwidth / 1e9:.3f} GB/s (messages >= {human(BANDWIDTH_BYTES)})")  # fmt: skip
    print(f"\none decode step of B requests (context {CONTEXT_TOKENS}): predicted communication time")
    print(f"{'model':<24} {'B':>3} {'collectives':>11} {'message':>10} {'bytes':>10} "
          f"{'typical ms':>10} {'floor ms':>9}")  # fmt: skip
    for r in rows:
        print(f"{r.model:<24} {r.batch:>3} {r.collectives:>11} {human(r.message_bytes):>10} "
              f"{human(r.nbytes):>10} {r.typical_ms:>10.2f} {r.floor_ms:>9.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 4 MiB, fewer calls (~20 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--paper", action="store_true", help="only the on-paper cluster table (no launch)")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)  # a launched rank
    args = parser.parse_args()
    if args.paper:
        return print_cluster()
    if args.child:
        return child(args.child, args.quick)
    timings = launch(args.quick)
    typical, floor = fit_link(timings, best=False), fit_link(timings, best=True)
    rows = step_rows(typical, floor)
    if args.json:
        print(json.dumps({"timings": [asdict(t) for t in timings], "typical": asdict(typical),
                          "floor": asdict(floor), "steps": [asdict(r) for r in rows]}, indent=1))  # fmt: skip
    else:
        report(timings, rows, typical, floor)
        print_cluster()

if __name__ == "__main__":
    main()

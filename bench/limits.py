"""How close the engine comes to this machine's limits: measured peaks, the bounds they put on the
default model, and our figures (with mlx-lm's, and optionally llama.cpp's) against them, in one run.

Machine limits, measured in this process after ``import vllm_mlx`` preloaded the fast BLAS, i.e.
in the configuration the engine runs in (the output names the BLAS):

* compute   -- float32 ``x @ w.T`` (as ``nn.Linear`` does) with M=512 and 1024 rows against each
  distinct per-layer weight shape of the default model; fastest of the evaluated calls. MLX
  runs each CPU stream on one thread, and MKL's sequential layer computes on the calling one, so
  the machine's compute is the best shape split across two CPU streams (both cores), as the
  engine splits large calls (``cpu_kernels.SplitLinear``).
* bandwidth -- every weight matrix of the default model (the tied embedding as the LM head) times
  a 1-row vector, all in one ``mx.eval``: weight bytes / fastest seconds, the read bandwidth that
  decode gets through MLX and its BLAS. numpy's ``np.copyto`` of 256 MiB (read + write bytes)
  for reference.

Bounds for the default model (SmolLM2-135M, float32 weights; counts from its weight shapes). A
bound is a roofline time: the larger of FLOPs / compute and weight bytes / bandwidth (norms,
element-wise ops and KV-cache reads are left out: they only make the real time longer).

* prefill, P tokens -- 2 x params of the per-layer projections x P, the LM head for the last
  position only, causal attention (QK^T and AV).
* decode, 1 stream  -- weight bytes read per token / bandwidth.
* batch of B        -- the batch workload below: its prompts' prefill, then its decode steps
  (2 x params x B per step, plus attention over the context), each step at least one weight read.

Figures, the default model with float32 weights, greedy, EOS ignored, random-token prompts:

* ours      -- ``vllm_mlx.LLM("default", enable_prefix_caching=False)``: TTFT of a P-token prompt
  (``max_tokens=1``); decode tok/s from a 16-token prompt (``--decode-tokens`` steps after the
  first token, from the output's first-token and finish times). Best of 2 after a warm-up.
  Then one decode step taken apart (``StepSplit``): Python building its graph, and the
  computation alone; the step's wall time minus the computation is the Python not hidden.
* mlx-lm    -- ``mlx_lm.stream_generate`` on the same model object (EOS masked out, as it stops
  at EOS): time to the first response, and decode tok/s timed the same way. Best of 2.
* batch     -- ``vllm-mlx bench``'s "together" workload (its functions, in this process): B
  requests arriving at once, prompts of 16..256 tokens of the package's prose, ``--decode-tokens``
  output tokens each; ours vs mlx-lm's ``BatchGenerator``; output tok/s, the prefill included.
* llama.cpp -- (``--llama-cpp auto``, if ``llama_cpp`` imports) the default model's Q4_1 GGUF, the
  file our weights are converted from, ``n_threads`` = all cores; same prompts and timing.

    python bench/limits.py [--prompt-tokens 1024] [--decode-tokens 64] [--batch 32] [--skip-batch]
                           [--llama-cpp auto|off] [--json]
    python bench/limits.py --quick --skip-batch     (smoke test: P=256, 16 decode tokens, batch 8)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import vllm_mlx  # noqa: F401  -- first: preloads the fast BLAS before anything imports mlx
from vllm_mlx.platform import cpu_backend

DECODE_PROMPT_TOKENS = 16
SGEMM_ROWS = (512, 1024)  # prefill-like: the engine prefills in chunks of up to 512 tokens
COPY_BYTES = 256 << 20
FIRST_ORDINARY_TOKEN = 100  # random prompts stay clear of the special tokens at the low ids
LLAMA_CPP_INSTALL = "pip install llama-cpp-python"  # builds llama.cpp from source: minutes


@dataclass
class Workload:
    prompt_tokens: int  # P: the prefill row's prompt
    decode_tokens: int  # decode steps timed after the first token; each batch request's output
    batch: int


# -- machine limits ----------------------------------------------------------------------------


@dataclass
class MachineLimits:
    backend: str
    sgemm_gflops: dict[str, float]  # "MxKxN" -> GFLOP/s
    one_stream_gflops: float  # the best sgemm shape's rate on one CPU stream (one core)
    compute_gflops: float  # the best shape split across two CPU streams: both cores, the bound
    gemv_weight_bytes: int
    gemv_ms: float
    read_gbps: float  # weight bytes / GEMV time: what decode can stream
    copy_gbps: float  # numpy copy, read + write bytes: for reference


def best_seconds(call: Callable[[], object], budget_s: float = 0.3, min_calls: int = 5) -> float:
    """Fewest seconds ``call()`` took over at least ``min_calls`` calls or ``budget_s``, after one
    untimed call (first-call allocations): a peak, as limits are (the machine is shared, and
    other work only ever slows a call down)."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times)


def sgemm_gflops(rows: int, out_features: int, in_features: int) -> float:
    import mlx.core as mx

    x, w = mx.random.normal((rows, in_features)), mx.random.normal((out_features, in_features))
    mx.eval(x, w)
    seconds = best_seconds(lambda: mx.eval(x @ w.T))
    return 2 * rows * out_features * in_features / seconds / 1e9


def two_stream_sgemm_gflops(rows: int, out_features: int, in_features: int) -> float:
    """The same product with its output columns split across two CPU streams (MLX runs each on
    its own thread): what the second core adds to a matmul."""
    import mlx.core as mx

    x, w = mx.random.normal((rows, in_features)), mx.random.normal((out_features, in_features))
    half = out_features // 2
    streams = (mx.default_stream(mx.cpu), mx.new_stream(mx.cpu))
    parts = (w[:half], w[half:])
    mx.eval(x, *parts)

    def product():
        mx.eval(*(mx.matmul(x, part.T, stream=stream) for part, stream in zip(parts, streams)))

    return 2 * rows * out_features * in_features / best_seconds(product) / 1e9


def gemv_seconds(matrices: list) -> float:
    """Median seconds of a 1-row product with every matrix, all in one evaluation: the GEMVs are
    independent, so this is as close to streaming all the weights as MLX gets."""
    import mlx.core as mx

    vectors = {w.shape[1]: mx.random.normal((1, w.shape[1])) for w in matrices}
    mx.eval(*vectors.values())
    return best_seconds(lambda: mx.eval(*(vectors[w.shape[1]] @ w.T for w in matrices)))


def numpy_copy_gbps() -> float:
    import numpy as np

    src = np.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src)) / 1e9


def measure_machine(matrices: list) -> MachineLimits:
    import mlx.core as mx

    mx.random.seed(0)
    weight_shapes = sorted({tuple(w.shape) for w in matrices[:-1]})  # per-layer ones, not the head
    shapes = {f"{m}x{k}x{n}": (m, n, k) for m in SGEMM_ROWS for n, k in weight_shapes}
    rates = {name: sgemm_gflops(*shape) for name, shape in shapes.items()}
    best = max(rates, key=rates.get)
    weight_bytes, gemv_s = sum(w.nbytes for w in matrices), gemv_seconds(matrices)
    return MachineLimits(
        backend=cpu_backend.backend_summary("float32"),
        sgemm_gflops=rates,
        one_stream_gflops=rates[best],
        compute_gflops=max(rates[best], two_stream_sgemm_gflops(*shapes[best])),
        gemv_weight_bytes=weight_bytes,
        gemv_ms=1e3 * gemv_s,
        read_gbps=weight_bytes / gemv_s / 1e9,
        copy_gbps=numpy_copy_gbps(),
    )


# -- the model's counts and the bounds ---------------------------------------------------------


def decode_matrices(model) -> list:
    """The weight matrices one decode step reads: every per-layer projection, then the LM head
    (the embedding when tied: the embedding lookup itself reads only one row per token)."""
    from mlx.utils import tree_flatten

    per_layer = [w for layer in model.layers for _, w in tree_flatten(layer.parameters()) if w.ndim == 2]
    head = model.lm_head.weight if hasattr(model, "lm_head") else model.model.embed_tokens.weight
    return per_layer + [head]


@dataclass
class ModelCounts:
    layer_params: int  # elements of the per-layer projection matrices, all layers
    head_params: int
    num_layers: int
    attention_width: int  # query heads x head dim: the width of QK^T and AV
    weight_bytes: int  # what one decode step reads (norms and the KV cache left out: < 1%)

    @classmethod
    def of(cls, model) -> ModelCounts:
        matrices = decode_matrices(model)
        return cls(
            layer_params=sum(w.size for w in matrices[:-1]),
            head_params=matrices[-1].size,
            num_layers=len(model.layers),
            attention_width=model.layers[0].self_attn.q_proj.weight.shape[0],
            weight_bytes=sum(w.nbytes for w in matrices),
        )

    def attention_flops(self, queries: int, context_before: int) -> float:
        """QK^T and AV (2 FLOPs per multiply-add each) for ``queries`` new positions that see the
        ``context_before`` earlier ones and, causally, each other."""
        pairs = queries * context_before + queries * (queries + 1) / 2
        return 2 * 2 * pairs * self.attention_width * self.num_layers

    def prefill_flops(self, prompt_tokens: int) -> float:
        """Projections for every position, the LM head for the last one only."""
        projections = 2 * self.layer_params * prompt_tokens + 2 * self.head_params
        return projections + self.attention_flops(prompt_tokens, 0)

    def decode_flops(self, contexts: list[int]) -> float:
        """One decode step of a batch whose sequences hold ``contexts`` tokens before it."""
        params = self.layer_params + self.head_params
        return sum(2 * params + self.attention_flops(1, c) for c in contexts)


@dataclass
class Bounds:
    prefill_s: float
    prefill_tps: float
    decode_tps: float  # one stream
    batch_step_tps: float  # B streams, one decode step (contexts of the decode prompt)
    batch_workload_tps: float | None  # the batch workload, prompts' prefill included


class Roofline:
    """Seconds a piece of work needs at the measured peaks: compute and the weight stream overlap
    in a matmul, so the slower of the two bounds it (adding them would be no bound: a good GEMM
    hides the read)."""

    def __init__(self, limits: MachineLimits, counts: ModelCounts) -> None:
        self.flops_per_s = limits.compute_gflops * 1e9
        self.bytes_per_s = limits.read_gbps * 1e9
        self.counts = counts

    def seconds(self, flops: float) -> float:
        return max(flops / self.flops_per_s, self.counts.weight_bytes / self.bytes_per_s)

    def prefill_s(self, prompt_lengths: list[int]) -> float:
        """Prompts prefilled together: the engine batches them, reading the weights once a step."""
        return self.seconds(sum(self.counts.prefill_flops(n) for n in prompt_lengths))

    def decode_step_s(self, contexts: list[int]) -> float:
        return self.seconds(self.counts.decode_flops(contexts))

    def workload_s(self, prompt_lengths: list[int], output_tokens: int) -> float:
        """Every prompt prefilled, then ``output_tokens - 1`` decode steps of the whole batch
        (the first output token of each request comes from its prefill)."""
        decode = (self.decode_step_s([n + step for n in prompt_lengths]) for step in range(1, output_tokens))
        return self.prefill_s(prompt_lengths) + sum(decode)


def bounds_for(roofline: Roofline, workload: Workload, batch_prompt_lengths: list[int] | None) -> Bounds:
    prefill_s = roofline.prefill_s([workload.prompt_tokens])
    batch_contexts = [DECODE_PROMPT_TOKENS] * workload.batch
    batch_workload_tps = None
    if batch_prompt_lengths:
        tokens = len(batch_prompt_lengths) * workload.decode_tokens
        batch_workload_tps = tokens / roofline.workload_s(batch_prompt_lengths, workload.decode_tokens)
    return Bounds(
        prefill_s=prefill_s,
        prefill_tps=workload.prompt_tokens / prefill_s,
        decode_tps=1 / roofline.decode_step_s([DECODE_PROMPT_TOKENS]),
        batch_step_tps=workload.batch / roofline.decode_step_s(batch_contexts),
        batch_workload_tps=batch_workload_tps,
    )


# -- the engines' figures ----------------------------------------------------------------------


@dataclass
class StreamTiming:
    """One request: seconds to its first token, and decode tok/s after it."""

    first_token_s: float
    decode_tps: float


@dataclass
class Figures:
    prefill_s: float | None = None  # TTFT of the P-token prompt
    decode_tps: float | None = None
    batch_tps: float | None = None
    step: StepSplit | None = None  # ours only
    notes: list[str] = field(default_factory=list)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]


def decode_rate(tokens: int, seconds_after_first: float) -> float:
    """Tokens per second after the first token (whose time is the prefill's); NaN for one token."""
    return (tokens - 1) / seconds_after_first if tokens > 1 else float("nan")


def timed_stream(tokens: Iterator[object]) -> StreamTiming:
    """Consume a stream of one request's tokens, stamping each as it arrives."""
    start = time.perf_counter()
    stamps = [time.perf_counter() for _ in tokens]
    return StreamTiming(stamps[0] - start, decode_rate(len(stamps), stamps[-1] - stamps[0]))


def best_of(runs: int, measure: Callable[[], StreamTiming]) -> StreamTiming:
    """One warm-up, then the best first-token time and the best decode rate of ``runs``."""
    measure()
    timings = [measure() for _ in range(runs)]
    return StreamTiming(min(t.first_token_s for t in timings), max(t.decode_tps for t in timings))


Request = Callable[[list[int], int], StreamTiming]  # (prompt, max_tokens) -> its timing


def single_stream(request: Request, workload: Workload, vocab_size: int) -> Figures:
    """TTFT of the P-token prompt, decode rate after a 16-token one; random prompts (seeded,
    the same on every side), best of 2 after a warm-up each."""
    long_prompt = random_prompt(workload.prompt_tokens, vocab_size, seed=1)
    short_prompt = random_prompt(DECODE_PROMPT_TOKENS, vocab_size, seed=2)
    prefill = best_of(2, lambda: request(long_prompt, 1))
    decode = best_of(2, lambda: request(short_prompt, workload.decode_tokens + 1))
    return Figures(prefill_s=prefill.first_token_s, decode_tps=decode.decode_tps)


def ours_single(workload: Workload, vocab_size: int) -> Figures:
    from vllm_mlx import LLM, SamplingParams

    llm = LLM("default", enable_prefix_caching=False)

    def request(prompt: list[int], max_tokens: int) -> StreamTiming:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out = llm.generate(prompt, params)[0]
        # the engine's own stamps (time.monotonic): add_request, first token, last token
        return StreamTiming(out.first_token_time - out.arrival_time,
                            decode_rate(len(out.token_ids), out.finish_time - out.first_token_time))  # fmt: skip

    try:
        figures = single_stream(request, workload, vocab_size)
        figures.step = step_split(llm.engine)
    finally:
        llm.shutdown()  # the batch run builds its own engine on the same model
    figures.notes.append(f"ours: {llm.engine.weight_format} weights, prefill in chunks of the default token budget")
    return figures


@dataclass
class StepSplit:
    """One decode step of ours at batch 1, taken apart: Python building the step's graph, and
    the computation alone (the graph built first, then evaluated). The engine overlaps the two
    (``mx.async_eval`` as each layer is built), so wall time minus computation is the Python
    that is not hidden."""

    build_ms: float
    compute_ms: float


def step_split(engine, context: int = DECODE_PROMPT_TOKENS, steps: int = 10) -> StepSplit:
    """Decode steps run through the engine's runner with ``mx.async_eval`` off, timing the
    build (until sampling's ``mx.eval``) and that evaluation apart. Writes into blocks no
    request holds (call it on an idle engine)."""
    import mlx.core as mx

    from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput
    from vllm_mlx.core.request import Request, SamplingParams

    runner = engine.runner
    request = Request("step-split", list(range(FIRST_ORDINARY_TOKEN, FIRST_ORDINARY_TOKEN + context + 1)),
                      SamplingParams(temperature=0, seed=0))  # fmt: skip
    blocks = list(range(1, 2 + context // engine.config.block_size))
    step = SchedulerOutput(0, [ScheduledRequest(request, context, 1, blocks)])
    real_eval, real_async_eval, marks = mx.eval, mx.async_eval, []

    def timed_eval(*arrays):
        marks.append(time.perf_counter())
        real_eval(*arrays)
        marks.append(time.perf_counter())

    builds, computes = [], []
    mx.async_eval = lambda *arrays: None
    mx.eval = timed_eval
    try:
        for i in range(steps + 2):
            marks.clear()
            start = time.perf_counter()
            runner.execute_model(step)
            if i >= 2:  # warm-up
                builds.append(marks[0] - start)
                computes.append(marks[-1] - marks[0])
    finally:
        mx.eval, mx.async_eval = real_eval, real_async_eval
    return StepSplit(1e3 * statistics.median(builds), 1e3 * statistics.median(computes))


def mlx_lm_single(model, tokenizer, workload: Workload, vocab_size: int) -> Figures:
    import mlx.core as mx
    from mlx_lm import stream_generate

    # ignore_eos, as on our side: mlx-lm stops at EOS, so make EOS impossible instead
    eos_bias = mx.zeros((vocab_size,))
    eos_bias[list(tokenizer.eos_token_ids)] = -float("inf")
    no_eos = [lambda _tokens, logits: logits + eos_bias]

    def request(prompt: list[int], max_tokens: int) -> StreamTiming:
        return timed_stream(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=no_eos))

    return single_stream(request, workload, vocab_size)


def llama_cpp_single(workload: Workload, vocab_size: int) -> Figures | None:
    """llama.cpp on the GGUF our default model comes from; None when llama-cpp-python is absent."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf

    gguf, threads = checkpoint_gguf(SMOLLM2), os.cpu_count()
    context = workload.prompt_tokens + workload.decode_tokens + DECODE_PROMPT_TOKENS
    llm = llama_cpp.Llama(str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)

    def request(prompt: list[int], max_tokens: int) -> StreamTiming:
        llm.reset()  # forget the previous prompt: generate() would reuse a matching prefix
        tokens = llm.generate(prompt, temp=0.0)  # endless: stopping at EOS is the caller's job
        return timed_stream(token for token, _ in zip(tokens, range(max_tokens)))

    figures = single_stream(request, workload, vocab_size)
    figures.notes.append(f"llama.cpp: {gguf.name} (Q4_1 weights, not float32), n_threads={threads}")
    return figures


@dataclass
class BatchRun:
    prompt_lengths: list[int]
    ours_tps: float
    mlx_lm_tps: float


def batch_run(tokenizer, workload: Workload) -> BatchRun:
    """``vllm-mlx bench``'s "together" scenario, both sides in this process."""
    from vllm_mlx.entrypoints import bench

    args = bench.build_parser().parse_args([
        "--scenario", "together", "--num-requests", str(workload.batch),
        "--max-tokens", str(workload.decode_tokens), "--max-num-seqs", str(workload.batch),
    ])  # fmt: skip
    prompts = bench.make_prompts(tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    arrivals = bench.arrival_times(args.num_requests, None, args.seed)
    ours = bench.run_ours(args, prompts, arrivals)
    gc.collect()  # that engine's model and KV pool, before mlx-lm loads its copy
    peer = bench.run_mlx_lm(args, prompts, arrivals)
    return BatchRun([len(p) for p in prompts], ours["tok_per_s"], peer["tok_per_s"])


# -- report ------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    ours: float | None
    bound: float | None
    mlx_lm: float | None
    llama_cpp: float | None


def per_second(count: int, seconds: float | None) -> float | None:
    return count / seconds if seconds else None


def rows(workload: Workload, bounds: Bounds, ours: Figures, peer: Figures, llama: Figures | None) -> list[Row]:
    p, llama = workload.prompt_tokens, llama or Figures()
    prefill = [per_second(p, f.prefill_s) for f in (ours, peer, llama)]
    table = [
        Row(f"prefill {p} tok/s", prefill[0], bounds.prefill_tps, prefill[1], prefill[2]),
        Row("decode 1 stream tok/s", ours.decode_tps, bounds.decode_tps, peer.decode_tps, llama.decode_tps),
    ]
    if ours.batch_tps is not None:
        name = f"batch {workload.batch} tok/s"
        table.append(Row(name, ours.batch_tps, bounds.batch_workload_tps, peer.batch_tps, None))
    return table


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Results:
    workload: Workload
    limits: MachineLimits
    model: ModelCounts
    bounds: Bounds
    ours: Figures
    mlx_lm: Figures
    llama_cpp: Figures | None
    rows: list[Row]
    notes: list[str]


def print_report(results: Results) -> None:
    limits, counts, bounds, workload = results.limits, results.model, results.bounds, results.workload
    print(f"\n{limits.backend}")
    print("machine limits (sgemm shapes: rows M x in K x out N)")
    for shape, rate in limits.sgemm_gflops.items():
        print(f"  sgemm {shape:<16} {rate:8.1f} GFLOP/s")
    print(f"  best sgemm, one stream {limits.one_stream_gflops:8.1f} GFLOP/s   (one core)")
    print(f"  compute (two streams)  {limits.compute_gflops:8.1f} GFLOP/s   (the best shape split across both cores)")
    gemv = f"{limits.gemv_weight_bytes / 1e6:.0f} MB of weights in {limits.gemv_ms:.1f} ms"
    print(f"  weight read (GEMVs)    {limits.read_gbps:8.1f} GB/s   ({gemv})")
    print(f"  numpy copy (r+w)       {limits.copy_gbps:8.1f} GB/s   (reference)")
    print("default model, float32")
    params = (counts.layer_params + counts.head_params) / 1e6
    print(f"  {params:.1f}M params in matrices ({counts.layer_params / 1e6:.1f}M in {counts.num_layers} layers, "
          f"head {counts.head_params / 1e6:.1f}M)")  # fmt: skip
    ttft = f"TTFT: ours {fmt(results.ours.prefill_s, '.3f')} s, mlx-lm {fmt(results.mlx_lm.prefill_s, '.3f')} s"
    print(f"  prefill bound          {bounds.prefill_s:8.3f} s for {workload.prompt_tokens} tokens ({ttft})")
    print(f"  decode bound           {bounds.decode_tps:8.1f} tok/s, one stream")
    print(f"  decode step bound      {bounds.batch_step_tps:8.1f} tok/s, batch of {workload.batch}, no prefill")
    print_step_split(results.ours)
    for note in results.notes:
        print(f"  {note}")
    print_table(results.rows)


def print_step_split(ours: Figures) -> None:
    if ours.step is None or not ours.decode_tps:
        return
    wall_ms = 1e3 / ours.decode_tps
    hidden = max(0.0, wall_ms - ours.step.compute_ms)
    print(f"  decode step, batch 1   {wall_ms:8.1f} ms: computation {ours.step.compute_ms:.1f} ms, "
          f"Python building the graph {ours.step.build_ms:.1f} ms ({ours.step.build_ms / wall_ms:.0%}, overlapped), "
          f"not hidden {hidden:.1f} ms ({hidden / wall_ms:.0%})")  # fmt: skip


def print_table(table: list[Row]) -> None:
    has_llama = any(r.llama_cpp is not None for r in table)
    headers = ["ours", "bound", "of bound", "mlx-lm", "ours/mlx"] + (["llama.cpp", "ours/llama"] if has_llama else [])
    print("\n" + " " * 24 + "".join(f"{h:>11}" for h in headers))
    for r in table:
        cells = [fmt(r.ours, ".1f"), fmt(r.bound, ".1f"), fmt(ratio(r.ours, r.bound), ".0%"),
                 fmt(r.mlx_lm, ".1f"), fmt(ratio(r.ours, r.mlx_lm), ".2f")]  # fmt: skip
        if has_llama:
            cells += [fmt(r.llama_cpp, ".1f"), fmt(ratio(r.ours, r.llama_cpp), ".2f")]
        print(f"{r.name:24}" + "".join(f"{c:>11}" for c in cells))
    print("(ours/x > 1: ours is faster)")


# -- driver ------------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def measure(workload: Workload, skip_batch: bool, llama_cpp: str) -> Results:
    import mlx_lm

    from vllm_mlx.models import resolve_model

    # mlx-lm's copy of the model: the weights whose shapes we count and read, and mlx-lm's side
    model, tokenizer = mlx_lm.load(str(resolve_model("default")))
    cpu_backend.prepare_model_weights(model, "auto")
    vocab_size = model.args.vocab_size

    progress("machine limits")
    limits = measure_machine(decode_matrices(model))
    progress("mlx-lm, one stream")
    peer = mlx_lm_single(model, tokenizer, workload, vocab_size)
    progress("ours, one stream")
    ours = ours_single(workload, vocab_size)
    notes = list(ours.notes)

    prompt_lengths = None
    if not skip_batch:
        progress(f"batch of {workload.batch}, ours then mlx-lm")
        batch = batch_run(tokenizer, workload)
        ours.batch_tps, peer.batch_tps, prompt_lengths = batch.ours_tps, batch.mlx_lm_tps, batch.prompt_lengths
        notes.append(f"batch: {len(prompt_lengths)} prompts of {min(prompt_lengths)}..{max(prompt_lengths)} tokens "
                     f"({sum(prompt_lengths)} in all), {workload.decode_tokens} output tokens each; "
                     "tok/s and bound include the prefill")  # fmt: skip

    llama = None
    if llama_cpp == "auto":
        progress("llama.cpp")
        llama = llama_cpp_single(workload, vocab_size)
        notes += llama.notes if llama else [f"llama.cpp: skipped (no llama_cpp module; enable: {LLAMA_CPP_INSTALL})"]

    counts = ModelCounts.of(model)
    bounds = bounds_for(Roofline(limits, counts), workload, prompt_lengths)
    table = rows(workload, bounds, ours, peer, llama)
    return Results(workload, limits, counts, bounds, ours, peer, llama, table, notes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="prefill prompt length P")
    parser.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed; batch output tokens")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--llama-cpp", choices=["auto", "off"], default="auto", help="auto: run if llama_cpp imports")
    parser.add_argument("--quick", action="store_true", help="smoke test: P=256, 16 decode tokens, batch 8")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.batch = 256, 16, 8
    workload = Workload(args.prompt_tokens, args.decode_tokens, args.batch)
    results = measure(workload, args.skip_batch, args.llama_cpp)
    if args.json:
        print(json.dumps(asdict(results), indent=2))
    else:
        print_report(results)


if __name__ == "__main__":
    main()

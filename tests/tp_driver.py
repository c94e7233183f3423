"""The tensor-parallel test's two sides: ``run_batch`` (the same workload for the 2-rank engine and
the single-process one) and ``main`` (what each rank of ``mlx.launch -n 2`` runs).

``python tests/tp_driver.py MODEL_DIR OUT_PREFIX`` under ``mlx.launch``: rank 0 writes
``OUT_PREFIX.rank0.json`` (tokens and what the steps did), rank 1 ``OUT_PREFIX.rank1.json``
(its ``WorkerStats``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",  # a prefix hit
    "Why?",
    "A much longer prompt " * 6,
]
# 12 usable blocks of 4 tokens cannot hold every request (preemption); 8 tokens a step (chunks).
ENGINE_OPTIONS = {"block_size": 4, "num_kv_blocks": 13, "max_num_batched_tokens": 8, "seed": 0}


def run_batch(engine) -> dict:
    """Staggered arrivals (one every third step), run to the end: greedy tokens per prompt, the
    steps' preemptions, prefix hits and prefill chunks, and the KV cache's block groups (plain
    data)."""
    from vllm_mlx.request import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids, final = [], {}
    for step in range(2000):
        if step % 3 == 0 and len(ids) < len(PROMPTS):
            ids.append(engine.add_request(PROMPTS[len(ids)], params, request_id=f"p{len(ids)}"))
        elif not engine.has_unfinished_requests():
            break
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    records = list(engine.step_records)
    return {
        "tokens": [final[i].outputs[0].token_ids for i in ids],
        "errors": [final[i].error for i in ids],
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hits": sum(len(r.prefix_hits) for r in records),
        "chunks": sum(1 for r in records for q in r.requests if not q.is_decode and q.num_new_tokens > 1),
        "block_groups": len(engine.kv_cache.group_windows),
    }


POISON = "p3"  # with ``poison``: every step whose batch holds this request fails, on every rank


def poison_the_runner() -> None:
    """Make every step that runs the ``POISON`` request raise before its forward (alike on every
    rank, before any collective): rank 0 re-runs such a batch request by request, and so do the
    workers, from its messages."""
    from vllm_mlx.model_runner import MLXModelRunner

    stock = MLXModelRunner.execute_model

    def execute_model(self, scheduler_output):
        if any(s.request_id == POISON for s in scheduler_output.scheduled):
            raise ValueError("poisoned request")
        return stock(self, scheduler_output)

    MLXModelRunner.execute_model = execute_model


def main(model_dir: str, out_prefix: str, mode: str = "") -> None:
    from vllm_mlx.distributed import init_group, worker_loop

    if mode == "poison":
        poison_the_runner()
    group = init_group()
    out = Path(f"{out_prefix}.rank{group.rank()}.json")
    if group.rank() == 0:
        from vllm_mlx.engine_core import EngineCore

        engine = EngineCore(model=model_dir, tensor_parallel=True, force_model_takeover=True, **ENGINE_OPTIONS)
        try:
            result = run_batch(engine)
            result["kv_heads"] = engine.runner.pool.keys[0].shape[0]  # this rank's slice ([heads, slots, dim])
        finally:
            engine.shutdown()  # sends "stop": the workers return
    else:
        result = dataclasses.asdict(worker_loop(model_dir, group=group))
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Structured outputs: grammar compile time, per-token mask time, and decode throughput at batch 16
with every row JSON-constrained versus none (same engine, same run; target: within 10%).

Part 1 (no model run): compile a mid-size and a large JSON Schema with llguidance (the engine's
compiler: cold, then from its cache), and walk a valid document token by token timing each mask.
With --compare-xgrammar, the same for XGrammar (if installed), for the record in
docs/benchmarks.md.

Part 2: 16 chat prompts decoded together for --max-tokens tokens, greedy; rounds alternate
unconstrained and constrained (a schema that cannot complete within --max-tokens, so every row
stays constrained to the end). Decode throughput counts only pure decode steps (every row one
token), so prefill is left out of both.

    python bench/structured_output.py [--model default] [--batch 16] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

MID_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
        },
        "projects": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "status": {"enum": ["open", "closed"]}},
                "required": ["title", "year", "status"],
            },
        },
    },
    "required": ["id", "name", "email", "role", "active", "score", "tags", "address", "projects"],
}
MID_DOCUMENT = {
    "id": 12, "name": "Ada Lovelace", "email": "ada@math.com", "role": "admin", "active": True, "score": 99.5,
    "tags": ["math", "engines"], "address": {"street": "1 St James Sq", "city": "London", "zip": "12345", "country": "FR"},
    "projects": [{"title": "Notes", "year": 1843, "status": "closed"}, {"title": "Engine", "year": 1840, "status": "open"}],
}  # fmt: skip
# Every row stays constrained: at least 20 people cannot be written in 64 tokens.
PEOPLE = {
    "type": "array",
    "minItems": 20,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
TOPICS = ["scientists", "painters", "chefs", "pilots", "poets", "sailors", "doctors", "singers"]


def large_schema(num_objects: int = 40) -> dict:
    """A large schema: ``num_objects`` object types of 10 typed fields each, referenced from one root."""
    defs = {
        f"T{i}": {
            "type": "object",
            "properties": {f"f{j}": [{"type": "string"}, {"type": "integer"}, {"enum": ["a", "b", f"c{i}"]}][j % 3] for j in range(10)},
            "required": [f"f{j}" for j in range(10)],
            "additionalProperties": False,
        }
        for i in range(num_objects)
    }
    props = {f"p{i}": {"$ref": f"#/$defs/T{i}"} for i in range(num_objects)}
    return {"$defs": defs, "type": "object", "properties": props, "additionalProperties": False}


# ---------------------------------------------------------------------------------------------


def bench_llguidance(tokenizer, eos: list[int]) -> dict:
    import numpy as np

    from vllm_mlx.structured import StructuredOutputsParams
    from vllm_mlx.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, eos)
    start = time.perf_counter()
    _ = compiler.vocab_size  # the tokenizer, built once per engine
    tokenizer_s = time.perf_counter() - start
    result = {"tokenizer_s": tokenizer_s}
    compiler.compile(StructuredOutputsParams(json={"type": "object"}))  # warm-up, untimed
    for name, schema in (("mid", MID_SCHEMA), ("large", large_schema())):
        params = StructuredOutputsParams(json=schema)
        start = time.perf_counter()
        compiled = compiler.compile(params)
        result[f"{name}_compile_ms"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiler.compile(params)
        result[f"{name}_cached_ms"] = (time.perf_counter() - start) * 1e3
    matcher = compiler.compile(StructuredOutputsParams(json=MID_SCHEMA)).new_matcher()
    ids = list(tokenizer.encode(json.dumps(MID_DOCUMENT), add_special_tokens=False)) + [eos[0]]
    mask = np.zeros((1, (compiled.vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    result.update(_mask_stats(times))
    return result


def bench_xgrammar(tokenizer, eos: list[int]) -> dict:
    import xgrammar as xgr

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=eos)
    result = {"tokenizer_s": time.perf_counter() - start}
    compiler = xgr.GrammarCompiler(info, cache_enabled=True)
    compiler.compile_json_schema(json.dumps({"type": "object"}))  # warm-up, untimed
    for name, schema in (("mid", MID_SCHEMA), ("large", large_schema())):
        start = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema))
        result[f"{name}_compile_ms"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema))
        result[f"{name}_cached_ms"] = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(MID_SCHEMA)))
    ids = list(tokenizer.encode(json.dumps(MID_DOCUMENT), add_special_tokens=False)) + [eos[0]]
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    del compiled
    result.update(_mask_stats(times))
    return result


def bench_step_masks(tokenizer, eos: list[int], batch: int, steps: int = 40) -> dict:
    """Per-step cost of the engine's batch mask for ``batch`` constrained rows walking the same
    valid document: build (sync the matchers + fill the bitmask) and apply (the MLX expression
    on [batch, vocab] logits, evaluated)."""
    import mlx.core as mx

    from vllm_mlx.core.request import Request
    from vllm_mlx.executor.bitmask import StepMasks
    from vllm_mlx.structured import StructuredOutputsParams
    from vllm_mlx.structured.grammar import GrammarCompiler
    from vllm_mlx.structured.matcher import RequestConstraint

    compiled = GrammarCompiler(tokenizer, eos).compile(StructuredOutputsParams(json=MID_SCHEMA))
    ids = list(tokenizer.encode(json.dumps(MID_DOCUMENT), add_special_tokens=False))[:steps]
    requests = [Request(f"r{i}", [1], constraint=RequestConstraint(compiled, eos)) for i in range(batch)]
    logits = mx.random.normal((batch, compiled.vocab_size))
    build_s = apply_s = 0.0
    for token in ids:
        start = time.perf_counter()
        masks = StepMasks.build(requests)
        build_s += time.perf_counter() - start
        start = time.perf_counter()
        mx.eval(masks.apply(logits))
        apply_s += time.perf_counter() - start
        for r in requests:
            r.output_token_ids.append(token)
    return {"build_ms": build_s / len(ids) * 1e3, "apply_ms": apply_s / len(ids) * 1e3}


def _mask_stats(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "mask_tokens": len(times),
        "mask_mean_us": statistics.fmean(times) * 1e6,
        "mask_p50_us": ordered[len(ordered) // 2] * 1e6,
        "mask_max_us": ordered[-1] * 1e6,
    }


# ---------------------------------------------------------------------------------------------


def decode_round(engine, prompts: list[list[int]], params) -> tuple[float, int]:
    """(seconds spent in pure decode steps, tokens they produced) for one batch."""
    ids = [engine.add_request(p, params) for p in prompts]
    decode_s, decode_tokens, outputs = 0.0, 0, {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        elapsed = time.perf_counter() - start
        record = engine.step_records[-1] if engine.step_records else None
        if record is not None and record.num_new_tokens and all(n == 1 for n in record.num_new_tokens):
            decode_s += elapsed
            decode_tokens += len(record.num_new_tokens)
        engine.step_records.clear()
    errors = [outputs[i].error for i in ids if outputs[i].finish_reason == "error"]
    assert not errors, errors
    return decode_s, decode_tokens


def bench_decode(args) -> dict:
    from vllm_mlx import SamplingParams
    from vllm_mlx.engine.core import EngineCore
    from vllm_mlx.structured import StructuredOutputsParams

    engine = EngineCore(model=args.model, max_num_seqs=args.batch, force_model_takeover=True)
    questions = [f"List {TOPICS[i % len(TOPICS)]} (name, age, city) as JSON, example {i}." for i in range(args.batch)]
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(json=PEOPLE))
    decode_round(engine, prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    totals = {"free": [0.0, 0], "json": [0.0, 0]}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("json", constrained)):
            seconds, tokens = decode_round(engine, prompts, params)
            totals[name][0] += seconds
            totals[name][1] += tokens
    engine.shutdown()
    rates = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    return {"free_tok_s": rates["free"], "json_tok_s": rates["json"], "ratio": rates["json"] / rates["free"]}


def print_grammar_table(results: dict[str, dict]) -> None:
    print("grammar engine | tokenizer (s) | mid schema compile (ms) | cached | large schema compile (ms) | cached "
          "| mask mean / p50 / max (us)")  # fmt: skip
    for name, r in results.items():
        print(
            f"{name} | {r['tokenizer_s']:.2f} | {r['mid_compile_ms']:.2f} | {r['mid_cached_ms']:.3f} | "
            f"{r['large_compile_ms']:.2f} | {r['large_cached_ms']:.3f} | "
            f"{r['mask_mean_us']:.1f} / {r['mask_p50_us']:.1f} / {r['mask_max_us']:.0f} ({r['mask_tokens']} tokens)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare-xgrammar", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()

    import vllm_mlx  # noqa: F401  (before anything imports MLX: the CPU backend's BLAS)
    from mlx_lm.utils import load_tokenizer

    from vllm_mlx.models import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    eos = sorted(tokenizer.eos_token_ids)
    engines = {"llguidance": bench_llguidance}
    if args.compare_xgrammar:
        engines["xgrammar"] = bench_xgrammar
    print_grammar_table({name: bench(tokenizer, eos) for name, bench in engines.items()})
    r = bench_step_masks(tokenizer, eos, args.batch)
    print(f"engine batch mask, {args.batch} constrained rows: "
          f"build {r['build_ms']:.2f} ms, apply {r['apply_ms']:.2f} ms per step")  # fmt: skip
    if not args.skip_decode:
        r = bench_decode(args)
        print(f"decode at batch {args.batch}: unconstrained {r['free_tok_s']:.1f} tok/s, "
              f"all rows JSON-constrained {r['json_tok_s']:.1f} tok/s, ratio {r['ratio']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Automatic prefix caching in the engine: invisible in outputs, visible in work saved."""

from __future__ import annotations

import functools

import pytest

from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore, kv_budget_bytes
from vllm_mlx.llm import LLM

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DOC = "Paged attention stores keys and values in fixed-size blocks. " * 4
# Blocks of the engines here that size no pool on purpose: plenty for these prompts (no eviction),
# and cheap (the default pool of the tiny model holds half a million 4-token blocks).
POOL = 512


@pytest.fixture
def takeover_engines(engine_factory):
    """Engines on the tiny llama that may run side by side (each takes the model over)."""
    return functools.partial(engine_factory, force_model_takeover=True)


def final_output(engine: EngineCore, prompt, params=GREEDY, **kwargs):
    request_id = engine.add_request(prompt, params, **kwargs)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def token_block(seed: int, size: int = 4) -> list[int]:
    return [1000 + seed * size + i for i in range(size)]


def test_cache_on_equals_cache_off(takeover_engines):
    prompts = [DOC + q for q in ("What is a block?", "Why fixed size?", "What is a block?")]
    off = takeover_engines(enable_prefix_caching=False, block_size=4, num_kv_blocks=POOL)
    expected = [final_output(off, p).token_ids for p in prompts]
    assert off.scheduler.kv.prefix_cache.stats().hit_tokens == 0
    on = takeover_engines(block_size=4, num_kv_blocks=POOL)
    outs = [final_output(on, p) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens >= len(on.tokenizer.encode(DOC)) - 4  # the shared document
    assert outs[2].num_cached_tokens == (len(outs[2].prompt_token_ids) - 1) // 4 * 4  # all but the last block


def test_batched_requests_sharing_a_prefix_equal_cache_off(takeover_engines):
    prompts = [DOC + f"Question {i}?" for i in range(4)]
    off = takeover_engines(enable_prefix_caching=False, block_size=4, num_kv_blocks=POOL)
    expected = [final_output(off, p).token_ids for p in prompts]
    on = takeover_engines(block_size=4, num_kv_blocks=POOL)
    final_output(on, prompts[0])  # warm the document's blocks
    ids = [on.add_request(p, GREEDY) for p in prompts]
    final = {}
    while on.has_unfinished_requests():
        final.update((o.request_id, o) for o in on.step() if o.finished)
    assert [final[i].token_ids for i in ids] == expected
    assert all(final[i].num_cached_tokens > 0 for i in ids)


def test_same_tokens_after_a_different_prefix_are_not_reused(takeover_engines):
    # [A, B] and [C, D] cached; then [A, D]: A hits, D must not (its KV depends on A, not C).
    A, B, C, D, tail = token_block(0), token_block(1), token_block(2), token_block(3), [7, 8]
    on = takeover_engines(block_size=4, num_kv_blocks=POOL)
    final_output(on, A + B + tail)
    final_output(on, C + D + tail)
    out = final_output(on, A + D + tail)
    assert out.num_cached_tokens == 4
    off = takeover_engines(enable_prefix_caching=False, block_size=4, num_kv_blocks=POOL)
    assert out.token_ids == final_output(off, A + D + tail).token_ids


def test_cache_salt_keeps_tenants_apart(takeover_engines):
    engine = takeover_engines(block_size=4, num_kv_blocks=POOL)
    prompt = token_block(0) + token_block(1) + [5]
    assert final_output(engine, prompt, cache_salt="alice").num_cached_tokens == 0
    assert final_output(engine, prompt, cache_salt="bob").num_cached_tokens == 0
    assert final_output(engine, prompt, cache_salt="alice").num_cached_tokens == 8
    assert final_output(engine, prompt).num_cached_tokens == 0  # no salt is a tenant of its own


def test_reset_prefix_cache_forgets_free_blocks(takeover_engines):
    engine = takeover_engines(block_size=4, num_kv_blocks=POOL)
    prompt = token_block(0) + token_block(1) + [5]
    final_output(engine, prompt)
    assert engine.reset_prefix_cache()
    assert final_output(engine, prompt).num_cached_tokens == 0
    assert final_output(engine, prompt).num_cached_tokens == 8


def test_multi_turn_chat_computes_only_the_new_turn(takeover_engines):
    engine = takeover_engines(block_size=4, num_kv_blocks=POOL)
    tokenizer = engine.tokenizer
    messages, computed = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more about blocks."})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = final_output(engine, prompt)
        computed.append(len(prompt) - out.num_cached_tokens)
        messages.append({"role": "assistant", "content": out.text})
    new_turn_tokens = len(tokenizer.encode("<|im_start|>user\nTurn 0: tell me more about blocks.<|im_end|>\n"))
    # After the first turn, only the new turn (plus the previous answer, and < 1 block) is computed.
    assert all(c <= new_turn_tokens + 6 + 4 + 4 for c in computed[1:])
    assert computed[0] == len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True))


def test_prefix_stats_add_up(takeover_engines):
    engine = takeover_engines(block_size=4, num_kv_blocks=POOL)
    prompt = token_block(0) + token_block(1) + token_block(2) + [5]
    final_output(engine, prompt)
    final_output(engine, prompt)
    stats = engine.scheduler.kv.prefix_cache.stats()
    assert (stats.queries, stats.hits, stats.hit_tokens, stats.query_tokens) == (2, 1, 12, 26)
    assert stats.hit_rate == pytest.approx(12 / 26)
    snapshot_stats = engine.cache_snapshot()["stats"]["prefix_cache"]
    assert snapshot_stats["tokens_saved"] == 12


def test_pressure_evicts_lru_and_every_request_finishes(takeover_engines):
    engine = takeover_engines(block_size=4, num_kv_blocks=12, max_num_batched_tokens=8)
    prompts = [token_block(i) + token_block(i + 10) + [5] for i in range(6)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv_cache.check_invariants()
    assert all(final[i].finish_reason == "length" for i in ids)
    assert engine.kv_cache.stats().evictions > 0
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_kv_budget_as_a_fraction_of_memory(takeover_engines):
    assert 0 < kv_budget_bytes(0.001) < kv_budget_bytes(0.002)
    with pytest.raises(ValueError, match="fraction"):
        kv_budget_bytes(1.5)
    engine = takeover_engines(kv_cache_memory=0.001)
    assert engine.kv_cache.num_usable_blocks >= 1


def test_llm_accepts_cache_options(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=False, block_size=4, num_kv_blocks=POOL, force_model_takeover=True)
    try:
        prompt = {"prompt_token_ids": token_block(0) + token_block(1) + [5], "cache_salt": "x"}
        llm.generate(prompt, GREEDY)
        out = llm.generate(prompt, GREEDY)[0]
        assert out.num_cached_tokens == 0
        with pytest.raises(ValueError, match="unsupported prompt keys"):
            llm.generate({"prompt": "x", "images": []}, GREEDY)
    finally:
        llm.shutdown()


def test_async_engine_exposes_snapshot_and_reset(tiny_model_dir):
    from vllm_mlx.engine.async_engine import AsyncEngineCore

    with AsyncEngineCore(model=str(tiny_model_dir), block_size=4, num_kv_blocks=POOL, force_model_takeover=True) as engine:
        prompt = token_block(0) + token_block(1) + [5]
        engine.add_request(prompt, GREEDY).result()
        assert engine.add_request(prompt, GREEDY).result().num_cached_tokens == 8
        snapshot = engine.cache_snapshot()
        assert snapshot["stats"]["num_cached_free_blocks"] >= 2
        assert engine.reset_prefix_cache()
        assert engine.cache_snapshot()["stats"]["num_cached_free_blocks"] == 0

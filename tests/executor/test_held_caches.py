"""Held caches: models whose cache the engine does not page (DeepSeek-V4.1's ``LayerCache``,
LongCat-Flash-NGram's n-gram history) run with their own caches, one set per request, inside the
batch (``vllm_mlx/executor/held_caches.py``).

The oracle is mlx-lm's own generation on the same tiny model (built by the support probe from the
module's ``ModelArgs``): the engine's greedy tokens equal it batched, in prefill chunks, through
preemption, and through a failed step's re-run row by row (which must not feed a cache a token
twice); caches go with their requests (finished, aborted, preempted); prefix caching is off and
speculative decoding refused. Real MLX and mlx-lm throughout.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from oracles import engine_tokens, finish, mlx_lm_tokens, staggered_tokens
from tiny_model import build_tiny_architecture

from vllm_mlx import SamplingParams
from vllm_mlx.core.kv.spec import HeldCacheSpec
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.executor.held_caches import HeldCaches

HELD = ("deepseek_v41", "longcat_flash_ngram")
# Token ids below the tiny vocabulary's 128: lengths 20, 11, 3, 17 and 9.
PROMPTS = [
    list(range(10, 30)),
    [5, 17, 33, 9, 60, 3, 44, 100, 7, 12, 90],
    [8, 8, 21],
    [70, 71, 2, 3, 50, 51, 52, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46],
    [99, 1, 64, 32, 16, 8, 4, 2, 1],
]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module", params=HELD)
def held_model(request, tmp_path_factory):
    """(name, model directory, mlx-lm's greedy tokens for each prompt alone)."""
    name = request.param
    path = build_tiny_architecture(tmp_path_factory.mktemp(name) / name, name)
    return name, path, mlx_lm_tokens(path, PROMPTS, GREEDY.max_tokens)


def make_engine(path, **options) -> EngineCore:
    return EngineCore(model=str(path), **{"block_size": 4, "num_kv_blocks": 256, **options})


def assert_nothing_held(engine: EngineCore) -> None:
    assert len(engine.runner.held) == 0
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_batched_prompts_equal_mlx_lm_with_no_prefix_cache(held_model, caplog):
    name, path, expected = held_model
    with caplog.at_level(logging.INFO, logger="vllm_mlx"):
        engine = make_engine(path, enable_prefix_caching=True)  # asked for: turned off, not an error
    try:
        assert engine.runner.specs == [HeldCacheSpec()] and not engine.config.enable_prefix_caching
        assert any("prefix caching is off" in r.getMessage() and name in r.getMessage() for r in caplog.records)
        assert engine_tokens(engine, PROMPTS, GREEDY) == expected
        assert any(len(r.request_ids) > 1 for r in engine.step_records)  # rows shared steps
        again = engine.add_request(PROMPTS[0], GREEDY)
        output = finish(engine)[again]
        assert output.outputs[0].token_ids == expected[0] and output.num_cached_tokens == 0
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_prefill_chunks_and_preemption_equal_mlx_lm(held_model):
    """9 usable blocks of 4 tokens cannot hold five requests at once: requests are preempted,
    their caches dropped, and recomputed from their start; prompts are split into chunks."""
    _, path, expected = held_model
    engine = make_engine(path, num_kv_blocks=10, max_num_batched_tokens=8)
    try:
        def preempted_ones_dropped() -> None:
            assert len(engine.runner.held) <= len(engine.scheduler.running)

        assert staggered_tokens(engine, PROMPTS, GREEDY, after_step=preempted_ones_dropped) == expected
        assert engine.scheduler.num_preemptions > 0
        assert max(n for r in engine.step_records for n in r.num_new_tokens) <= 8
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_a_failed_step_rerun_row_by_row_feeds_no_token_twice(held_model):
    """The step fails after every row's forward fed its caches (sampling raises for the bad
    request); each request is then run alone from where it was. The good requests' caches saw
    the failed step's tokens already: they are rebuilt (neither class trims: fresh caches, the
    earlier tokens fed again in the same call), so the good requests still equal mlx-lm."""
    _, path, expected = held_model
    engine = make_engine(path, max_num_batched_tokens=16)
    sample = engine.runner._sample
    failures = []

    def sample_then_fail(sampled, logits, output):
        if any(s.request_id == "bad" for s in sampled):
            failures.append([s.request_id for s in sampled])
            raise RuntimeError("injected fault")
        return sample(sampled, logits, output)

    engine.runner._sample = sample_then_fail
    held_row, recomputed = engine.runner.held.row, []

    def recorded_row(*args):
        row = held_row(*args)
        recomputed.append(row.num_recomputed)
        return row

    engine.runner.held.row = recorded_row
    try:
        good = [engine.add_request(p, GREEDY, f"good-{i}") for i, p in enumerate(PROMPTS[:3])]
        engine.step()  # the good requests are mid-prefill, their caches hold tokens
        engine.add_request(PROMPTS[3], GREEDY, "bad")
        final = finish(engine)
        assert any(len(ids) > 1 for ids in failures)  # a batched step failed, then the rows alone
        assert final["bad"].finish_reason == "error"
        assert [final[i].outputs[0].token_ids for i in good] == expected[:3]
        assert max(recomputed) > 0  # a good request's cache was rebuilt
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_caches_go_with_finished_and_aborted_requests(held_model):
    _, path, expected = held_model
    engine = make_engine(path)
    try:
        for _ in range(3):  # no growth over requests
            assert engine_tokens(engine, PROMPTS[:2], GREEDY) == expected[:2]
            assert_nothing_held(engine)
        aborted = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        engine.step()
        assert aborted in engine.runner.held and engine.runner.held.nbytes > 0
        engine.abort_request(aborted)
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_speculative_decoding_is_refused_saying_why(held_model):
    _, path, _ = held_model
    with pytest.raises(ValueError, match="speculative_config: .*keeps a cache of its own per request"):
        make_engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = make_engine(path)
    try:
        with pytest.raises(ValueError, match="speculative decoding: .*rejected tokens"):
            engine.add_request(PROMPTS[0], GREEDY, speculative=True)
    finally:
        engine.shutdown()


def test_the_pool_is_sized_from_the_held_caches_bytes_per_token(held_model):
    """The blocks hold no arrays; they are counted from what a token costs in the held caches, so
    the block budget bounds the held memory."""
    _, path, _ = held_model
    engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=1 << 20)
    try:
        [group] = engine.kv_layout.groups
        assert group.spec == HeldCacheSpec() and group.bytes_per_token > 0
        assert engine.kv_cache.num_blocks == (1 << 20) // (group.bytes_per_token * 4) + 1
        assert engine.runner.pool.nbytes == 0
    finally:
        engine.shutdown()


def test_a_trimmable_cache_is_trimmed_back_not_rebuilt(tmp_path):
    """Where every cache can trim (plain KVCaches), a cache that saw more than a row's start is
    trimmed back to it and kept; a cache fed an unknown count (a call that failed midway) is made
    fresh, the request's earlier tokens fed first."""
    import mlx_lm

    model, _ = mlx_lm.load(str(build_tiny_architecture(tmp_path / "llama", "llama")))
    held = HeldCaches(model)
    tokens = list(range(10, 30))
    row = held.row("r", tokens, 0, tokens[:12])
    held.feeding("r")
    mx.eval(model(mx.array([row.tokens]), cache=row.caches))
    held.fed("r", 12)
    again = held.row("r", tokens, 8, tokens[8:12])  # the step re-run from 8
    assert again.caches is row.caches and again.num_recomputed == 0 and again.caches[0].offset == 8
    held.feeding("r")  # this call fails midway: the count is unknown
    fresh = held.row("r", tokens, 8, tokens[8:12])
    assert fresh.caches is not row.caches and fresh.tokens == tokens[:12] and fresh.num_recomputed == 8
    held.keep_only([])
    assert len(held) == 0


def test_a_lora_adapter_applies_to_held_rows(tmp_path):
    """LoRA works as in the paged path: an adapter's rows and the base model's, in one batch, each
    equal mlx-lm with that adapter (or none) alone."""
    from lora_adapters import write_mlx_lm_adapter

    from vllm_mlx.lora.request import LoRARequest

    path = build_tiny_architecture(tmp_path / "deepseek_v41", "deepseek_v41")
    keys = ["self_attn.q_b_proj", "mlp.shared_experts.down_proj"]
    adapter = write_mlx_lm_adapter(path, tmp_path / "adapter", rank=4, scale=2.0, seed=1, keys=keys)
    expected = mlx_lm_tokens(path, PROMPTS[:2], GREEDY.max_tokens, adapter_path=adapter)
    base = mlx_lm_tokens(path, PROMPTS[:2], GREEDY.max_tokens)
    assert expected != base, "the adapter changes nothing: no oracle"
    engine = make_engine(path, enable_lora=True, max_lora_rank=8)
    try:
        lora = LoRARequest("held", 1, str(adapter))
        ids = [engine.add_request(p, GREEDY, lora_request=lora) for p in PROMPTS[:2]]
        ids += [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
        final = finish(engine)
        assert [final[i].outputs[0].token_ids for i in ids] == expected + base
        assert_nothing_held(engine)
    finally:
        engine.shutdown()

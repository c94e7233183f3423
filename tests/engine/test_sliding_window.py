"""Sliding-window attention in the paged engine: gemma3_text, gpt_oss (attention sinks, MoE) and
a llama with ``layer_types``, each with sliding (window 8) and full layers.

The oracle is mlx-lm itself: greedy tokens of our engine equal ``mlx_lm.stream_generate``'s on the
same directory, however requests arrive, are chunked, hit the prefix cache or are preempted. A
wider window gives mlx-lm other tokens on these prompts, so the window really is under test.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from oracles import engine_tokens
from oracles import mlx_lm_tokens
from tiny_model import TINY_GEMMA3, TINY_GPT_OSS, build_tiny_llama

from vllm_mlx import SamplingParams
from vllm_mlx.core.kv.spec import FullAttentionSpec, LayerGroup, SlidingWindowSpec, group_layers
from vllm_mlx.engine.core import kv_bytes_per_token, kv_shape
from vllm_mlx.executor.attention import BatchLayout, KVPool, MLXAttentionBackend, RowSpec, layer_specs

WINDOW = 8
ARCHS = {
    "gemma3_text": TINY_GEMMA3,
    "gpt_oss": TINY_GPT_OSS,
    "llama": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW},
}
PROMPTS = [
    "Hello",  # shorter than the window
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "A much longer prompt " * 6,
    "Sliding windows forget the distant past but remember the recent tokens well. " * 4,  # ~8 windows
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FULL, SWA = FullAttentionSpec(), SlidingWindowSpec(WINDOW)


@pytest.fixture(scope="module", params=list(ARCHS))
def windowed_arch(request, tmp_path_factory, default_model_dir):
    """(model directory, mlx-lm's greedy tokens for PROMPTS) of one architecture."""
    name = request.param
    path = build_tiny_llama(tmp_path_factory.mktemp(name), default_model_dir, **ARCHS[name])
    wide = build_tiny_llama(
        tmp_path_factory.mktemp(f"{name}-wide"), default_model_dir, **{**ARCHS[name], "sliding_window": 4096}
    )
    expected = mlx_lm_tokens(path, PROMPTS, GREEDY.max_tokens)
    # The window changes the output: it is under test.
    assert expected != mlx_lm_tokens(wide, PROMPTS, GREEDY.max_tokens)
    return path, expected


@pytest.fixture
def windowed_engines(engine_factory, windowed_arch):
    """``make(**options)``: an ``EngineCore`` on this windowed architecture's model, shut down after the test."""
    return functools.partial(engine_factory, windowed_arch[0])


# -- layer specs ------------------------------------------------------------------------------


def test_layer_specs_follow_the_model(windowed_arch):
    import mlx_lm

    model, _ = mlx_lm.load(str(windowed_arch[0]))
    specs = layer_specs(model)
    expected = {"gemma3_text": [SWA, FULL] * 2, "gpt_oss": [SWA, FULL] * 2, "llama": [SWA, FULL]}
    assert specs == expected[model.model_type]
    assert group_layers(specs)[0] == LayerGroup(SWA, tuple(range(0, len(specs), 2)))


# -- the mask ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_computed,num_new", [(0, 5), (0, 20), (3, 6), (13, 1), (13, 9), (30, 4)])
def test_window_mask_is_mlx_lms_causal_window(num_computed, num_new):
    from mlx_lm.models.base import create_causal_mask

    row = RowSpec(list(range(num_new)), num_computed, block_ids=list(range(1, 12)))
    layout = BatchLayout.build([row], block_size=4)
    view = layout.keys(WINDOW)
    ours = np.array(layout.mask(WINDOW, WINDOW))[0, 0]  # (T, L) over keys start .. context
    theirs = np.array(create_causal_mask(num_new, num_computed, window_size=WINDOW))  # over 0 .. context
    start = int(view.start[0])
    assert start == max(0, num_computed - WINDOW + 1)
    assert (theirs[:, :start] == False).all()  # noqa: E712 (nothing before the gathered keys)
    assert (ours == theirs[:, start:]).all()
    assert ours.sum(-1).max() == WINDOW or num_computed + num_new <= WINDOW


def test_padded_rows_see_a_key_and_masks_are_built_once_per_window():
    rows = [RowSpec([1] * 6, 20, list(range(1, 8))), RowSpec([2], 3, [8])]  # row 1: padded to 6
    pool = KVPool(num_layers=4, num_blocks=9, block_size=4)
    caches = MLXAttentionBackend(pool, [SWA, FULL, SWA, FULL]).make_caches(rows)
    swa_mask = caches[0].make_mask(6, window_size=WINDOW)
    assert caches[2].make_mask(6, window_size=WINDOW) is swa_mask
    assert caches[1].make_mask(6) is caches[3].make_mask(6) is not swa_mask
    assert swa_mask.shape == (2, 1, 6, WINDOW - 1 + 6)  # row 0 gathers keys 13 .. 25 only
    assert caches[1].make_mask(6).shape == (2, 1, 6, 26)
    assert np.array(swa_mask).any(-1).all()  # every query (padding too) sees some key
    assert (np.array(swa_mask)[1, 0, 0] == [True] * 4 + [False] * 9).all()  # row 1's real query


# -- engine == mlx-lm -------------------------------------------------------------------------


def test_batched_chunked_prefill_equals_mlx_lm(windowed_engines, windowed_arch):
    engine = windowed_engines(block_size=4, num_kv_blocks=256, max_num_batched_tokens=11)  # chunks split windows
    assert engine_tokens(engine, PROMPTS, GREEDY) == windowed_arch[1]
    assert max(len(r.request_ids) for r in engine.step_records) > 1
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_staggered_arrivals_and_preemption_equal_mlx_lm(windowed_engines, windowed_arch):
    # 31 usable blocks of 4 tokens cannot hold the five requests at once (each holds all its
    # blocks in the full-attention group, up to 7 in the sliding one): preemption happens.
    engine = windowed_engines(block_size=4, num_kv_blocks=32, max_num_batched_tokens=16)
    request_ids, final = [], {}
    for step in range(5000):
        if step % 3 == 0 and len(request_ids) < len(PROMPTS):
            request_ids.append(engine.add_request(PROMPTS[len(request_ids)], GREEDY))
        elif not engine.has_unfinished_requests():
            break
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [final[i].outputs[0].token_ids for i in request_ids] == windowed_arch[1]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_prefix_cache_on_equals_off(windowed_engines):
    doc = PROMPTS[4]
    prompts = [doc + q for q in ("What is a window?", "Why slide?", "What is a window?")]
    off_engine = windowed_engines(enable_prefix_caching=False, block_size=16)
    off = engine_tokens(off_engine, prompts, GREEDY)
    off_engine.shutdown()  # one engine per model at a time
    on = windowed_engines(block_size=16)
    outs = []
    for p in prompts:  # one after another: each hits the blocks the earlier ones left
        rid = on.add_request(p, GREEDY)
        while on.has_unfinished_requests():
            outs += [o for o in on.step() if o.finished and o.request_id == rid]
    assert [o.outputs[0].token_ids for o in outs] == off
    assert outs[1].num_cached_tokens >= 3 * 16 > WINDOW  # hits reach past several windows


def test_default_block_size_equals_mlx_lm(windowed_engines, windowed_arch):
    assert engine_tokens(windowed_engines(), PROMPTS, GREEDY) == windowed_arch[1]


def test_window_blocks_return_to_the_pool_during_a_long_generation(windowed_engines, windowed_arch):
    """The sliding group's table keeps only the blocks its window reaches: the rest are the null
    block and back in the pool while the request decodes; the output is still mlx-lm's."""
    prompt, max_tokens = PROMPTS[4], 40
    expected = mlx_lm_tokens(windowed_arch[0], [prompt], max_tokens)[0]
    # A pool of 64 blocks holds the request (~100 tokens) with room to spare; the default pool (a
    # million blocks of 4 tokens) would make each step's invariant check walk a million blocks.
    engine = windowed_engines(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    held, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
        tables = engine.kv_cache.get_block_tables(request_id)
        if tables:
            full, sliding = tables
            live = [b for b in sliding if b]
            assert len(live) <= -(-(WINDOW - 1 + 16) // 4) + 1 and sliding[-len(live) :] == live
            usage = engine.cache_snapshot(include_blocks=False)["block_groups"]  # what the inspector shows
            assert [g["num_used_blocks"] for g in usage] == [len(full), len(live)]
            held.append((len(full), len(live)))
        engine.kv_cache.check_invariants()
    assert final.outputs[0].token_ids == expected
    assert held[-1][0] > 20 and held[-1][1] <= 3  # ~100 tokens in full, a window and a block in sliding
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_random_joins_aborts_and_preemptions_leak_no_block(windowed_engines):
    import random

    engine = windowed_engines(block_size=4, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=12)
    rng, live = random.Random(0), []
    for _ in range(150):
        action = rng.random()
        if action < 0.3:
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0)
            live.append(engine.add_request(rng.choice(PROMPTS), params))
        elif action < 0.4 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.kv_cache.check_invariants()
        engine.scheduler.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.stats().num_used_blocks == 0 and engine.scheduler.num_preemptions > 0
    engine.kv_cache.check_invariants()


# -- sizing -----------------------------------------------------------------------------------


def test_kv_sizing_matches_the_pool(windowed_engines):
    engine = windowed_engines(block_size=4, num_kv_blocks=64)
    engine_tokens(engine, PROMPTS[:1], GREEDY)
    pool, block_groups = engine.runner.pool, engine.runner.block_groups
    # Sliding and full layers store the same shapes: one array per pair, one table per group.
    assert [g.window for g in block_groups.groups] == [None, WINDOW] and block_groups.num_arrays * 2 == len(engine.runner.specs)
    assert pool.nbytes == engine.kv_layout.bytes_per_token // 2 * pool.num_slots
    assert engine.kv_layout.bytes_per_token == kv_bytes_per_token(engine.model_config, 4, engine.runner.model)
    groups = engine.cache_snapshot(include_blocks=False)["kv_groups"]
    assert sorted((g["kind"], g["window"]) for g in groups) == [("full_attention", None), ("sliding_window", WINDOW)]
    assert sorted(i for g in groups for i in g["layers"]) == list(range(len(engine.runner.specs)))


def test_kv_shape_takes_missing_keys_from_the_model():
    import mlx_lm.models.gemma3_text as gemma3

    config = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 32,
              "intermediate_size": 64, "sliding_window_pattern": 2}  # fmt: skip
    model = gemma3.Model(gemma3.ModelArgs.from_dict(config))
    assert kv_shape(config, model).head_dim == 256  # gemma3's default, not 64 // heads
    assert kv_bytes_per_token(config, 2, model) == 2 * 2 * 1 * 256 * 2  # K+V, 2 layers, 1 KV head


def test_layout_writes_then_reads_the_window_through_the_pool():
    """A sliding layer's keys come back from the right slots: positions start .. context."""
    pool = KVPool(num_layers=1, num_blocks=6, block_size=4)
    backend = MLXAttentionBackend(pool, [SWA])
    blocks = [3, 1, 5, 2, 4]

    def forward(num_computed: int, num_new: int) -> list[float]:
        cache = backend.make_caches([RowSpec([0] * num_new, num_computed, blocks)])[0]
        keys = (mx.arange(num_new, dtype=mx.float32) + num_computed).reshape(1, 1, num_new, 1)  # key = position
        return cache.update_and_fetch(keys, keys)[0].reshape(-1).tolist()

    assert forward(0, 12) == list(range(12))
    assert forward(12, 6) == list(range(12 - WINDOW + 1, 18))
    assert forward(18, 1) == list(range(18 - WINDOW + 1, 19))


def test_a_kv_shared_layer_reads_the_keys_of_this_call_through_state_without_writing():
    """mlx-vlm's Gemma 3n shares KV as ``cache.state`` (mlx-lm's models call ``keys_and_values()``): both give
    what the layer's ``update_and_fetch`` returned in this call, ``state`` read-only, and neither writes."""
    pool = KVPool(num_layers=1, num_blocks=6, block_size=4)
    cache = MLXAttentionBackend(pool, [SWA]).make_caches([RowSpec([0] * 5, 0, [3, 1])])[0]
    with pytest.raises(RuntimeError, match="read before this forward call wrote them"):
        _ = cache.state
    keys = mx.arange(5, dtype=mx.float32).reshape(1, 1, 5, 1)
    fetched = cache.update_and_fetch(keys, keys + 10)
    before = [np.array(a) for a in (pool.keys[0], pool.values[0])]
    assert cache.state is cache.keys_and_values() is fetched
    assert all(np.array_equal(b, np.array(a)) for b, a in zip(before, (pool.keys[0], pool.values[0])))
    with pytest.raises(AttributeError):
        cache.state = fetched


def test_chunked_attention_layers_are_stored_as_full_attention_and_fetched_from_their_chunk():
    """Llama 4's layout, three chunked layers to one full: all page as full attention (every
    block kept), and a chunked layer fetches, for its one row, the keys from the start of the
    first query's chunk (the model masks the rest itself; tests/models/test_architecture_sweep.py
    holds the whole model to mlx-lm)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    from vllm_mlx.core.kv.spec import FullAttentionSpec
    from vllm_mlx.executor.attention import BatchLayout, ChunkedLayerCache, KVPool, RowSpec, chunk_sizes

    class Llama4Caches:  # only make_cache() is asked
        model_type = "llama4"

        def make_cache(self):
            return [ChunkedKVCache(8), ChunkedKVCache(8), ChunkedKVCache(8), KVCache()]

    assert layer_specs(Llama4Caches()) == [FullAttentionSpec()] * 4
    assert chunk_sizes(Llama4Caches()) == {0: 8, 1: 8, 2: 8}
    pool = KVPool(1, num_blocks=8, block_size=4)
    row = RowSpec(tokens=list(range(3)), num_computed=18, block_ids=[1, 2, 3, 4, 5, 6])
    cache = ChunkedLayerCache(pool, 0, BatchLayout.build([row], 4, host_offset=True), chunk=8)
    assert (cache.offset, cache.start_position) == (18, 16)
    keys, _ = cache.update_and_fetch(*[mx.ones((1, 1, 3, 2))] * 2)
    assert keys.shape == (1, 1, 21 - 16, 2)  # positions 16..20: the chunk the queries 18..20 are in
    with pytest.raises(ValueError, match="one row per forward call"):
        ChunkedLayerCache(pool, 0, BatchLayout.build([row, row], 4), chunk=8)

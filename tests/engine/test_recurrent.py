"""Hybrid recurrent models in the paged engine: LFM2 (short convolutions), Qwen3.5 and Qwen3-Next
(gated delta-nets), granitemoehybrid and nemotron_h (Mamba-2), each with attention layers too.

The oracle is mlx-lm itself: greedy tokens of our engine equal ``mlx_lm.stream_generate``'s on the
same directory, however requests arrive, are padded into shared forward calls, chunked,
preempted or re-run after a failed step. The recurrent state lives in a slot per running
request, owned through the KV manager's front door: no slot outlives its request. Prefix hits
resume from state checkpoints kept at block boundaries: caching on equals caching off, and a
conversation's next turn resumes where the previous answer's last full block ended.
"""

from __future__ import annotations

import random

import functools

import mlx.core as mx
import numpy as np
import pytest
from oracles import engine_tokens, finish, staggered_tokens
from oracles import mlx_lm_tokens
from tiny_model import (
    TINY_GRANITE_HYBRID,
    TINY_LFM2,
    TINY_NEMOTRON_H,
    TINY_QWEN3_5,
    TINY_QWEN3_NEXT,
    build_tiny_llama,
)

from vllm_mlx import SamplingParams
from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.spec import FullAttentionSpec, HeldCacheSpec, RecurrentStateSpec
from vllm_mlx.engine.core import EngineCore, kv_bytes_per_token
from vllm_mlx.executor import model_runner
from vllm_mlx.executor.attention import RECURRENT_ARCHITECTURES, UnsupportedModelError, check_supported, layer_specs
from vllm_mlx.executor.state_pool import RecurrentLayerCache, StateArray, StateBatch, StateLayout, StatePool

ARCHS = {
    "lfm2": TINY_LFM2,
    "qwen3_5": TINY_QWEN3_5,
    "qwen3_next": TINY_QWEN3_NEXT,
    "granitemoehybrid": TINY_GRANITE_HYBRID,
    "nemotron_h": TINY_NEMOTRON_H,
}
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "A much longer prompt " * 6,
]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# Blocks of the engines here that size no pool on purpose: plenty for these prompts, and cheap (the
# default pool of a tiny model holds half a million 4-token blocks, costing seconds per engine).
POOL = 512
FULL = FullAttentionSpec()


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory, default_model_dir):
    """(name, model directory, mlx-lm's greedy tokens for PROMPTS) of one architecture."""
    name = request.param
    path = build_tiny_llama(tmp_path_factory.mktemp(name), default_model_dir, **ARCHS[name])
    return name, path, mlx_lm_tokens(path, PROMPTS, GREEDY.max_tokens)


@pytest.fixture
def recurrent_engines(engine_factory, arch):
    """``make(**options)``: an ``EngineCore`` on this architecture's model, shut down after the test."""
    return functools.partial(engine_factory, arch[1])


def load_tokenizer(path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


def assert_nothing_held(engine: EngineCore) -> None:
    stats = engine.kv_cache.stats()
    assert stats.num_used_blocks == 0 and stats.num_used_state_slots == 0
    engine.kv_cache.check_invariants()
    engine.scheduler.check_invariants()


# -- what the engine accepts ------------------------------------------------------------------


def test_layer_specs_name_the_recurrent_layers(arch):
    import mlx_lm

    name, path, _ = arch
    model, _ = mlx_lm.load(str(path))
    specs = layer_specs(model)
    state = RecurrentStateSpec(1 if name == "lfm2" else 2, pads=RECURRENT_ARCHITECTURES[name])
    expected = {
        "lfm2": [state, FULL],
        "nemotron_h": [state, FULL, state],  # its MLP layer has no cache
    }.get(name, [state, FULL] * 2)
    assert specs == expected


def test_unchecked_recurrent_architectures_are_held_per_request_or_refused_naming_the_cache():
    """Recurrent layers are served from the state pool for the architectures checked against mlx-lm
    (by model type, aliases as mlx-lm maps them); the same layers under an unchecked name keep the
    model's own caches per request (``HeldCacheSpec``: ``executor/held_caches.py``), and the vLLM
    plugin's path, which serves neither, refuses them naming the cache."""
    import mlx_lm.models.mamba as mamba

    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=32, hidden_size=64, intermediate_size=64, state_size=16,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
    )  # fmt: skip
    model = mamba.Model(args)
    assert check_supported(model) == [RecurrentStateSpec(2, pads=False)] * 2  # a pure recurrent model
    assert check_supported(model, "falcon_mamba") == check_supported(model)
    assert check_supported(model, "mamba3") == [HeldCacheSpec()]
    with pytest.raises(UnsupportedModelError, match="'mamba3' needs ArraysCache caches"):
        check_supported(model, "mamba3", recurrent=False)


def test_the_vllm_plugin_path_still_refuses_recurrent_layers(tmp_path, default_model_dir):
    import mlx_lm

    model, _ = mlx_lm.load(str(build_tiny_llama(tmp_path / "lfm2", default_model_dir, **TINY_LFM2)))
    assert isinstance(check_supported(model)[0], RecurrentStateSpec)
    with pytest.raises(UnsupportedModelError, match="'lfm2' needs ArraysCache") as refused:
        check_supported(model, recurrent=False)
    assert "vllm-mlx's own engine serves them" in str(refused.value)


# -- engine == mlx-lm -------------------------------------------------------------------------


def test_prompts_arriving_together_equal_mlx_lm(recurrent_engines, arch):
    name, _, expected = arch
    engine = recurrent_engines()
    assert engine_tokens(engine, PROMPTS, GREEDY) == expected
    first = engine.step_records[0]  # every prompt prefilled in one step, in as few calls as allowed
    assert len(first.request_ids) == len(PROMPTS)
    distinct_lengths = len(set(first.num_new_tokens))
    if RECURRENT_ARCHITECTURES[name]:
        assert first.num_forward_calls < distinct_lengths  # some rows were padded
    else:
        assert first.num_forward_calls == distinct_lengths  # never padded
    assert_nothing_held(engine)


def test_chunked_prefill_carries_the_state_across_chunks(recurrent_engines, arch):
    engine = recurrent_engines(block_size=4, num_kv_blocks=POOL, max_num_batched_tokens=11)
    assert engine_tokens(engine, PROMPTS, GREEDY) == arch[2]
    chunks = [n for r in engine.step_records for n in r.num_new_tokens if n > 1]
    assert chunks and max(chunks) <= 11 and len(chunks) > len(PROMPTS)  # prompts were split
    assert_nothing_held(engine)


def test_staggered_arrivals_and_preemption_equal_mlx_lm(recurrent_engines, arch):
    # 13 usable blocks of 4 tokens cannot hold the five requests at once: preemption happens.
    engine = recurrent_engines(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert staggered_tokens(engine, PROMPTS, GREEDY, after_step=engine.kv_cache.check_invariants) == arch[2]
    assert engine.scheduler.num_preemptions > 0
    assert_nothing_held(engine)


def test_without_checkpoints_a_recurrent_model_gets_no_prefix_hit(recurrent_engines, arch):
    """``max_state_checkpoints=0``: the state at a hit point is never kept, so no hit."""
    prompt = PROMPTS[4] + "What is a state?"
    on = recurrent_engines(block_size=4, num_kv_blocks=POOL, max_state_checkpoints=0)
    outs = run_one_by_one(on, [prompt, prompt])
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert not on.kv_cache.resumes_prefixes and on.runner.state_pool.num_slots == on.config.max_num_seqs + 1


@pytest.mark.parametrize("block_size", [64, 4])
def test_a_failed_step_is_rerun_from_the_state_before_it(recurrent_engines, arch, block_size, monkeypatch):
    """A step fails in its last forward call (the bad request's decode row) after a good request,
    mid-prefill with state already in its slot, computed (and held) its next state; each request
    is then re-run alone. Had the held state been written, the good request would advance its
    state twice and diverge from mlx-lm. With 4-token blocks, steps also keep state checkpoints:
    the failed one's are never published, the re-runs' are."""
    monkeypatch.setattr(model_runner, "CALL_COST_TOKENS", 0)  # no padding: the decode row gets its own call
    engine = recurrent_engines(max_num_batched_tokens=16, block_size=block_size)
    forward = engine.runner._forward
    calls: list[list[tuple[str, int]]] = []

    def forward_then_fail(group, states):
        calls.append([(s.request_id, s.num_computed_tokens) for s in group])
        out = forward(group, states)
        if any(s.request_id == "bad" and s.num_computed_tokens > 0 for s in group):
            raise RuntimeError("injected fault")
        return out

    engine.runner._forward = forward_then_fail
    engine.add_request(PROMPTS[0], GREEDY, "bad")
    ids = [engine.add_request(p, GREEDY, f"good-{i}") for i, p in enumerate([PROMPTS[4], PROMPTS[3]])]
    final = finish(engine)
    assert final["bad"].outputs[0].finish_reason == "error"
    assert [final[i].outputs[0].token_ids for i in ids] == [arch[2][4], arch[2][3]]
    assert_nothing_held(engine)
    if block_size == 4:  # the checkpoints the good requests kept are right: a repeat equals mlx-lm
        assert engine.kv_cache.stats().num_cached_state_checkpoints > 0
        repeat = run_one_by_one(engine, [PROMPTS[4]])[0]
        assert repeat.num_cached_tokens > 0 and repeat.outputs[0].token_ids == arch[2][4]
        return
    # 64-token blocks put no checkpoint cut in the good prompts' chunks: the layout is as meant.
    failed = next(i for i, call in enumerate(calls) if ("bad", 1) in call)
    step_start = max(i for i, call in enumerate(calls[:failed]) if "bad" in dict(call)) + 1
    same_step = [row for call in calls[step_start:failed] for row in call]
    assert any(rid.startswith("good") and computed > 0 for rid, computed in same_step)  # state was held


# -- prefix hits from state checkpoints -----------------------------------------------------


def run_one_by_one(engine: EngineCore, prompts, params=GREEDY) -> list:
    """Each prompt submitted after the previous one finished (so later ones can hit)."""
    outputs = []
    for prompt in prompts:
        request_id = engine.add_request(prompt, params)
        outputs.append(finish(engine)[request_id])
    return outputs


def caching_off_tokens(path, prompts, **options) -> list[list[int]]:
    """The tokens of ``prompts`` run one by one on an engine without prefix caching (made and
    shut down here: one engine per model at a time)."""
    engine = EngineCore(model=str(path), enable_prefix_caching=False, **options)
    try:
        return [o.outputs[0].token_ids for o in run_one_by_one(engine, prompts)]
    finally:
        engine.shutdown()


def test_prefix_hits_resume_from_state_checkpoints_and_equal_caching_off(recurrent_engines, arch):
    """The same prompt resumes from its prompt checkpoint; a prompt that shares only a prefix
    gets no hit but leaves a checkpoint at the branch point, where the next one resumes."""
    tokenizer = load_tokenizer(arch[1])
    shared = tokenizer.encode(PROMPTS[4])
    questions = [tokenizer.encode(q, add_special_tokens=False) for q in ("What is a state?", "Why recur?", "How?")]
    prompts = [shared + questions[0], shared + questions[1], shared + questions[0], shared + questions[2]]
    expected = caching_off_tokens(arch[1], prompts, block_size=4, num_kv_blocks=POOL)
    engine = recurrent_engines(block_size=4, num_kv_blocks=POOL)
    outs = run_one_by_one(engine, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    branch = len(shared) // 4 * 4  # where the blocks of the shared part end
    assert [o.num_cached_tokens for o in outs] == [0, 0, (len(prompts[0]) - 1) // 4 * 4, branch]
    assert_nothing_held(engine)


def test_a_conversation_computes_only_each_new_turn(recurrent_engines, arch):
    """Turn k+1 is turn k's prompt and answer plus a new message: it resumes from the latest
    checkpoint decode kept, the last block boundary before turn k's last computed token."""
    engine = recurrent_engines(block_size=4, num_kv_blocks=POOL)
    message = engine.tokenizer.encode(" And then?", add_special_tokens=False)
    history, turns, answers, cached = engine.tokenizer.encode(PROMPTS[1]), [], [], []
    for _ in range(4):
        out = run_one_by_one(engine, [history])[0]
        turns.append(history)
        answers.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
        history = history + out.outputs[0].token_ids + message
    computed = [len(t) + GREEDY.max_tokens - 1 for t in turns]  # a turn's last token is never computed
    assert cached == [0] + [n // 4 * 4 for n in computed[:-1]]
    assert_nothing_held(engine)
    engine.shutdown()
    assert caching_off_tokens(arch[1], turns, block_size=4, num_kv_blocks=POOL) == answers


def test_a_hit_falls_back_to_an_earlier_checkpoint_when_the_latest_was_evicted(recurrent_engines, arch):
    engine = recurrent_engines(block_size=4, num_kv_blocks=POOL)
    first = engine.tokenizer.encode(PROMPTS[4])
    answer = run_one_by_one(engine, [first])[0].outputs[0].token_ids
    follow_up = first + answer + engine.tokenizer.encode(" Why?", add_special_tokens=False)
    checkpoints = engine.kv_cache.checkpoints
    checkpoints.drop(checkpoints.keys()[-1])  # the answer's latest
    out = run_one_by_one(engine, [follow_up])[0]
    latest = (len(first) + len(answer) - 1) // 4 * 4
    assert out.num_cached_tokens == max(latest - 4, (len(first) - 1) // 4 * 4)  # the one before
    assert_nothing_held(engine)
    engine.shutdown()
    assert out.outputs[0].token_ids == caching_off_tokens(arch[1], [follow_up], block_size=4, num_kv_blocks=POOL)[0]


# -- bookkeeping ------------------------------------------------------------------------------


def test_random_joins_and_aborts_leak_no_slot_or_block(tmp_path, default_model_dir):
    path = build_tiny_llama(tmp_path / "qwen3_5", default_model_dir, **TINY_QWEN3_5)
    engine = EngineCore(model=str(path), block_size=4, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=12)
    rng = random.Random(0)
    live: list[str] = []
    try:
        for step in range(120):
            action = rng.random()
            if action < 0.3:
                live.append(engine.add_request(rng.choice(PROMPTS), SamplingParams(max_tokens=rng.randint(1, 8), temperature=0)))
            elif action < 0.45 and live:
                engine.abort_request(live.pop(rng.randrange(len(live))))
            engine.step()
            engine.kv_cache.check_invariants()
            engine.scheduler.check_invariants()
            assert engine.kv_cache.stats().num_used_state_slots == engine.scheduler.num_running
        finish(engine)
        assert_nothing_held(engine)
        assert engine.scheduler.kv.prefix_cache.stats().hits > 0  # repeated prompts resumed from checkpoints
    finally:
        engine.shutdown()


def test_finished_and_aborted_requests_leave_no_trace_in_the_cache(tmp_path, default_model_dir):
    path = build_tiny_llama(tmp_path / "qwen3_5", default_model_dir, **TINY_QWEN3_5)
    engine = EngineCore(model=str(path), block_size=4, num_kv_blocks=48, max_num_seqs=4)
    try:
        run_one_by_one(engine, [PROMPTS[4]])  # keeps checkpoints for the next one to resume from
        finished = engine.add_request(PROMPTS[4], GREEDY)
        aborted = engine.add_request(PROMPTS[3], GREEDY)
        engine.step()
        kv = engine.kv_cache
        assert kv.requests[aborted].state_slot == kv.state_slots.slot_of(aborted) is not None
        engine.abort_request(aborted)
        assert finish(engine)[finished].num_cached_tokens > 0  # it resumed from a checkpoint
        assert kv.requests == {} and kv.state_slots.owners() == {} and kv.checkpoints.snapshot()["pending"] == {}
        assert len(kv.checkpoints) > 0  # published checkpoints outlive their requests
        for structure in (kv.state, kv.state_slots, kv.checkpoints):  # nothing else names a request
            kept = repr([value for value in vars(structure).values() if value is not kv.requests])
            assert finished not in kept and aborted not in kept
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_a_state_slot_comes_with_the_first_allocation_and_goes_with_free():
    kv = PagedCacheManager(num_blocks=10, block_size=4, num_state_slots=3)  # slots 1, 2
    assert kv.allocate_slots("a", 5) == [1, 2]
    assert kv.allocate_slots("b", 1) == [3]
    assert (kv.get_state_slot("a"), kv.get_state_slot("b"), kv.get_state_slot("c")) == (1, 2, 0)
    assert kv.allocate_slots("a", 9) == [4]  # growing keeps the slot
    assert kv.allocate_slots("c", 1) is None  # no slot free: all or nothing
    assert kv.get_block_ids("c") == [] and kv.get_num_free_blocks() == 5
    kv.free("a")
    assert kv.allocate_slots("c", 1) is not None and kv.get_state_slot("c") == 1
    kv.check_invariants()
    assert kv.stats().num_used_state_slots == 2 and kv.snapshot()["state_slots"] == {"b": 2, "c": 1}


def test_recurrent_models_resume_no_prefix_without_checkpoints():
    kv = PagedCacheManager(num_blocks=10, block_size=4, num_state_slots=3)
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", [b"h1", b"h2"], list(range(8)), num_full_blocks=2)
    assert kv.get_computed_blocks("b", [b"h1", b"h2"]) == []
    assert PagedCacheManager(num_blocks=10, block_size=4).resumes_prefixes


# -- the cache object ------------------------------------------------------------------------


def test_reads_gather_slots_fresh_rows_read_zeros_and_writes_wait_for_commit():
    layout = StateLayout({0: (StateArray((2,), mx.float32), None)})
    pool = StatePool(layout, num_slots=4)
    pool.arrays[0][0] = mx.arange(8, dtype=mx.float32).reshape(4, 2)  # slot s holds [2s, 2s+1]
    batch = StateBatch.build(slots=[3, 1], num_computed=[5, 0], num_new=[2, 1])
    cache = RecurrentLayerCache(pool, 0, batch)
    assert np.array(cache[0]).tolist() == [[6, 7], [0, 0]]  # row 1 has computed nothing yet
    assert cache[1] is None  # never set by the model
    assert np.array(cache.make_mask(2)).tolist() == [[True, True], [True, False]]
    cache.advance(2)
    assert np.array(cache.lengths).tolist() == [0, -1]
    cache[0] = mx.full((2, 2), 9.0)
    assert np.array(pool.arrays[0][0][3]).tolist() == [6, 7]  # held, not written
    pool.commit(cache.writes())
    assert np.array(pool.arrays[0][0]).tolist() == [[0, 1], [9, 9], [4, 5], [9, 9]]
    unpadded = StateBatch.build(slots=[1, 2], num_computed=[0, 0], num_new=[3, 3])
    assert unpadded.mask is None and unpadded.lengths is None and RecurrentLayerCache(pool, 0, unpadded)[0] is None


def test_state_memory_comes_out_of_the_kv_budget(recurrent_engines, arch):
    budget = 8 << 20
    engine = recurrent_engines(kv_cache_memory=budget, max_num_seqs=8)
    pool = engine.runner.state_pool
    per_request = pool.layout.bytes_per_request
    # 9 running slots (the null one included), then 2 * max_num_seqs checkpoints (the tiny
    # model's states are small: half the budget holds many more).
    assert pool.num_slots == 9 + 16 and pool.nbytes == 25 * per_request
    assert engine.kv_cache.stats().num_state_checkpoints == 16
    num_attention = sum(isinstance(s, FullAttentionSpec) for s in engine.runner.specs)
    assert engine.kv_cache.num_blocks == engine.kv_layout.blocks_for_budget(budget - 25 * per_request, 16)
    # The measured layout: attention layers per token (float32 here, as the config's shapes say),
    # recurrent layers per request, in the snapshot with the slots for running requests.
    per_token = kv_bytes_per_token(engine.model_config, 4, engine.runner.model, num_layers=num_attention)
    assert engine.kv_layout.bytes_per_token == per_token
    groups = engine.cache_snapshot(include_blocks=False)["kv_groups"]
    [state] = [g for g in groups if g["kind"] == "recurrent_state"]
    assert (state["bytes_per_request"], state["state_slots"], state["bytes_per_token"]) == (per_request, 8, 0)
    assert state["state_checkpoints"] == 16
    engine.shutdown()
    with pytest.raises(ValueError, match="cannot hold the recurrent state"):
        recurrent_engines(kv_cache_memory=per_request * 9 - 1, max_num_seqs=8)
    # A tight budget gets fewer checkpoints: at most half of what is left for the KV blocks.
    per_token = engine.kv_layout.bytes_per_token  # less than 2 states: one-token blocks
    tight = recurrent_engines(kv_cache_memory=13 * per_request + per_token, max_num_seqs=8, block_size=1)
    assert tight.kv_cache.stats().num_state_checkpoints == 2
    tight.shutdown()
    with pytest.raises(ValueError, match="cannot hold 40 state checkpoints"):
        recurrent_engines(kv_cache_memory=per_request * 20, max_num_seqs=8, max_state_checkpoints=40)

"""The engine on real MLX: batched == solo, chunked prefill and preemption, sampling features.

Most tests use the tiny random-weight llama (fast); ``e2e`` ones use the real default model.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from factories import run_to_end
from oracles import staggered_tokens
from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.llm import LLM
from vllm_mlx.models.registry import ModelOwnershipError

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "Why?",
    "A much longer prompt " * 6,
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def solo_tokens(engine_factory, prompts, params=GREEDY) -> list[list[int]]:
    engine = engine_factory()
    result = []
    for prompt in prompts:
        rid = engine.add_request(prompt, params)
        result.append(run_to_end(engine)[rid].outputs[0].token_ids)
    engine.shutdown()
    return result


def test_batched_equals_solo(engine_factory):
    expected = solo_tokens(engine_factory, PROMPTS)
    engine = engine_factory()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    final = run_to_end(engine)
    assert [final[i].outputs[0].token_ids for i in ids] == expected
    assert max(len(r.request_ids) for r in engine.step_records) == len(PROMPTS)  # really batched
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_staggered_arrivals_chunked_prefill_and_preemption_equal_solo(engine_factory):
    expected = solo_tokens(engine_factory, PROMPTS)
    # 12 usable blocks of 4 tokens cannot hold all five requests: preemption must happen.
    engine = engine_factory(block_size=4, num_kv_blocks=13, max_num_batched_tokens=8)
    request_ids, final = [], {}
    for step in range(2000):
        if step % 3 == 0 and len(request_ids) < len(PROMPTS):  # a new arrival every third step
            request_ids.append(engine.add_request(PROMPTS[len(request_ids)], GREEDY))
        elif not engine.has_unfinished_requests():
            break
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        engine.kv_cache.check_invariants()
    assert [final[i].outputs[0].token_ids for i in request_ids] == expected
    assert engine.scheduler.num_preemptions > 0
    assert any(n > 1 and n < 20 for r in engine.step_records for n in r.num_new_tokens)  # chunks
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_seeded_sampling_is_the_same_alone_and_batched(engine_factory):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    engine = engine_factory()
    alone = []
    for p in params:
        rid = engine.add_request(PROMPTS[1], p)
        alone.append(run_to_end(engine)[rid].outputs[0].token_ids)
    ids = [engine.add_request(PROMPTS[1], p) for p in params] + [engine.add_request(PROMPTS[0], GREEDY)]
    final = run_to_end(engine)
    assert [final[i].outputs[0].token_ids for i in ids[:3]] == alone
    assert len({tuple(t) for t in alone}) == 3  # different seeds, different samples


def test_stop_string_across_tokens(engine_factory):
    engine = engine_factory()
    rid = engine.add_request(PROMPTS[2], GREEDY)
    full = run_to_end(engine)[rid].outputs[0].text
    stop = full[5:9]
    assert len(stop) == 4 and full.index(stop) == 5
    rid = engine.add_request(PROMPTS[2], GREEDY.clone(stop=[stop]))
    streamed = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.append(out.new_text)
            final = out
    assert final.outputs[0].text == full[:5]
    assert "".join(streamed) == full[:5]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop


def test_min_tokens_and_stop_token_ids(engine_factory):
    engine = engine_factory()
    rid = engine.add_request(PROMPTS[1], GREEDY)
    tokens = run_to_end(engine)[rid].outputs[0].token_ids
    stop_id = tokens[1]
    rid = engine.add_request(PROMPTS[1], GREEDY.clone(stop_token_ids=[stop_id]))
    out = run_to_end(engine)[rid].outputs[0]
    assert out.token_ids == tokens[:2] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens masks the stop id in the sampler: the request must run to its min length at least
    rid = engine.add_request(PROMPTS[1], GREEDY.clone(stop_token_ids=[stop_id], min_tokens=6))
    out = run_to_end(engine)[rid].outputs[0]
    assert len(out.token_ids) >= 6 and stop_id not in out.token_ids[:6]


def test_the_stopping_token_is_not_text_even_with_special_tokens_kept(engine_factory):
    """EOS and stop token ids stay in ``token_ids`` but not in the text (as vLLM): a parser
    that needs special tokens must not see ``<|im_end|>`` at the end of every answer."""
    from vllm_mlx.structured import StructuredOutputsParams

    engine = engine_factory()
    rid = engine.add_request(PROMPTS[1], GREEDY)
    tokens = run_to_end(engine)[rid].outputs[0].token_ids
    keep = GREEDY.clone(skip_special_tokens=False)
    rid = engine.add_request(PROMPTS[1], keep.clone(stop_token_ids=[tokens[1]]))
    out = run_to_end(engine)[rid].outputs[0]
    assert out.token_ids == tokens[:2] and out.text == engine.tokenizer.decode(tokens[:1])
    only_yes = keep.clone(ignore_eos=False, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    rid = engine.add_request(PROMPTS[1], only_yes)  # after "yes" only EOS is allowed
    out = run_to_end(engine)[rid].outputs[0]
    assert out.token_ids[-1] in engine.eos_token_ids and out.text == "yes"


def test_n_completions_share_the_prompt(engine_factory):
    engine = engine_factory()
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    rid = engine.add_request(PROMPTS[4], params)
    out = run_to_end(engine)[rid]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    singles = []
    for i in range(3):
        r = engine.add_request(PROMPTS[4], params.clone(n=1, seed=7 + i))
        singles.append(run_to_end(engine)[r].outputs[0].token_ids)
    assert [o.token_ids for o in out.outputs] == singles


def test_logprobs_match_a_direct_softmax(engine_factory, tiny_model_dir):
    import mlx_lm

    engine = engine_factory()
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, logprobs=5, ignore_eos=True))
    out = run_to_end(engine)[rid].outputs[0]
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 6
        assert sum(math.exp(v) for v in entry.values()) <= 1 + 1e-5
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    prompt = tokenizer.encode(PROMPTS[0])
    logits = model(mx.array([prompt]))[0, -1].astype(mx.float32)
    direct = (logits - mx.logsumexp(logits)).tolist()
    for token_id, lp in out.logprobs[0].items():
        assert lp == pytest.approx(direct[token_id], abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_prompt_too_long_fails_alone(engine_factory):
    engine = engine_factory(block_size=4, num_kv_blocks=9)  # 32 tokens of KV in all
    bad = engine.add_request(PROMPTS[4] * 3, GREEDY)
    good = engine.add_request(PROMPTS[0], GREEDY)
    final = run_to_end(engine)
    assert final[bad].finish_reason == "error" and "limit" in final[bad].error
    assert final[good].finish_reason == "length" and len(final[good].token_ids) == 12


def test_abort_frees_blocks_and_unknown_abort_is_a_noop(engine_factory):
    engine = engine_factory()
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_cache.stats().num_used_blocks > 0
    engine.abort_request(rid)
    engine.abort_request(rid)
    engine.abort_request("nope")
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.kv_cache.stats().num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_model_ownership(engine_factory, tiny_model_dir):
    first = engine_factory()
    with pytest.raises(ModelOwnershipError):
        EngineCore(model=str(tiny_model_dir))
    second = engine_factory(force_model_takeover=True)
    first.shutdown()
    second.shutdown()
    third = engine_factory()  # released: no error
    assert third.model_path == tiny_model_dir


def test_llm_front_door(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    try:
        assert llm.model_path == tiny_model_dir
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        chats = llm.chat(
            [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]],
            [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=4, temperature=0)],
        )
        assert [len(c.token_ids) for c in chats] == [3, 4]
        with pytest.raises(ValueError, match="temperature"):
            llm.generate("x", SamplingParams(temperature=-1))
    finally:
        llm.shutdown()


@pytest.mark.e2e
def test_engine_equals_mlx_lm_on_the_default_model(default_model_dir):
    import mlx_lm

    from vllm_mlx.platform.cpu_backend import choose_weight_format, prepare_model_weights

    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors."]
    model, tokenizer = mlx_lm.load(str(default_model_dir))
    prepare_model_weights(model, choose_weight_format("auto"))  # the weights the engine runs
    expected = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=10)]
        expected.append(tokens)
    del model
    llm = LLM("default")
    try:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=10, temperature=0))
        assert [o.token_ids for o in outs] == expected
        assert "Paris" in outs[0].text
    finally:
        llm.shutdown()


def test_n_siblings_reuse_the_prompt_blocks(engine_factory):
    engine = engine_factory(block_size=4, num_kv_blocks=64)
    rid = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=1, ignore_eos=True))
    shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = engine.cache_snapshot()
        shared = max(shared, sum(1 for b in snapshot["blocks"] if b["ref_cnt"] == 3))
    prompt_blocks = (len(engine.tokenizer.encode(PROMPTS[4])) - 1) // 4
    assert shared == prompt_blocks  # every full prompt block held by all three completions
    assert rid not in engine.cache_snapshot()["requests"]
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_cache_snapshot_is_plain_data(engine_factory):
    import json

    engine = engine_factory(block_size=4, num_kv_blocks=64)
    engine.add_request(PROMPTS[1], GREEDY, request_id="a")
    engine.step()
    snapshot = engine.cache_snapshot()
    json.dumps(snapshot)  # plain data only
    table = snapshot["requests"]["a"]["block_ids"]
    blocks = {b["id"]: b for b in snapshot["blocks"]}
    assert all(blocks[i]["state"] == "used" and blocks[i]["owners"] == ["a"] for i in table)
    assert "".join(blocks[i]["text"] for i in table).startswith("The quick brown fox")
    assert snapshot["stats"]["num_used_blocks"] == len(table)


def test_another_architecture_runs_unmodified(tmp_path, default_model_dir):
    from tiny_model import build_tiny_llama

    qwen2 = build_tiny_llama(tmp_path / "qwen2", default_model_dir, model_type="qwen2", seed=3)
    engine = EngineCore(model=str(qwen2))
    try:
        alone = []
        for p in PROMPTS[:3]:
            rid = engine.add_request(p, GREEDY)
            alone.append(run_to_end(engine)[rid].token_ids)
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
        final = run_to_end(engine)
        assert [final[i].token_ids for i in ids] == alone
    finally:
        engine.shutdown()


def test_split_head_is_used_only_when_exact(tiny_model_dir):
    import mlx_lm

    from vllm_mlx.executor.model_runner import SplitModel

    model, _ = mlx_lm.load(str(tiny_model_dir))
    split = SplitModel.probe(model)
    assert split is not None
    tokens = mx.array([[5, 6, 7]])
    assert mx.array_equal(split.head(split.backbone(tokens)), model(tokens)).item()

    class ScaledLogits:  # a model whose __call__ does more than head(backbone(x))
        def __init__(self, inner):
            self.model, self.lm_head = inner.model, inner.model.embed_tokens.as_linear

        def __call__(self, x, cache=None):
            return self.lm_head(self.model(x, cache=cache)) * 0.5

    assert SplitModel.probe(ScaledLogits(model)) is None


def test_cache_snapshot_without_blocks_is_requests_and_stats(engine_factory):
    engine = engine_factory(block_size=4, num_kv_blocks=64)
    engine.add_request(PROMPTS[1], GREEDY, request_id="a")
    engine.step()
    full, light = engine.cache_snapshot(), engine.cache_snapshot(include_blocks=False)
    assert light["blocks"] == [] and light["free_queue"] == []
    assert light["requests"] == full["requests"]
    assert light["stats"] == full["stats"]


def test_prefill_charged_for_attention_keeps_greedy_output(engine_factory):
    """Chunks cut by their attention cost (``prefill_attention_tokens``; 8 makes them shrink fast)
    change how prompts are split, never what is generated: batched with staggered arrivals
    equals solo with the policy off."""
    expected = solo_tokens(lambda: engine_factory(prefill_attention_tokens=0), PROMPTS)
    engine = engine_factory(max_num_batched_tokens=16, prefill_attention_tokens=8)
    assert staggered_tokens(engine, PROMPTS, GREEDY, max_steps=2000) == expected
    chunks = [q.num_new_tokens for r in engine.step_records for q in r.requests if not q.is_decode]
    assert max(chunks) < 16  # cut below the token budget (policy off: prompts of 16+ tokens take 16)
    assert engine.kv_cache.stats().num_used_blocks == 0

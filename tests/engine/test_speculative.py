"""Speculative decoding in the engine, on real MLX: output with n-gram speculation is token for
token the output without it.

The models are tiny random-weight ones whose text draws from twelve tokens (``likely_tokens``),
so it repeats itself and n-gram lookup proposes tokens that are sometimes right and sometimes
wrong: every test checks that both happened, so acceptance and rollback are both under test. The
oracle is the same engine without speculation (itself held to mlx-lm by the other engine tests),
alone and in batches, through chunked prefill, preemption, prefix hits, stops, penalties and
seeded sampling; and on a hybrid (recurrent) and a sliding-window model.
"""

from __future__ import annotations

import pytest
from factories import run_to_end
from oracles import mlx_lm_tokens
from repeating_models import ARCHS

from vllm_mlx import SamplingParams
from vllm_mlx.config import EngineConfig
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.llm import LLM

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps running far away.",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen",
    "A much longer prompt " * 6,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture
def engines(engine_factory, repeating_dirs):
    """``make(arch="llama", **options)``: an engine on the repeating model of ``arch`` (a pool of
    512 blocks unless told: the default budget would size a tiny model's pool in seconds)."""

    def make(arch: str = "llama", **options):
        return engine_factory(repeating_dirs(arch), **{"num_kv_blocks": 512, **options})

    return make


def outputs(engine, requests: list[tuple[str, SamplingParams]], arrive_every: int = 0) -> list:
    """Final outputs of ``requests``, all at once or one every ``arrive_every`` steps; the
    cache's invariants are checked after every step."""
    ids, final, pending, steps = [], {}, list(requests), 0
    while pending or engine.has_unfinished_requests():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            ids += [engine.add_request(p, params) for p, params in batch]
            pending = pending[len(batch) :]
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv_cache.check_invariants()
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 5000, "no progress"
    assert engine.kv_cache.stats().num_used_blocks == 0
    return [final[i] for i in ids]


def speculation(engine) -> tuple[int, int]:
    """(proposed, accepted) tokens over the engine's recorded steps."""
    records = engine.step_records
    return sum(r.num_draft_tokens for r in records), sum(r.num_accepted_tokens for r in records)


def assert_both_outcomes(engine) -> None:
    proposed, accepted = speculation(engine)
    assert 0 < accepted < proposed, (proposed, accepted)  # some kept, some rejected


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_is_unchanged_in_a_batch(engines, arch):
    """Full attention, sliding windows (gemma3) and recurrent layers, padded (qwen3.5) or not
    (nemotron_h): rejected tokens are dropped from the KV and from the state."""
    requests = [(p, GREEDY) for p in PROMPTS]
    plain = engines(arch, num_kv_blocks=256, block_size=4)
    expected = tokens(outputs(plain, requests))
    plain.shutdown()
    spec = engines(arch, num_kv_blocks=256, block_size=4, speculative_config=NGRAM)
    assert tokens(outputs(spec, requests)) == expected
    assert_both_outcomes(spec)


def test_preemption_chunked_prefill_and_prefix_hits_keep_the_output(engines):
    requests = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[3], GREEDY), (PROMPTS[3] + " again", GREEDY)]
    options = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 12}
    plain = engines(**options)
    expected = tokens(outputs(plain, requests, arrive_every=3))
    plain.shutdown()
    spec = engines(**options, speculative_config=NGRAM)
    outs = outputs(spec, requests, arrive_every=3)
    assert tokens(outs) == expected
    assert spec.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens for o in outs)  # prefix hits
    assert_both_outcomes(spec)


def test_seeded_sampling_penalties_and_logprobs_are_unchanged(engines):
    """Each verified position is sampled with the seed, step and history it would have had:
    the same tokens, the same logprobs."""
    sampled = SamplingParams(
        max_tokens=24, temperature=0.8, top_k=8, top_p=0.95, repetition_penalty=1.05, presence_penalty=0.1,
        min_tokens=20, logprobs=2, ignore_eos=True,
    )  # fmt: skip
    requests = [(p, sampled.clone(seed=i)) for i, p in enumerate(PROMPTS)]
    plain = engines()
    expected = outputs(plain, requests)
    plain.shutdown()
    spec = engines(speculative_config=NGRAM)
    outs = outputs(spec, requests)
    assert tokens(outs) == tokens(expected)
    for got, want in zip(outs, expected):
        assert len(got.outputs[0].logprobs) == len(want.outputs[0].logprobs) == 24
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
    assert_both_outcomes(spec)


def test_stops_inside_accepted_tokens(engines):
    plain = engines()
    [full] = outputs(plain, [(PROMPTS[1], GREEDY)])
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    cases = [
        GREEDY.clone(stop_token_ids=[ids[9]]),
        GREEDY.clone(stop=[text[12:18]]),
        GREEDY.clone(max_tokens=7),
        GREEDY.clone(ignore_eos=False, min_tokens=3),
    ]
    expected = outputs(plain, [(PROMPTS[1], c) for c in cases])
    plain.shutdown()
    spec = engines(speculative_config=NGRAM)
    outs = outputs(spec, [(PROMPTS[1], c) for c in cases])
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.finish_reason) for o in outs] == [
        (o.outputs[0].token_ids, o.outputs[0].text, o.finish_reason) for o in expected
    ]
    assert speculation(spec)[1] > 0


def test_constrained_requests_decode_plainly_beside_speculating_ones(engines):
    from vllm_mlx.structured import StructuredOutputsParams

    constrained = GREEDY.clone(structured_outputs=StructuredOutputsParams(regex="( temper| enough)+"), max_tokens=10)
    requests = [(PROMPTS[1], constrained), (PROMPTS[2], GREEDY)]
    plain = engines()
    expected = tokens(outputs(plain, requests))
    plain.shutdown()
    spec = engines(speculative_config=NGRAM)
    outs = outputs(spec, requests)
    assert tokens(outs) == expected
    constrained_id = outs[0].request_id
    assert all(r.num_draft_tokens == 0 for s in spec.step_records for r in s.requests if r.request_id == constrained_id)
    assert speculation(spec)[0] > 0


def test_speculative_config_is_checked_when_the_engine_is_configured():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    config.normalize()
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert SpeculativeConfig.of("ngram") == SpeculativeConfig()  # a method's name: its defaults
    bad = [
        ({"method": "draft_model"}, "'model' .* is required"),
        ({"method": "eagle"}, "not supported"),
        ("eagle3", "not supported"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 99}, "at most"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must not exceed"),
        ({"num_tokens": 3}, "unknown key"),
        ("{not json", "not JSON"),
        ([1, 2], "must be a dict"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value).normalize()
    EngineConfig(speculative_config={"method": "ngram"}, tensor_parallel=True).normalize()  # lookup runs on rank 0
    for split in ("tensor_parallel", "pipeline_parallel"):
        with pytest.raises(ValueError, match="a draft model does not work with tensor_parallel"):
            EngineConfig(speculative_config={"model": "/drafts/small"}, **{split: True}).normalize()


@pytest.mark.e2e
def test_default_model_with_speculation_equals_mlx_lm(default_model_dir):
    """The real model on a text it must copy: many proposals kept, and mlx-lm's own tokens."""
    text = "Alice met Bob at the old station, and together they walked to the library by the river."
    prompt = f"{text}\n{text}\n{text}\n"
    expected = mlx_lm_tokens(default_model_dir, [prompt], 24)
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    try:
        [out] = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == expected[0]
        proposed, accepted = speculation(llm.engine)
        assert accepted >= 8 and len(llm.engine.step_records) <= 18, (proposed, accepted)
    finally:
        llm.shutdown()


def test_the_engine_config_reaches_the_scheduler_step_by_step(engines):
    """Proposals appear in the steps' records: verified positions counted as decode tokens."""
    spec = engines(speculative_config=NGRAM)
    outputs(spec, [(PROMPTS[2], GREEDY)])
    verifying = [r for s in spec.step_records for r in s.requests if r.num_draft_tokens]
    assert verifying and all(r.is_decode and r.num_new_tokens == r.num_draft_tokens + 1 for r in verifying)
    assert all(r.num_prefill_tokens == 0 for r in verifying)


def test_each_request_may_choose(engines):
    """``add_request(speculative=...)``: True speculates on an engine without a config (n-gram
    lookup), False never does on one with it; None follows the engine. Output is unchanged."""
    requests = [(PROMPTS[1], GREEDY), (PROMPTS[2], GREEDY)]
    plain = engines()
    expected = tokens(outputs(plain, requests))
    for engine, choices, drafted in [(plain, (True, None), (True, False)), (None, (False, None), (False, True))]:
        engine = engine or engines(speculative_config=NGRAM)
        ids = [engine.add_request(p, params, speculative=c) for (p, params), c in zip(requests, choices)]
        final = run_to_end(engine)
        assert tokens(final[i] for i in ids) == expected
        assert [final[i].metrics.num_draft_tokens > 0 for i in ids] == list(drafted)
        engine.shutdown()

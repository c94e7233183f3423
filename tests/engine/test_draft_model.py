"""Speculative decoding with a draft model, on real MLX: output with a draft proposing is token
for token the output without speculation.

Targets are the tiny repeating models of ``test_speculative.py``. The main draft is the target
with noise added to its weights (``noisy_copy``): it agrees with the target about half the time,
so every test sees proposals kept and rejected. The oracle is the same engine without
speculation (itself held to mlx-lm by the other engine tests), alone and in batches, through
chunked prefill, preemption, prefix hits in both pools, stops and seeded sampling; and on a
sliding-window and a hybrid (recurrent) target. After every step the draft's own pool is checked
like the target's, and it is empty once the requests end.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_speculative import GREEDY, PROMPTS, outputs, speculation, tokens

from vllm_mlx import SamplingParams
from vllm_mlx.config import EngineConfig
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.engine.draft_model import DraftModelError

NOISE = 0.08  # of each weight matrix's std: the copy keeps ~half of its proposals (measured)


def noisy_copy(source: Path, out_dir: Path, scale: float = NOISE, seed: int = 3) -> Path:
    """``source``'s model with Gaussian noise of ``scale`` times each matrix's std added."""
    import mlx.core as mx

    weights = mx.load(str(source / "model.safetensors"))
    mx.random.seed(seed)
    weights = {k: v + scale * v.std() * mx.random.normal(v.shape) if v.ndim == 2 else v for k, v in weights.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, repeating_dirs):
    """``get(arch)``: a noisy copy of the repeating model of ``arch`` (built on first use)."""
    built = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = noisy_copy(repeating_dirs(arch), tmp_path_factory.mktemp(f"draft-{arch}"))
        return built[arch]

    return get


def draft_config(draft: Path, k: int = 4, adaptive: bool = False) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, "adaptive": adaptive}


@pytest.fixture
def engines(engine_factory, repeating_dirs):
    """``make(arch="llama", **options)``: an engine on the repeating model of ``arch``, whose
    draft pool (if any) is checked with the target's after every step of ``run``."""

    def make(arch: str = "llama", **options):
        return engine_factory(repeating_dirs(arch), **{"num_kv_blocks": 512, **options})

    return make


def run(engine, requests, arrive_every: int = 0) -> list:
    """``outputs`` with the draft's pool checked after every step and empty at the end."""
    drafter = engine.speculator.drafter if engine.speculator is not None else None
    original = engine.step

    def step():
        result = original()
        if drafter is not None:
            drafter.kv.coordinator.check_invariants()
            drafter.kv.check_requests([s.request for s in drafter.shadows.values()])
        return result

    engine.step = step
    outs = outputs(engine, requests, arrive_every)
    if drafter is not None:
        assert drafter.shadows == {} and drafter.kv.stats().num_used_blocks == 0
    return outs


def assert_both_outcomes(engine) -> None:
    proposed, accepted = speculation(engine)
    assert 0 < accepted < proposed, (proposed, accepted)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_5"])
def test_greedy_output_is_unchanged_in_a_batch(engines, drafts, arch):
    """A full-attention, a sliding-window and a hybrid target; the draft is a noisy copy of the
    target, or of the llama for the hybrid (a recurrent draft is refused)."""
    requests = [(p, GREEDY) for p in PROMPTS]
    plain = engines(arch, num_kv_blocks=256, block_size=4)
    expected = tokens(run(plain, requests))
    plain.shutdown()
    draft = drafts("llama" if arch == "qwen3_5" else arch)
    spec = engines(arch, num_kv_blocks=256, block_size=4, speculative_config=draft_config(draft))
    assert tokens(run(spec, requests)) == expected
    proposed, accepted = speculation(spec)
    assert proposed > accepted and (arch == "qwen3_5" or accepted > 0), (proposed, accepted)


def test_preemption_chunked_prefill_and_prefix_hits_keep_the_output(engines, drafts):
    requests = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[3], GREEDY), (PROMPTS[3] + " again", GREEDY)]
    options = {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 12}
    plain = engines(**options)
    expected = tokens(run(plain, requests, arrive_every=3))
    plain.shutdown()
    spec = engines(**options, speculative_config=draft_config(drafts()))
    outs = run(spec, requests, arrive_every=3)
    assert tokens(outs) == expected
    assert spec.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens for o in outs)
    assert spec.speculator.drafter.kv.prefix_cache_stats().hits > 0  # the draft's own prefix cache
    assert_both_outcomes(spec)


def test_seeded_sampling_and_stops_are_unchanged(engines, drafts):
    """Sampled rows verify greedy proposals by rejection sampling: the same tokens as without
    speculation, seed for seed; stops inside accepted tokens end the request where they would."""
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_k=8, min_tokens=20, logprobs=2, ignore_eos=True)
    requests = [(p, sampled.clone(seed=i)) for i, p in enumerate(PROMPTS)]
    requests += [(PROMPTS[1], GREEDY.clone(max_tokens=7)), (PROMPTS[1], GREEDY.clone(ignore_eos=False, min_tokens=3))]
    plain = engines()
    expected = run(plain, requests)
    plain.shutdown()
    spec = engines(speculative_config=draft_config(drafts()))
    outs = run(spec, requests)
    assert tokens(outs) == tokens(expected)
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in expected]
    assert_both_outcomes(spec)


def test_a_draft_that_is_the_target_has_every_proposal_kept(engines, repeating_dirs):
    requests = [(p, GREEDY) for p in PROMPTS]
    spec = engines(speculative_config=draft_config(repeating_dirs("llama"), k=5))
    outs = run(spec, requests)
    proposed, accepted = speculation(spec)
    assert proposed == accepted > 0
    assert len(spec.step_records) <= 10  # 24 tokens each, up to 6 per step after the prompt's
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)


def test_adaptive_policy_prices_the_drafts_forwards(engines, repeating_dirs):
    """A draft as large as its target costs more than it saves: the adaptive policy never
    runs it (a small draft of the same acceptance would speculate: test_spec_policy.py)."""
    spec = engines(speculative_config=draft_config(repeating_dirs("llama"), adaptive=True))
    assert spec.speculator.drafter.cost_ratio == pytest.approx(1.0)
    run(spec, [(p, GREEDY) for p in PROMPTS])
    assert speculation(spec) == (0, 0)


def test_a_failing_draft_costs_speculation_not_requests(engines, drafts, caplog):
    requests = [(p, GREEDY) for p in PROMPTS]
    plain = engines()
    expected = tokens(run(plain, requests))
    plain.shutdown()
    spec = engines(speculative_config=draft_config(drafts()))
    runner = spec.speculator.drafter.runner
    calls = {"n": 0}
    execute = runner.execute_model

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] % 5 == 3:  # fault injection: every fifth draft forward fails
            raise RuntimeError("injected draft failure")
        return execute(scheduler_output)

    runner.execute_model = flaky
    assert tokens(run(spec, requests)) == expected
    assert "the draft model failed" in caplog.text
    assert speculation(spec)[1] > 0


def test_aborting_frees_the_drafts_blocks(engines, drafts):
    spec = engines(speculative_config=draft_config(drafts()))
    request_id = spec.add_request(PROMPTS[3], GREEDY)
    while not spec.speculator.drafter.shadows:
        spec.step()
    assert spec.speculator.drafter.kv.stats().num_used_blocks > 0
    spec.abort_request(request_id)
    assert spec.speculator.drafter.shadows == {} and spec.speculator.drafter.kv.stats().num_used_blocks == 0


def test_drafts_that_cannot_serve_the_target_are_refused(engine_factory, repeating_dirs, tmp_path):
    target = repeating_dirs("llama")
    other_vocab = noisy_copy(target, tmp_path / "other-vocab")
    tokenizer = json.loads((other_vocab / "tokenizer.json").read_text())
    new_id = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
    extra = {"content": "<|draft_only|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    tokenizer["added_tokens"].append({"id": new_id, **extra, "special": True})
    (other_vocab / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftModelError, match="another tokenizer"):
        engine_factory(target, num_kv_blocks=64, speculative_config=draft_config(other_vocab))
    with pytest.raises(DraftModelError, match="recurrent layers"):
        engine_factory(target, num_kv_blocks=64, speculative_config=draft_config(repeating_dirs("qwen3_5")))


def test_the_draft_model_config_is_checked():
    config = EngineConfig(speculative_config='{"model": "some/draft", "num_speculative_tokens": 3}')
    config.normalize()  # vLLM's form: a model without a method is a draft model
    assert config.speculative_config == SpeculativeConfig(method="draft_model", model="some/draft", num_speculative_tokens=3)
    for value, message in [
        ({"method": "draft_model"}, "'model' .* is required"),
        ({"method": "ngram", "model": "x"}, "is for method 'draft_model'"),
        ({"method": "draft_model", "model": ""}, "path or model name"),
        ({"method": "mtp"}, "drops the multi-token-prediction heads"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value).normalize()


def test_the_draft_pool_is_counted_in_the_kv_budget(engine_factory, repeating_dirs):
    """A draft model's blocks come out of the same ``kv_cache_memory``: with a draft as large as
    the target, the budget holds half as many blocks each."""
    target = repeating_dirs("llama")
    budget = 4 * 1024 * 1024
    alone = engine_factory(target, kv_cache_memory=budget, block_size=16)
    blocks_alone = alone.kv_cache.num_blocks
    alone.shutdown()
    paired = engine_factory(target, kv_cache_memory=budget, block_size=16, speculative_config=draft_config(target))
    assert abs(paired.kv_cache.num_blocks - 1 - (blocks_alone - 1) // 2) <= 1
    assert paired.speculator.drafter.kv.coordinator.num_blocks == paired.kv_cache.num_blocks


def test_async_engine_with_a_draft_model(repeating_dirs, drafts):
    """The engine thread owns the draft too: it loads, drafts and is released there."""
    import asyncio

    from vllm_mlx.engine.async_engine import AsyncEngineCore

    config = draft_config(drafts(), adaptive=False)
    engine = AsyncEngineCore(model=str(repeating_dirs("llama")), num_kv_blocks=256, force_model_takeover=True,
                             speculative_config=config).start()  # fmt: skip
    try:

        async def answer(prompt: str):
            async for output in engine.generate(prompt, GREEDY):
                last = output
            return last

        async def both():
            return await asyncio.gather(answer(PROMPTS[1]), answer(PROMPTS[2]))

        outs = asyncio.run(both())
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        assert engine.call(lambda core: core.speculator.drafter.kv.stats().num_used_blocks) == 0
    finally:
        engine.stop()

"""Breadth: every mlx-lm architecture the engine serves without a test of its own runs here, as a
tiny random model built from the module's own ``ModelArgs`` by the support probe
(``vllm_mlx.models.probe.build_tiny_model``: no hand-written config), saved as a directory
mlx-lm loads.

The oracle is mlx-lm: the engine's greedy tokens for prompts of different lengths, submitted
together (so they share forward calls, padded where the model allows it), equal mlx-lm's for
each prompt alone; a prompt sent again hits the prefix cache and still equals them (a model the
engine serves with per-request caches, ``executor/held_caches.py``, has no prefix cache: the prompt
sent again still equals them, with no hit); and no step
failed (the engine re-runs a failed step's rows one by one, which would hide a model that cannot
take rows at different positions in one call). ``support.SWEPT_TEXT`` lists the architectures;
``docs/models.md`` calls them supported on the strength of this test.
"""

from __future__ import annotations

import logging

import pytest
from oracles import engine_tokens, finish, mlx_lm_tokens
from tiny_model import build_tiny_architecture

from vllm_mlx import SamplingParams
from vllm_mlx.core.kv.spec import STATE_ONLY_BLOCKS
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.models.support import SWEPT_TEXT

# Token ids (the tiny vocabulary is 128): 20 tokens (past the probe's sliding window of 8 and
# five 4-token blocks), 11, and 3 (shorter than one block).
PROMPTS = [list(range(10, 30)), [5, 17, 33, 9, 60, 3, 44, 100, 7, 12, 90], [8, 8, 21]]
GREEDY = SamplingParams(max_tokens=6, temperature=0)  # both stop at the tokenizer's EOS (id 98)


@pytest.mark.parametrize("name", SWEPT_TEXT)
def test_engine_equals_mlx_lm(name, tmp_path, caplog):
    path = build_tiny_architecture(tmp_path / name, name)
    expected = mlx_lm_tokens(path, PROMPTS, GREEDY.max_tokens)
    assert len({tuple(tokens) for tokens in expected}) > 1, "the tiny model ignores its prompt: no oracle"
    engine = EngineCore(model=str(path), block_size=4, num_kv_blocks=256)
    try:
        with caplog.at_level(logging.ERROR, logger="vllm_mlx"):
            assert engine_tokens(engine, PROMPTS, GREEDY) == expected
            request_id = engine.add_request(PROMPTS[0], GREEDY)
            again = finish(engine)[request_id]
        assert again.outputs[0].token_ids == expected[0]
        if engine.runner.held is not None:  # its caches are its requests' own: nothing to hit
            assert again.num_cached_tokens == 0 and not engine.config.enable_prefix_caching
        else:
            assert again.num_cached_tokens >= 16, "the prompt sent again did not hit the prefix cache"
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        engine.shutdown()


def test_a_model_without_attention_sizes_its_pool_by_its_states(tmp_path):
    """Mamba writes no keys or values: its blocks cost nothing (they only count tokens and carry
    the prefix hashes), so the engine's memory sizing gives it ``STATE_ONLY_BLOCKS`` and spends
    the budget on state slots, where it would otherwise have found nothing to size the pool by."""
    path = build_tiny_architecture(tmp_path / "mamba", "mamba")
    expected = mlx_lm_tokens(path, PROMPTS[:2], GREEDY.max_tokens)
    engine = EngineCore(model=str(path))
    try:
        assert engine.kv_cache.num_blocks == STATE_ONLY_BLOCKS
        assert engine_tokens(engine, PROMPTS[:2], GREEDY) == expected
    finally:
        engine.shutdown()


def test_an_architecture_that_fails_in_mlx_lm_itself_is_refused_at_load(tmp_path):
    """OLMo (1): mlx-lm's own generation fails on a prompt of more than one token, so there is no
    oracle to match; the engine refuses it at load saying why. When mlx-lm fixes it, the first
    assertion fails: then the architecture joins the sweep."""
    from vllm_mlx.executor.attention import UnsupportedModelError

    path = build_tiny_architecture(tmp_path / "olmo", "olmo")  # with a stand-in for ai2-olmo's import gate
    with pytest.raises(ValueError, match="inplace addition.*str"):
        mlx_lm_tokens(path, PROMPTS[:1], GREEDY.max_tokens)
    with pytest.raises(UnsupportedModelError, match="'olmo' is refused: mlx-lm's OLMo"):
        EngineCore(model=str(path), block_size=4, num_kv_blocks=64)


def test_rows_starting_a_sequence_never_share_a_call_with_rows_that_continue_one(tmp_path):
    """RecurrentGemma's RG-LRU leaves a sequence's first input unscaled when its state is None (a
    fresh mlx-lm cache), not when it is zeros: a one-token prompt arriving while another request
    decodes (both rows one token wide, which would share a call) gets a call of its own, and both
    equal mlx-lm (``attention.FRESH_ROWS_APART``)."""
    path = build_tiny_architecture(tmp_path / "recurrent_gemma", "recurrent_gemma")
    prompts = [PROMPTS[1], [33]]
    expected = mlx_lm_tokens(path, prompts, GREEDY.max_tokens)
    engine = EngineCore(model=str(path), block_size=4, num_kv_blocks=64)
    try:
        first = engine.add_request(prompts[0], GREEDY)
        final = {}
        while not engine.step_records or engine.step_records[-1].num_new_tokens != [1]:  # until it decodes
            final |= {o.request_id: o for o in engine.step() if o.finished}
        second = engine.add_request(prompts[1], GREEDY)
        engine.step_records.clear()
        final |= finish(engine)
        shared = engine.step_records[0]
    finally:
        engine.shutdown()
    assert [final[i].outputs[0].token_ids for i in (first, second)] == expected
    assert len(shared.request_ids) == 2 and shared.num_new_tokens == [1, 1] and shared.num_forward_calls == 2

"""Thinking models: constraints start after ``</think>``, and ``max_thinking_tokens`` closes it.

A tiny random-weight llama whose tokenizer has ``<think>`` and ``</think>`` as single tokens (two
added tokens past SmolLM2's vocabulary, so the model's vocabulary grows by two). The reasoning a
random model writes is gibberish; what is checked is where the constraint starts and where the
budget forces ``</think>``.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.structured import StructuredOutputsParams
from vllm_mlx.structured.reasoning_gate import GatePhase, ReasoningGate, ThinkTokens

THINK = ThinkTokens(start=7, end=8)


@pytest.fixture(scope="module")
def think_token_model_dir(tmp_path_factory, default_model_dir):
    from tiny_model import build_tiny_llama

    tokenizer_dir = tmp_path_factory.mktemp("think-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(default_model_dir / name, tokenizer_dir / name)
    config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for i, text in enumerate(("<think>", "</think>")):
        tokenizer["added_tokens"].append({
            "id": vocab + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": False,
        })  # fmt: skip
    (tokenizer_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    config["vocab_size"] = vocab + 2
    (tokenizer_dir / "config.json").write_text(json.dumps(config))
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-thinker"), tokenizer_dir)


@pytest.fixture(scope="module")
def engine(think_token_model_dir):
    core = EngineCore(model=str(think_token_model_dir), max_num_seqs=8)
    yield core
    core.shutdown()


def final_completions(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams) -> dict:
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0]
    return finals


# -- the gate, token by token ---------------------------------------------------------------------


def test_phases_follow_the_tokens():
    opened = ReasoningGate(THINK, starts_in_reasoning=True)
    assert opened.phase([]) == GatePhase(constrain_from=None)
    assert opened.phase([1, 2, 8, 3]) == GatePhase(constrain_from=3)  # after the first </think>
    fresh = ReasoningGate(THINK, starts_in_reasoning=False)
    assert fresh.phase([]) == GatePhase(constrain_from=0, also_allow=7)  # may open <think> first
    assert fresh.phase([3]) == GatePhase(constrain_from=0)  # did not: constrained from the start
    assert fresh.phase([7, 1]) == GatePhase(constrain_from=None)
    assert fresh.phase([7, 1, 8]) == GatePhase(constrain_from=3)
    budget = ReasoningGate(THINK, starts_in_reasoning=False, max_thinking_tokens=2)
    assert budget.phase([7, 1]).force_token is None
    assert budget.phase([7, 1, 2]) == GatePhase(constrain_from=None, force_token=8)
    assert budget.phase([7, 1, 2, 8]) == GatePhase(constrain_from=4)
    assert ReasoningGate(THINK, True, 0).phase([]).force_token == 8


def test_think_tokens_are_read_from_the_tokenizer(engine, default_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    assert ThinkTokens.of(load_tokenizer(default_model_dir)) is None  # SmolLM2: no think tokens
    think = engine.think_tokens
    assert think is not None and engine.tokenizer.decode([think.start, think.end]) == "<think></think>"
    assert think.prompt_opens([5, think.start, 9]) and not think.prompt_opens([think.start, 4, think.end, 9])


# -- the engine ---------------------------------------------------------------------------------------


def test_the_budget_forces_the_end_of_reasoning_and_the_constraint_starts_after_it(engine):
    think = engine.think_tokens
    opened = engine.tokenizer.encode("Is it?", add_special_tokens=False) + [think.start]
    params = SamplingParams(
        max_tokens=24, temperature=0, max_thinking_tokens=5,
        structured_outputs=StructuredOutputsParams(regex="(yes|no)!"),
    )  # fmt: skip
    prompts = {f"p{i}": opened + [100 + i] * i + [think.start] for i in range(4)}
    for output in final_completions(engine, prompts, params).values():
        tokens = output.token_ids
        end = tokens.index(think.end)
        assert end <= 5  # at most the budget's 5 reasoning tokens, then </think>
        answer = engine.tokenizer.decode(tokens[end + 1 :], skip_special_tokens=True)
        assert re.fullmatch("(yes|no)!", answer), (tokens, answer)
        assert output.finish_reason == "stop"


def test_a_budget_of_zero_closes_the_reasoning_at_once(engine):
    think = engine.think_tokens
    params = SamplingParams(max_tokens=4, temperature=0, max_thinking_tokens=0)
    [output] = final_completions(engine, {"zero": [5, 6, think.start]}, params).values()
    assert output.token_ids[0] == think.end


def test_a_prompt_without_open_reasoning_is_constrained_from_its_first_token(engine):
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    outputs = final_completions(engine, {f"c{i}": [5, 6 + i, 7 + i] for i in range(3)}, params)
    think = engine.think_tokens
    for output in outputs.values():
        if output.token_ids[0] == think.start:  # the model may still choose to think first
            continue
        assert output.text in ("alpha", "beta")


def test_max_thinking_tokens_is_refused_on_a_model_that_does_not_think(tiny_model_dir):
    core = EngineCore(model=str(tiny_model_dir), max_num_seqs=2)
    try:
        with pytest.raises(ValueError, match="max_thinking_tokens needs a thinking model"):
            core.add_request([1, 2, 3], SamplingParams(max_thinking_tokens=4))
        assert not core.has_unfinished_requests()
    finally:
        core.shutdown()
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1)

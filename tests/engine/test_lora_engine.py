"""Adapters in the batch, on real MLX (issue #30): each row of a batch mixing adapters and the
base model gives mlx-lm's greedy tokens for that adapter applied alone
(``mlx_lm.load(..., adapter_path=...)``), with fewer slots than adapters (requests wait for a
slot), through prefix hits and preemption; a block computed under one adapter never serves
another."""

from __future__ import annotations

import pytest
from factories import run_to_end
from lora_adapters import as_peft, write_mlx_lm_adapter
from oracles import mlx_lm_tokens

from vllm_mlx import SamplingParams
from vllm_mlx.lora import LoRARequest
from vllm_mlx.lora.adapter import AdapterError

PROMPTS = ["Tell me about lighthouses.", "The quick brown fox jumps over the lazy dog.", "One two three four five"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    first = write_mlx_lm_adapter(tiny_model_dir, root / "first", rank=4, scale=2.0, seed=1)
    second = write_mlx_lm_adapter(tiny_model_dir, root / "second", rank=8, scale=1.0, seed=2, keys=["self_attn.k_proj"])
    third = write_mlx_lm_adapter(tiny_model_dir, root / "third", rank=2, scale=4.0, seed=3, keys=["mlp.gate_proj"])
    dora = write_mlx_lm_adapter(tiny_model_dir, root / "dora", rank=4, scale=2.0, seed=4, fine_tune_type="dora")
    return {
        "first": LoRARequest("first", 1, str(first)),
        "second": LoRARequest("second", 2, str(second)),
        "third": LoRARequest("third", 3, str(third)),
        "first-peft": LoRARequest("first-peft", 4, str(as_peft(first, root / "peft", alpha=8.0, base=str(tiny_model_dir)))),
        "dora": LoRARequest("dora", 5, str(dora)),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """mlx-lm's tokens per (prompt, adapter name or None)."""
    table = {}
    for name in [None, "first", "second", "third", "dora"]:
        path = adapters[name].lora_path if name else None
        for prompt, tokens in zip(PROMPTS, mlx_lm_tokens(tiny_model_dir, PROMPTS, 12, adapter_path=path)):
            table[prompt, name] = tokens
    table.update({(p, "first-peft"): table[p, "first"] for p in PROMPTS})  # the same factors, PEFT's files
    return table


def lora_engine(engine_factory, **options):
    return engine_factory(None, enable_lora=True, max_lora_rank=8, force_model_takeover=True,
                          **{"max_loras": 2, "num_kv_blocks": 128, "block_size": 4, **options})  # fmt: skip


def run(engine, jobs, adapters) -> list:
    ids = [engine.add_request(p, GREEDY, lora_request=adapters[name] if name else None) for p, name in jobs]
    final = run_to_end(engine)
    return [final[i] for i in ids]


def test_a_batch_of_adapters_and_the_base_equals_mlx_lm_row_by_row(engine_factory, adapters, expected):
    """Four adapters over two slots and the base model, in one batch: the rows whose adapter
    has no slot wait, then run; every row equals mlx-lm with its adapter alone."""
    engine = lora_engine(engine_factory)
    jobs = [(p, name) for p in PROMPTS for name in (None, "first", "second", "third", "first-peft", "dora")]
    outputs = run(engine, jobs, adapters)
    for (prompt, name), output in zip(jobs, outputs):
        assert output.outputs[0].token_ids == expected[prompt, name], (prompt, name)
    assert engine.kv_cache.stats().num_used_blocks == 0
    batched = [r for r in engine.step_records if len(r.request_ids) > 1]
    assert batched, "the rows never shared a step"


def test_prefix_hits_stay_within_an_adapter(engine_factory, adapters, expected):
    engine = lora_engine(engine_factory)
    [first] = run(engine, [(PROMPTS[0] * 3, "first")], adapters)
    [base, again] = run(engine, [(PROMPTS[0] * 3, None), (PROMPTS[0] * 3, "first")], adapters)
    assert base.num_cached_tokens == 0  # the same tokens, computed under another adapter
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_keeps_each_rows_adapter(engine_factory, adapters, expected):
    engine = lora_engine(engine_factory, num_kv_blocks=20, max_num_batched_tokens=12)
    jobs = [(p, name) for p in PROMPTS for name in ("first", None, "dora")]
    outputs = run(engine, jobs, adapters)
    assert engine.scheduler.num_preemptions > 0
    for (prompt, name), output in zip(jobs, outputs):
        assert output.outputs[0].token_ids == expected[prompt, name], (prompt, name)


def test_bad_adapters_and_ids_fail_alone(engine_factory, adapters, tmp_path, tiny_model_dir):
    engine = lora_engine(engine_factory)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.add_request("x", GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    engine.add_request("x", GREEDY, lora_request=adapters["first"])
    with pytest.raises(ValueError, match="an id stands for one adapter"):
        engine.add_request("y", GREEDY, lora_request=LoRARequest("other", 1, adapters["second"].lora_path))
    assert len(run_to_end(engine)) == 1  # the refused ones never joined; the good one ran
    plain = engine_factory(None, force_model_takeover=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="without enable_lora"):
        plain.add_request("x", GREEDY, lora_request=adapters["first"])


def test_llm_takes_one_adapter_per_prompt(adapters, expected, tiny_model_dir):
    from vllm_mlx.llm import LLM

    llm = LLM(str(tiny_model_dir), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, force_model_takeover=True)
    try:
        outputs = llm.generate(PROMPTS[:2], GREEDY, lora_request=[adapters["second"], None])
        assert [o.outputs[0].token_ids for o in outputs] == [expected[PROMPTS[0], "second"], expected[PROMPTS[1], None]]
    finally:
        llm.shutdown()


def test_blocks_follow_the_adapters_content_not_its_id(engine_factory, adapters, expected, tmp_path):
    """Through the disk tier, a later engine whose id 1 is another adapter hits nothing of the
    first one's blocks: hashes carry the adapter's content digest."""
    prompt = PROMPTS[0] * 3
    disk = str(tmp_path / "kv")
    first = lora_engine(engine_factory, kv_disk_path=disk)
    run(first, [(prompt, "first")], adapters)
    first.shutdown()
    reused_id = {"other": LoRARequest("other", 1, adapters["second"].lora_path)}
    later = lora_engine(engine_factory, kv_disk_path=disk)
    [output] = run(later, [(prompt, "other")], reused_id)
    assert output.num_cached_tokens == 0
    same = {"same": LoRARequest("same", 7, adapters["first"].lora_path)}  # the first adapter, another id
    [output] = run(later, [(prompt, "same")], same)
    assert output.num_cached_tokens > 0

"""Adapters in the batch, on real MLX (issue #30): each row of a batch mixing adapters and the
base model gives mlx-lm's greedy tokens for that adapter applied alone
(``mlx_lm.load(..., adapter_path=...)``), with fewer slots than adapters (requests wait for a
slot), through prefix hits and preemption; a block computed under one adapter never serves
another."""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

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


def test_an_adapter_rewritten_after_it_was_read_is_served_as_read(engine_factory, adapters, expected, tmp_path):
    """mlx-lm's trainer re-saves its adapter in place at each checkpoint. Once read, the adapter
    is the bytes read: a later truncation or rewrite ends nothing and changes no answer, and
    its digest (what its blocks are keyed by) stays the one of the bytes served."""
    folder = tmp_path / "training"
    shutil.copytree(adapters["first"].lora_path, folder)
    lora = LoRARequest("training", 11, str(folder))
    engine = lora_engine(engine_factory)
    digest = engine.register_lora(lora)
    weights = folder / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated before its first use
    [output] = run(engine, [(PROMPTS[0], "training")], {"training": lora})
    assert output.outputs[0].token_ids == expected[PROMPTS[0], "first"]
    shutil.copy(Path(adapters["second"].lora_path) / "adapters.safetensors", weights)  # re-saved: new weights
    [output] = run(engine, [(PROMPTS[1], "training")], {"training": lora})
    assert output.outputs[0].token_ids == expected[PROMPTS[1], "first"]
    assert engine.register_lora(lora) == digest


def test_an_unloaded_adapter_is_given_back_once_its_requests_finish(engine_factory, adapters, expected):
    engine = lora_engine(engine_factory)
    lora = adapters["first"]
    engine.register_lora(lora)
    adapter = weakref.ref(engine.lora.known[lora.lora_int_id].adapter)
    request_id = engine.add_request(PROMPTS[0], GREEDY, lora_request=lora)
    engine.step()  # admitted: it holds a slot
    engine.unregister_lora(lora.lora_int_id)
    assert lora.lora_int_id in engine.lora.known  # still in use
    final = run_to_end(engine)
    assert final[request_id].outputs[0].token_ids == expected[PROMPTS[0], "first"]
    gc.collect()
    assert engine.lora.known == {} and engine.lora.slot_of == {} and adapter() is None


def test_load_use_unload_cycles_keep_no_adapter_or_file(engine_factory, adapters):
    psutil = pytest.importorskip("psutil")
    engine = lora_engine(engine_factory)
    process = psutil.Process()

    def cycle(i: int) -> None:
        lora = LoRARequest(f"cycle-{i}", 100 + i, adapters["first"].lora_path)
        engine.register_lora(lora)
        run(engine, [(PROMPTS[2], "cycled")], {"cycled": lora})
        engine.unregister_lora(lora.lora_int_id)

    cycle(0)
    open_files = process.num_fds()
    for i in range(1, 21):
        cycle(i)
    assert process.num_fds() == open_files and engine.lora.known == {}


def test_a_base_request_is_admitted_past_an_adapter_waiting_for_a_slot(engine_factory, adapters, expected):
    """One slot, held by a running request: a request for another adapter waits for it, and a
    base-model request behind it is admitted at once (no head-of-line blocking)."""
    engine = lora_engine(engine_factory, max_loras=1)
    holder = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                lora_request=adapters["first"])  # fmt: skip
    engine.step()
    waiting = engine.add_request(PROMPTS[1], GREEDY, lora_request=adapters["second"])
    base = engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert {holder, base} <= running and waiting not in running
    final = run_to_end(engine)
    assert final[waiting].outputs[0].token_ids == expected[PROMPTS[1], "second"]
    assert final[base].outputs[0].token_ids == expected[PROMPTS[2], None]


def test_a_slot_that_cannot_be_written_fails_that_request_alone(engine_factory, adapters, expected, monkeypatch):
    engine = lora_engine(engine_factory)
    engine.register_lora(adapters["third"])
    load = engine.lora.slots.load

    def failing_for_third(slot, adapter):  # fault injection: writing this adapter's slot fails
        if adapter.path.name == "third":
            raise RuntimeError("injected")
        load(slot, adapter)

    monkeypatch.setattr(engine.lora.slots, "load", failing_for_third)
    failed = engine.add_request(PROMPTS[0], GREEDY, lora_request=adapters["third"])
    fine = engine.add_request(PROMPTS[1], GREEDY, lora_request=adapters["first"])
    final = run_to_end(engine)
    assert final[failed].outputs[0].finish_reason == "error" and "internal error" in final[failed].error
    assert final[fine].outputs[0].token_ids == expected[PROMPTS[1], "first"]
    assert engine.kv_cache.stats().num_used_blocks == 0

"""LoRA adapters read from mlx-lm's and PEFT's files and applied per row of one batch (issue #30,
first step: no engine yet). The oracle is mlx-lm itself: ``mlx_lm.load(model, adapter_path=...)``
computes each adapter alone; a batch whose rows use different adapters (and none) gives each row
the logits mlx-lm gives it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from lora_adapters import as_peft, write_mlx_lm_adapter

from vllm_mlx.lora import LoRARequest
from vllm_mlx.lora.adapter import AdapterError, load_adapter, read_adapter_files
from vllm_mlx.lora.batched import LoRASlots

TOKENS = [[5, 900, 31, 7, 4000, 12], [8, 8, 8, 2001, 2002, 2003], [100, 200, 300, 400, 500, 600],
          [17, 4, 99, 1024, 3, 7]]  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    first = write_mlx_lm_adapter(tiny_model_dir, root / "first", rank=4, scale=2.0, seed=1)
    second = write_mlx_lm_adapter(tiny_model_dir, root / "second", rank=8, scale=1.0, seed=2, keys=["self_attn.k_proj"])
    peft = as_peft(first, root / "first-peft", alpha=8.0)  # rank 4, alpha 8: scale 2, as ``first``
    dora = write_mlx_lm_adapter(tiny_model_dir, root / "dora", rank=4, scale=2.0, seed=4, fine_tune_type="dora")
    dora_peft = as_peft(dora, root / "dora-peft", alpha=8.0)
    return {"first": first, "second": second, "first-peft": peft, "dora": dora, "dora-peft": dora_peft}


def mlx_lm_logits(model_dir: Path, tokens: list[int], adapter: Path | None) -> mx.array:
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    return model(mx.array([tokens]))[0]


def test_each_row_gets_its_own_adapter_as_mlx_lm_computes_it(tiny_model_dir, adapters):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    slots = LoRASlots.wrap(model, max_loras=3, max_rank=8)
    slots.load(1, load_adapter(adapters["first"], model))
    slots.load(2, load_adapter(adapters["second"], model))
    slots.load(3, load_adapter(adapters["first-peft"], model))
    row_slots = [1, 0, 2, 3]
    with slots.rows(row_slots):
        batched = model(mx.array(TOKENS))
    references = [adapters["first"], None, adapters["second"], adapters["first"]]
    for row, reference in enumerate(references):
        expected = mlx_lm_logits(tiny_model_dir, TOKENS[row], reference)
        assert mx.allclose(batched[row], expected, atol=1e-4, rtol=1e-4).item(), row
    base = mlx_lm_logits(tiny_model_dir, TOKENS[0], None)
    assert not mx.allclose(batched[0], base, atol=1e-3).item()  # the adapter does change the output
    with slots.rows([0, 0, 0, 0]):  # no adapter row: the base model, untouched
        plain = model(mx.array(TOKENS))
    assert mx.array_equal(plain[1], batched[1]).item()


def test_dora_rows_rescale_as_mlx_lm_computes_them(tiny_model_dir, adapters, tmp_path):
    """DoRA adapters (mlx-lm's files and PEFT's, the same weights) beside a LoRA adapter and the
    base model in one batch: each row is mlx-lm's ``DoRALinear`` (or ``LoRALinear``) alone."""
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    slots = LoRASlots.wrap(model, max_loras=3, max_rank=8)
    for slot, name in enumerate(["dora", "first", "dora-peft"], start=1):
        slots.load(slot, load_adapter(adapters[name], model))
    with slots.rows([1, 2, 0, 3]):
        batched = model(mx.array(TOKENS))
    references = [adapters["dora"], adapters["first"], None, adapters["dora"]]
    for row, reference in enumerate(references):
        expected = mlx_lm_logits(tiny_model_dir, TOKENS[row], reference)
        assert mx.allclose(batched[row], expected, atol=1e-4, rtol=1e-4).item(), row
    as_lora = tmp_path / "as-lora"  # the same factors without the magnitudes: plain LoRA
    as_lora.mkdir()
    factors = mx.load(str(adapters["dora"] / "adapters.safetensors"))
    mx.save_safetensors(str(as_lora / "adapters.safetensors"), {k: v for k, v in factors.items() if not k.endswith(".m")})
    config = json.loads((adapters["dora"] / "adapter_config.json").read_text())
    (as_lora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "lora"}))
    assert not mx.allclose(batched[0], mlx_lm_logits(tiny_model_dir, TOKENS[0], as_lora), atol=1e-3).item()
    slots.load(1, load_adapter(adapters["first"], model))  # a DoRA slot rewritten with LoRA stops rescaling
    with slots.rows([1]):
        logits = model(mx.array(TOKENS[:1]))[0]
    assert mx.allclose(logits, mlx_lm_logits(tiny_model_dir, TOKENS[0], adapters["first"]), atol=1e-4).item()


def test_dora_keeps_a_biased_layer_exact(tmp_path, default_model_dir):
    """Qwen2's attention projections have biases: DoRA rescales the output without its bias
    (mlx-lm adds it after), and rows of other slots keep the base output bit for bit."""
    import mlx_lm
    from tiny_model import build_tiny_llama

    qwen2 = build_tiny_llama(tmp_path / "qwen2", default_model_dir, model_type="qwen2", seed=3)
    dora = write_mlx_lm_adapter(qwen2, tmp_path / "dora", rank=4, scale=2.0, seed=5,
                                keys=["self_attn.q_proj", "self_attn.v_proj"], fine_tune_type="dora")  # fmt: skip
    model, _ = mlx_lm.load(str(qwen2))
    base = model(mx.array(TOKENS[:2]))
    slots = LoRASlots.wrap(model, max_loras=1, max_rank=4)
    slots.load(1, load_adapter(dora, model))
    with slots.rows([1, 0]):
        batched = model(mx.array(TOKENS[:2]))
    assert mx.allclose(batched[0], mlx_lm_logits(qwen2, TOKENS[0], dora), atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(batched[1], base[1]).item()


def test_a_slot_can_be_cleared_and_reused(tiny_model_dir, adapters):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    slots = LoRASlots.wrap(model, max_loras=1, max_rank=8)
    slots.load(1, load_adapter(adapters["second"], model))
    slots.load(1, load_adapter(adapters["first"], model))  # replaces it whole: k_proj goes back to base
    with slots.rows([1]):
        logits = model(mx.array(TOKENS[:1]))[0]
    assert mx.allclose(logits, mlx_lm_logits(tiny_model_dir, TOKENS[0], adapters["first"]), atol=1e-4).item()
    slots.clear(1)
    with slots.rows([1]):
        logits = model(mx.array(TOKENS[:1]))[0]
    assert mx.allclose(logits, mlx_lm_logits(tiny_model_dir, TOKENS[0], None), atol=1e-5).item()


def test_adapters_that_cannot_serve_this_model_are_refused(tiny_model_dir, adapters, tmp_path, default_model_dir):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(tmp_path, model)
    other = write_mlx_lm_adapter(default_model_dir, tmp_path / "other", rank=4, scale=1.0, seed=3)
    with pytest.raises(AdapterError, match="does not have"):  # 30 layers' adapter, 2 layers here
        load_adapter(other, model)
    wider = tmp_path / "wider"
    wider.mkdir()
    factors = mx.load(str(adapters["first"] / "adapters.safetensors"))
    name = next(k for k in factors if k.endswith("q_proj.lora_a"))
    factors[name] = mx.concatenate([factors[name], factors[name]])  # twice the input features
    mx.save_safetensors(str(wider / "adapters.safetensors"), factors)
    (wider / "adapter_config.json").write_text((adapters["first"] / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match="for another model"):
        load_adapter(wider, model)
    with pytest.raises(AdapterError, match="trained on"):
        load_adapter(adapters["first-peft"], model, base_model="some-other-model")
    load_adapter(adapters["first-peft"], model, base_model="/models/TINY")  # the same name, any folder
    for kind, message in [("dora", "has no DoRA magnitude"), ("full", "only LoRA and DoRA")]:
        other = tmp_path / kind
        other.mkdir()
        (other / "adapters.safetensors").write_bytes((adapters["first"] / "adapters.safetensors").read_bytes())
        (other / "adapter_config.json").write_text(json.dumps({"fine_tune_type": kind, "lora_parameters": {"scale": 1}}))
        with pytest.raises(AdapterError, match=message):
            load_adapter(other, model)
    config = json.loads((adapters["dora"] / "adapter_config.json").read_text())
    (tmp_path / "lora-with-m").mkdir()
    (tmp_path / "lora-with-m" / "adapters.safetensors").write_bytes((adapters["dora"] / "adapters.safetensors").read_bytes())
    (tmp_path / "lora-with-m" / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "lora"}))
    with pytest.raises(AdapterError, match="'.*m' is not a LORA weight"):
        load_adapter(tmp_path / "lora-with-m", model)
    slots = LoRASlots.wrap(model, max_loras=1, max_rank=4)
    with pytest.raises(AdapterError, match="rank 8"):
        slots.load(1, load_adapter(adapters["second"], model))


def test_lora_requests_are_checked():
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert (request.name, request.id, request.path) == ("sql", 1, "/adapters/sql")
    for bad in [("", 1, "p"), ("x", 0, "p"), ("x", True, "p"), ("x", 1, "")]:
        with pytest.raises(ValueError, match="LoRARequest"):
            LoRARequest(*bad)


def copy_adapter(source: Path, out: Path, config: dict | None = None, factors: dict | None = None) -> Path:
    """``source``'s adapter in ``out``, its config or factors replaced where given."""
    out.mkdir()
    if factors is None:
        shutil.copy(source / "adapters.safetensors", out / "adapters.safetensors")
    else:
        mx.save_safetensors(str(out / "adapters.safetensors"), factors)
    text = json.dumps(config) if config is not None else (source / "adapter_config.json").read_text()
    (out / "adapter_config.json").write_text(text)
    return out


def test_files_that_lie_or_stall_are_refused_at_once(tiny_model_dir, adapters, tmp_path):
    """An adapter folder is read whole, regular files only, sized before it is read: a FIFO
    (which would block a reader forever), a sparse file declaring more than any adapter of these
    slots can hold, or a header that disagrees with the data fail with AdapterError."""
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    slots = LoRASlots.wrap(model, max_loras=1, max_rank=8)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    shutil.copy(adapters["first"] / "adapter_config.json", fifo)
    os.mkfifo(fifo / "adapters.safetensors")
    with pytest.raises(AdapterError, match="not a regular file"):
        read_adapter_files(fifo, slots.max_adapter_bytes)
    sparse = copy_adapter(adapters["first"], tmp_path / "sparse")
    os.truncate(sparse / "adapters.safetensors", slots.max_adapter_bytes + 1)
    with pytest.raises(AdapterError, match="at most"):
        read_adapter_files(sparse, slots.max_adapter_bytes)
    assert (adapters["first"] / "adapters.safetensors").stat().st_size < slots.max_adapter_bytes
    padded = copy_adapter(adapters["first"], tmp_path / "padded")
    with open(padded / "adapters.safetensors", "ab") as file:
        file.write(b"\0" * 64)  # data the header does not declare
    with pytest.raises(AdapterError, match="declare"):
        load_adapter(read_adapter_files(padded, slots.max_adapter_bytes), model)
    outside = tmp_path / "served" / "linked"
    outside.mkdir(parents=True)
    shutil.copy(adapters["first"] / "adapter_config.json", outside)
    (outside / "adapters.safetensors").symlink_to(adapters["first"] / "adapters.safetensors")
    with pytest.raises(AdapterError, match="links outside"):
        read_adapter_files(outside, within=tmp_path / "served")
    read_adapter_files(outside)  # the operator's own path: links are theirs to make


def test_adapters_with_non_finite_or_absurd_values_are_refused(tiny_model_dir, adapters, tmp_path):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_model_dir))
    factors = mx.load(str(adapters["first"] / "adapters.safetensors"))
    name = next(k for k in factors if k.endswith("lora_b"))
    poisoned = {**factors, name: factors[name] * mx.array(float("nan"))}
    with pytest.raises(AdapterError, match="non-finite"):
        load_adapter(copy_adapter(adapters["first"], tmp_path / "nan", factors=poisoned), model)
    config = json.loads((adapters["first"] / "adapter_config.json").read_text())
    for i, scale in enumerate([10**400, float("inf"), "2", True]):
        bad = {**config, "lora_parameters": {**config["lora_parameters"], "scale": scale}}
        text = json.dumps(bad).replace("Infinity", "1e999")
        folder = copy_adapter(adapters["first"], tmp_path / f"scale-{i}")
        (folder / "adapter_config.json").write_text(text)
        with pytest.raises(AdapterError, match="finite number"):
            load_adapter(folder, model)
    peft = json.loads((adapters["first-peft"] / "adapter_config.json").read_text())
    folder = tmp_path / "alpha"
    shutil.copytree(adapters["first-peft"], folder)
    (folder / "adapter_config.json").write_text(json.dumps({**peft, "lora_alpha": 10**400}))
    with pytest.raises(AdapterError, match="lora_alpha"):
        load_adapter(folder, model)
    deep = copy_adapter(adapters["first"], tmp_path / "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterError, match="not JSON"):
        load_adapter(deep, model)
    with pytest.raises(AdapterError, match="unreadable"):
        read_adapter_files(str(adapters["first"]) + "\0x")

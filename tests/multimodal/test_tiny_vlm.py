"""The tiny random-weight VLMs of tests/tiny_vlm.py load and run offline through mlx-vlm."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the `vlm` extra) is not installed")

import mlx.core as mx
from PIL import Image
from tiny_vlm import (
    build_tiny_llava,
    build_tiny_qwen2_5_vl,
    build_tiny_qwen2_vl,
    drop_text_kwargs_for_images,
)

QWEN_IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _image(seed: int, size=(64, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _last_logits(model, inputs) -> mx.array:
    """Last-position logits of a full forward. ``mask=None``: the model builds the causal mask
    (LLaVA's ``Model.__call__`` would take an attention mask given here as the attention mask
    itself, which makes the prefill non-causal)."""
    extra = {
        k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")
    }
    out = model(inputs["input_ids"], pixel_values=inputs["pixel_values"], mask=None, **extra)
    return getattr(out, "logits", out)[0, -1]


def _count(inputs, token_id: int) -> int:
    return int((np.array(inputs["input_ids"]) == token_id).sum())


# --- Qwen2-VL and Qwen2.5-VL ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_vlm(request, tmp_path_factory):
    from mlx_vlm import load

    if request.param == "qwen2_vl":
        model_dir = request.getfixturevalue("tiny_qwen2_vl_dir")
    else:
        model_dir = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2-5-vl"))
    model, processor = load(str(model_dir))
    return model_dir, model, processor


def test_qwen_config_matches_tokenizer(qwen_vlm):
    model_dir, model, processor = qwen_vlm
    config = json.loads((model_dir / "config.json").read_text())
    tok = processor.tokenizer
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["vocab_size"] == len(tok)
    assert model.config.image_token_id == config["image_token_id"]


def test_qwen_chat_template_places_images(qwen_vlm):
    from mlx_vlm.prompt_utils import apply_chat_template

    _, model, processor = qwen_vlm
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    assert prompt.startswith("<|im_start|>user\n")
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.count(QWEN_IMAGE_BLOCK) == 1 and "Describe" in prompt
    two = apply_chat_template(processor, model.config, "Compare", num_images=2)
    assert two.count(QWEN_IMAGE_BLOCK) == 2
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
    ]
    rendered = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{QWEN_IMAGE_BLOCK}What?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "size, grid",  # PIL (width, height) -> (t, h, w) patches of 14 px; merged 2x2 per token
    [((64, 64), (1, 4, 4)), ((100, 60), (1, 4, 8)), ((500, 300), (1, 6, 10)), ((9, 9), (1, 4, 4))],
)
def test_qwen_processor_expands_image_tokens(qwen_vlm, size, grid):
    _, model, processor = qwen_vlm
    inputs = processor(
        text=[f"{QWEN_IMAGE_BLOCK}hi"], images=[_image(0, size)], return_tensors="mlx"
    )
    assert tuple(inputs["image_grid_thw"].tolist()[0]) == grid
    t, h, w = grid
    assert _count(inputs, model.config.image_token_id) == t * h * w // 4
    assert inputs["pixel_values"].shape == (t * h * w, 3 * 2 * 14 * 14)


def test_qwen_generates_deterministically_and_sees_the_image(qwen_vlm):
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    _, model, processor = qwen_vlm
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    a, b = _image(1), _image(2)

    first = generate(model, processor, prompt, image=[a], max_tokens=4, temperature=0.0)
    again = generate(model, processor, prompt, image=[a], max_tokens=4, temperature=0.0)
    assert first.generation_tokens == 4
    assert first.prompt_tokens == len(processor.tokenizer(prompt)["input_ids"]) - 1 + 4
    assert first.text == again.text

    logits_a = _last_logits(model, processor(text=[prompt], images=[a], return_tensors="mlx"))
    logits_b = _last_logits(model, processor(text=[prompt], images=[b], return_tensors="mlx"))
    assert mx.abs(logits_a - logits_b).max().item() > 1.0
    text_only = generate(
        model, processor, apply_chat_template(processor, model.config, "Hi"), max_tokens=3
    )
    assert text_only.generation_tokens >= 1


def test_qwen_two_images_in_one_prompt(qwen_vlm):
    _, model, processor = qwen_vlm
    prompt = f"{QWEN_IMAGE_BLOCK}{QWEN_IMAGE_BLOCK}Compare"
    inputs = processor(
        text=[prompt], images=[_image(1), _image(2, (100, 60))], return_tensors="mlx"
    )
    assert _count(inputs, model.config.image_token_id) == 4 + 8
    swapped = processor(
        text=[prompt], images=[_image(2, (100, 60)), _image(1)], return_tensors="mlx"
    )
    assert mx.abs(_last_logits(model, inputs) - _last_logits(model, swapped)).max().item() > 0


@pytest.mark.parametrize("build", [build_tiny_qwen2_vl, build_tiny_llava])
def test_build_is_reproducible(tmp_path, build):
    one, two = build(tmp_path / "one"), build(tmp_path / "two")
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    for path in one.iterdir():
        assert path.read_bytes() == (two / path.name).read_bytes(), path.name
    other_seed = build(tmp_path / "three", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (
        one / "model.safetensors"
    ).read_bytes()


# --- LLaVA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    from mlx_vlm import load

    model, processor = load(str(tiny_llava_dir))
    return tiny_llava_dir, model, processor


def test_llava_processor_without_padding_expands_image_token(llava):
    from mlx_vlm.prompt_utils import apply_chat_template

    _, model, processor = llava
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    assert prompt == "USER: Describe<image>\n ASSISTANT:"
    image_id = model.config.image_token_index
    inputs = processor(text=[prompt], images=[_image(1, (100, 60))], return_tensors="mlx")
    assert inputs["pixel_values"].shape == (1, 3, 28, 28)
    assert _count(inputs, image_id) == 4  # (28 / 14)^2 patches; the CLS position is dropped
    two = processor(text=["<image><image>hi"], images=[_image(1), _image(2)], return_tensors="mlx")
    assert two["pixel_values"].shape == (2, 3, 28, 28) and _count(two, image_id) == 8


def test_llava_forward_with_our_own_image_token_expansion(llava):
    """The engine-side route: image processor + tokenizer, <image> repeated per patch."""
    from mlx_vlm.prompt_utils import apply_chat_template

    _, model, processor = llava
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    a, b = _image(1), _image(2)
    pixel_values = processor.image_processor([a], return_tensors="np")["pixel_values"]
    patches = (pixel_values.shape[-2] // 14) * (pixel_values.shape[-1] // 14)
    ids = processor.tokenizer(prompt.replace("<image>", "<image>" * patches))["input_ids"]
    ours = {"input_ids": mx.array([ids]), "pixel_values": mx.array(pixel_values)}
    theirs = processor(text=[prompt], images=[a], return_tensors="mlx")
    assert theirs["input_ids"].tolist() == [ids]
    logits = _last_logits(model, ours)
    assert mx.array_equal(logits, _last_logits(model, theirs))
    other = _last_logits(model, processor(text=[prompt], images=[b], return_tensors="mlx"))
    assert mx.abs(logits - other).max().item() > 1.0


def test_llava_mlx_vlm_generate(llava):
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    _, model, processor = llava
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    image = _image(1)
    inputs = processor(text=[prompt], images=[image], return_tensors="mlx")
    prepared = generate_prepared(model, processor, prompt, inputs, max_tokens=4)
    assert prepared.generation_tokens == 4

    # Greedy decoding by hand (full causal forwards) gives the same tokens.
    ids, tokens = inputs["input_ids"], []
    for _ in range(4):
        step = {"input_ids": ids, "pixel_values": inputs["pixel_values"]}
        token = int(mx.argmax(_last_logits(model, step)))
        tokens.append(token)
        ids = mx.concatenate([ids, mx.array([[token]])], axis=1)
    assert prepared.text == processor.tokenizer.decode(tokens)

    # mlx-vlm's own input preparation passes padding=True through to the image processor ...
    try:
        generate(model, processor, prompt, image=[image], max_tokens=1)
    except ValueError as e:  # transformers 5
        assert "unexpected keyword argument 'padding'" in str(e)
    # ... which the wrapper drops.
    drop_text_kwargs_for_images(processor)
    via_image = generate(model, processor, prompt, image=[image], max_tokens=4, temperature=0.0)
    assert via_image.text == prepared.text


@pytest.mark.parametrize("build", [build_tiny_qwen2_vl, build_tiny_llava])
def test_real_tokenizer_variant(tmp_path, default_model_dir, build):
    """With ``tokenizer_dir`` the special tokens are added to a real (SmolLM2) vocabulary."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    model_dir = build(tmp_path / "m", default_model_dir)
    model, processor = load(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(processor.tokenizer) > 49152
    prompt = apply_chat_template(processor, model.config, "Describe", num_images=1)
    inputs = processor(text=[prompt], images=[_image(1)], return_tensors="mlx")
    image_id = config.get("image_token_id", config.get("image_token_index"))
    assert _count(inputs, image_id) == 4
    out = generate_prepared(model, processor, prompt, inputs, max_tokens=3)
    assert out.generation_tokens == 3


def generate_prepared(model, processor, prompt: str, inputs, max_tokens: int):
    """mlx-vlm's greedy ``generate`` from already processed inputs (no image kwargs involved)."""
    from mlx_vlm import generate

    return generate(
        model,
        processor,
        prompt,
        input_ids=inputs["input_ids"],
        pixel_values=inputs["pixel_values"],
        mask=inputs["attention_mask"],
        max_tokens=max_tokens,
        temperature=0.0,
        **{k: v for k, v in inputs.items() if k == "image_grid_thw"},
    )

"""Tiny random-weight Idefics2, Phi and Moondream vision-language models (mlx-vlm loads them offline).

As tests/tiny_vlm.py (its helpers build the tokenizer, weights and config files here):

* :func:`build_tiny_idefics2`: Idefics2 (a SigLIP-style tower at 28 px: 2x2 patches, a SwiGLU
  projector and a perceiver resampler down to 4 latents: 4 tokens per image; a mistral text
  model). Its processor writes ``<fake_token_around_image> <image> x 4 <fake_token_around_image>``
  for an image, merges the marker where two images meet (one ``<fake_token_around_image>``
  between them) and puts a space after the closing marker when text follows it directly.
* :func:`build_tiny_phi4mm`: Phi-4-multimodal (SigLIP2 tower, a phi3 text model with vision and
  speech LoRA, a conformer audio encoder, here 1 block wide 32): one ``-200`` per image, expanded
  inside the model (an image the model expands). Phi-4-SigLIP's builder: tests/tiny_vlm_phi4.py.
* :func:`build_tiny_moondream3`: Moondream 3 (its own tower on 378 px crops: 729 tokens, a
  mixture-of-experts text model): the processor puts one image after the BOS whatever the text
  says and rewrites the text as a question; no placeholder to expand (refused at load).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _instantiate, _make_tokenizer, _save_model, _save_tokenizer, _write_json, square_image_processor

IDEFICS2_SPECIAL_TOKENS = ["<pad>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]

# Idefics2's template shape: "User:<image>Describe.<end_of_utterance>\nAssistant:".
IDEFICS2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

IDEFICS2_TEXT_CONFIG = {
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Images resized to 28x28 (no padding, so an image alone and in a batch give the same pixels):
# 2x2 patches of 14 px, resampled by the perceiver to 4 latents.
IDEFICS2_VISION_CONFIG = {
    "model_type": "idefics2_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "patch_size": 14,
    "image_size": 28,
    "num_channels": 3,
}

IDEFICS2_PERCEIVER_CONFIG = {
    "model_type": "idefics2_perceiver",
    "num_key_value_heads": 2,
    "resampler_depth": 1,
    "resampler_head_dim": 16,
    "resampler_n_heads": 4,
    "resampler_n_latents": 4,
}


def build_tiny_idefics2(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Idefics2 directory (4 tokens per image, a mistral text model)."""
    from mlx_vlm.models import idefics2

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, IDEFICS2_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in IDEFICS2_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "idefics2",
        "architectures": ["Idefics2ForConditionalGeneration"],
        "text_config": {**IDEFICS2_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(IDEFICS2_VISION_CONFIG),
        "perceiver_config": dict(IDEFICS2_PERCEIVER_CONFIG),
        "vocab_size": vocab_size,
        "image_token_id": ids["<image>"],
        "eos_token_id": ids["<end_of_utterance>"],
    }
    model = _instantiate(idefics2, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<end_of_utterance>", "<pad>", 4096, IDEFICS2_CHAT_TEMPLATE)
    preprocessor = square_image_processor(
        "Idefics2ImageProcessor", IDEFICS2_VISION_CONFIG["image_size"], resample=2,
        processor_class="Idefics2Processor", do_convert_rgb=True, do_image_splitting=False, do_pad=True,
    )  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    latents = IDEFICS2_PERCEIVER_CONFIG["resampler_n_latents"]
    _write_json(out_dir / "processor_config.json", {"processor_class": "Idefics2Processor", "image_seq_len": latents})
    return out_dir


PHI4_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]

# Phi-4's ChatML shape; an image part renders as <image>, which the processor tokenizes as -200.
PHI4_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# A phi3 text model (fused qkv and gate_up projections).
PHI4_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# SigLIP at 28 px: 2x2 patches of 14 px (4 features per image).
PHI4_VISION_CONFIG = {
    "model_type": "siglip2_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
    "num_patches": 4,
}


# Phi-4-multimodal's conformer audio encoder, 1 block of width 32 (its defaults are 24 of 1024).
PHI4MM_AUDIO_CONFIG = {
    "attention_dim": 32, "attention_heads": 2, "num_blocks": 1, "linear_units": 64, "input_size": 80,
    "ext_pw_out_channel": 32, "depthwise_seperable_out_channel": 32, "conv_channels": 32,
}  # fmt: skip


def build_tiny_phi4mm(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Phi-4-multimodal directory (SigLIP2 at 28 px, a phi3 text model, a
    1-block conformer audio encoder); as Phi-4-SigLIP, one -200 per image expanded in the model."""
    from mlx_vlm.models import phi4mm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, PHI4_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in PHI4_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    patches = (PHI4_VISION_CONFIG["image_size"] // PHI4_VISION_CONFIG["patch_size"]) ** 2
    config = {
        "model_type": "phi4mm",
        "architectures": ["Phi4MMForCausalLM"],
        **PHI4_TEXT_CONFIG,
        "vocab_size": vocab_size,
        "vision_config": dict(PHI4_VISION_CONFIG),
        "mm_hidden_size": PHI4_VISION_CONFIG["hidden_size"],
        "min_num_patches": patches,
        "max_num_patches": patches,
        "embd_layer": {"image_embd_layer": {"crop_size": PHI4_VISION_CONFIG["image_size"]}},
        "audio_processor": {"config": dict(PHI4MM_AUDIO_CONFIG)},
        "audio_token_index": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    model = _instantiate(phi4mm, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, PHI4_CHAT_TEMPLATE)
    return out_dir


MOONDREAM_SPECIAL_TOKENS = ["<|endoftext|>", "<|md_reserved_0|>", "<|md_reserved_1|>", "<|md_reserved_2|>"]

# Moondream 3's text model: layer 0 dense, layer 1 a mixture of experts (2 of 4 per token).
MOONDREAM3_TEXT_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 16, "rope_dim": 8, "rope_theta": 10000.0, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_start_layer": 1,
}  # fmt: skip

# The processor writes 729 image tokens (a 27x27 grid of 14 px patches on a 378 px crop) whatever
# the tower's size, so the crop stays 378 px; one crop per image, a tower 32 wide with 1 layer.
MOONDREAM3_VISION_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "patch_size": 14, "crop_size": 378, "max_crops": 1, "proj_inner_dim": 64, "proj_out_dim": 64,
}  # fmt: skip


def build_tiny_moondream3(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Moondream 3 directory (its tower on one 378 px crop: 729 tokens, a
    text model with a mixture of experts); the processor puts the image after the BOS."""
    from mlx_vlm.models import moondream3

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, MOONDREAM_SPECIAL_TOKENS)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id("<|endoftext|>")
    config = {
        "model_type": "moondream3",
        "architectures": ["HfMoondream"],
        "text_config": {**MOONDREAM3_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(MOONDREAM3_VISION_CONFIG),
        "eos_token_id": eos,
        "bos_token_id": eos,
    }
    model = _instantiate(moondream3, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|endoftext|>", "<|endoftext|>", 4096, PHI4_CHAT_TEMPLATE)
    return out_dir

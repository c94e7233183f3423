"""Tiny random-weight vision-language models whose image embeddings come with features their text
model takes beside them (``visual_pos_masks``, ``deepstack_visual_embeds``), built as tests/tiny_vlm.py
builds its families (its helpers, char-level tokenizer, weights scaled x4 so greedy logits are far
from ties), each with mlx-vlm's own processor:

* :func:`build_tiny_cohere_compass`: Cohere Compass (Qwen3-VL-style packed tower, 16 px patches,
  2x2 merge, learned positions, deepstack from vision blocks 0 and 1 added after text layers 0 and
  1 at the image tokens), a text model of layer-normed parallel blocks with interleaved multi-axis
  rotary positions from its ``get_rope_index``. ``<|IMAGE_PAD|>`` expands to one pad per merged
  patch (no markers of its own: the template frames it with ``<|VISION_START|>`` / ``<|VISION_END|>``,
  which ``get_rope_index`` reads); a 100x60 picture is 6 tokens.
* :func:`build_tiny_zaya1_vl`: Zaya1-VL (Qwen2.5-VL's tower, a flat text config with CCA attention,
  whose convolution state and previous hidden state sit in a ``CacheList`` beside the KV, a vision
  LoRA applied where ``visual_pos_masks`` is True, MoE MLPs): its image-token mask passes the check,
  its ``CacheList`` layers are refused at load (and mlx-vlm 0.7.10's own chunked prefill calls its
  text model with ``inputs=``, a keyword it does not take, so no oracle runs it either).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    QWEN2_5_VL_VISION_CONFIG,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    _instantiate,
    _make_tokenizer,
    _patch_image_processor,
    _save_model,
    _save_tokenizer,
    _write_json,
)

__all__ = ["build_tiny_cohere_compass", "build_tiny_zaya1_vl"]


def _frame_chat_template(image_text: str, start: str, end: str) -> str:
    """A template of ``{start}role\\n...{end}`` turns whose image parts render as ``image_text``."""
    return (
        "{% for message in messages %}" + start + "{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + image_text +
        "{% elif 'text' in part %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )  # fmt: skip


# -- Cohere Compass ------------------------------------------------------------------------------

COHERE_COMPASS_SPECIAL_TOKENS = [
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>",
    "<|placeholder|>", "<PAD>",
]  # fmt: skip
COHERE_COMPASS_IMAGE_TEXT = "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"

# Text: hidden 64, 2 layers, head_dim 16 (8 rotary frequencies: 4/2/2 over t, h, w, interleaved).
COHERE_COMPASS_TEXT_CONFIG = {
    "model_type": "cohere_compass_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    # Per layer type: transformers' config (which mlx-vlm's load also builds) takes no list at the top.
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}},
}

# Vision: width 32, 2 blocks (deepstack taps both), 16 px patches merged 2x2 to the text width.
COHERE_COMPASS_VISION_CONFIG = {
    "model_type": "cohere_compass_vision",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
}


def build_tiny_cohere_compass(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Cohere Compass directory (module doc): images of 64x64 (4 tokens) up to
    128x128 px (16 tokens)."""
    from mlx_vlm.models import cohere_compass

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, COHERE_COMPASS_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in COHERE_COMPASS_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "cohere_compass",
        "text_config": {**COHERE_COMPASS_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": COHERE_COMPASS_VISION_CONFIG,
        "image_token_id": ids["<|IMAGE_PAD|>"],
        "vision_start_token_id": ids["<|VISION_START|>"],
        "vision_end_token_id": ids["<|VISION_END|>"],
        "eos_token_id": ids["<|END_OF_TURN_TOKEN|>"],
        "pad_token_id": ids["<PAD>"],
        "min_pixels": 64 * 64,
        "max_pixels": 128 * 128,
    }
    model = _instantiate(cohere_compass, config, seed)
    _save_model(out_dir, model, config)
    template = _frame_chat_template(COHERE_COMPASS_IMAGE_TEXT, "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
    _save_tokenizer(out_dir, tok, "<|END_OF_TURN_TOKEN|>", "<PAD>", 4096, template)
    preprocessor = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                    "min_pixels": 64 * 64, "max_pixels": 128 * 128}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


# -- Zaya1-VL ------------------------------------------------------------------------------------

# Text (flat, at the config's root): hidden 64, 2 layers, 2 experts, LoRA ranks 4.
ZAYA1_VL_TEXT_CONFIG = {
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_hidden_layers": 2,
    "num_experts": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_key_value_heads": 2,
    "num_query_groups": 2,
    "zaya_mlp_expansion": 16,
    "vision_lora_rank_attn": 4,
    "vision_lora_rank_mlp": 4,
    "max_position_embeddings": 4096,
}


def build_tiny_zaya1_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Zaya1-VL directory (module doc): Qwen2.5-VL's tiny tower (its vision
    config must say ``qwen2_5_vl``), images of 56x56 (4 tokens) up to 112x112 px (16 tokens)."""
    from mlx_vlm.models import zaya1_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    config = {
        "model_type": "zaya1_vl",
        **ZAYA1_VL_TEXT_CONFIG,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|im_start|>"],
        "vision_config": dict(QWEN2_5_VL_VISION_CONFIG),
        "image_token_id": ids["<|image_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    model = _instantiate(zaya1_vl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE)
    pixels = (56 * 56, 112 * 112)
    preprocessor = _patch_image_processor("Qwen2VLImageProcessor", "Zaya1VLProcessor", config["vision_config"], pixels)
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

"""Tiny random-weight Zaya1-VL, built as tests/tiny_vlm.py builds its families (its helpers, char-level
tokenizer, weights scaled x4 so greedy logits are far from ties), with mlx-vlm's own processor:

* :func:`build_tiny_zaya1_vl`: Zaya1-VL: Qwen2.5-VL's tower and processor under a flat text config whose
  attention is CCA: queries and keys through two causal depthwise convolutions over the sequence, values
  half from the previous token's hidden state, so each layer's cache is a ``CacheList`` of a ``KVCache``
  and an ``ArraysCache`` (the convolution's last inputs, the last hidden state) that the engine holds
  per request (``executor/held_caches.py``); a vision LoRA added where ``visual_pos_masks`` is True
  (attention and experts); a MoE with a skip expert (mixture of depths), routed through a chain of
  router states across layers. Its CCA key temperature (``temp``, zeros at init: keys of zeros,
  uniform attention, tokens that barely depend on their order) is drawn in [1, 2) here. Its processor
  expands the text ``<image>`` (its default ``image_token``), so that is a special token here, the
  config's ``image_token_id`` (the real checkpoint's 262147, past Gemma 3's vocabulary), which the chat
  template frames with ``<|vision_start|>`` / ``<|vision_end|>`` (nothing reads them: 1-D positions).
  The oracle is its model's own call (mlx-vlm 0.7.10's generation prefills with ``inputs=``, which its
  text model does not take, for any prompt of more than one token).
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

__all__ = ["build_tiny_zaya1_vl"]

ZAYA1_VL_IMAGE_TOKEN = "<image>"
ZAYA1_VL_SPECIAL_TOKENS = [*QWEN_SPECIAL_TOKENS, ZAYA1_VL_IMAGE_TOKEN]
ZAYA1_VL_IMAGE_TEXT = "<|vision_start|>" + ZAYA1_VL_IMAGE_TOKEN + "<|vision_end|>"
ZAYA1_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", ZAYA1_VL_IMAGE_TEXT
)

# Text (flat, at the config's root): hidden 64, 2 layers, 2 experts (and the skip one), LoRA ranks 4.
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
    import mlx.core as mx
    from mlx_vlm.models import zaya1_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, ZAYA1_VL_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in ZAYA1_VL_SPECIAL_TOKENS}
    config = {
        "model_type": "zaya1_vl",
        **ZAYA1_VL_TEXT_CONFIG,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": ids["<|im_start|>"],
        "vision_config": dict(QWEN2_5_VL_VISION_CONFIG),
        "image_token_id": ids[ZAYA1_VL_IMAGE_TOKEN],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    model = _instantiate(zaya1_vl, config, seed)
    for layer in model.language_model.model.layers:  # keys of zeros at init: give attention something to do
        cca = layer.attn.self_attn.qkv
        cca.temp = mx.random.uniform(1.0, 2.0, cca.temp.shape)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, ZAYA1_VL_CHAT_TEMPLATE)
    pixels = (56 * 56, 112 * 112)
    preprocessor = _patch_image_processor("Qwen2VLImageProcessor", "Zaya1VLProcessor", config["vision_config"], pixels)
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

"""Tiny random-weight vision-language models of families served or refused one at a time.

Built as tests/tiny_vlm.py builds its families (its helpers, weights scaled x4 so greedy logits
are far from ties), each with mlx-vlm's own processor class:

* :func:`build_tiny_locateanything`: LocateAnything (Kimi-VL's MoonViT at the image's own size,
  2x2 merge, a Qwen2 text model). Its processor expands numbered ``<image-N>`` placeholders (the
  number ignored: images in order) to ``<img> <IMG_CONTEXT> x n </img>``, never its own
  ``image_token``. Built for parallel block decoding as well (``pbd_generate``, ``causal_attn``),
  but mlx-vlm's ordinary generation, the oracle, is autoregressive and causal. A 100x60 picture
  is padded to 112x84 px: 4x3 = 12 tokens.
* :func:`build_tiny_inkling`: Inkling (a hierarchical-MLP patchifier, one token per 40 px tile,
  no attention; a text model without rotary positions: a banded relative-bias mask, log-scaled
  queries on global layers, short convolutions on keys, values and both residual branches, whose
  states sit beside the KV cache in a ``CacheList``, and a sigmoid-routed MoE). Its attention
  takes query positions from the number of keys its cache returns, one start for the whole call.
  A 100x60 picture is 2 rows of 3 tiles: 6 tokens.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    CHARS,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)
from tiny_vlm_others import _simple_chat_template

__all__ = [
    "build_tiny_inkling",
    "build_tiny_locateanything",
]


# -- PLaMo 2 VL ---------------------------------------------------------------------------------

PLAMO2VL_SPECIAL_TOKENS = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:pad|>", "<plamo:image>", "<siglip2:img>",
                           "</siglip2:img>"]  # fmt: skip


def _plamo2_vocabulary(special_tokens: list[str]) -> list[list]:
    """Rows of PLaMo 2's ``tokenizer.jsonl``: ``[piece, score]`` (``[piece, score, "BYTE"]`` for the
    256 byte fallbacks its tokenizer requires), the special tokens first, then one piece a character."""
    rows = [[token, 0.0, "CONTROL"] for token in special_tokens]
    rows += [[f"<0x{byte:02X}>", 0.0, "BYTE"] for byte in range(256)]
    rows += [[ch, -1.0] for ch in CHARS]
    return rows


# -- LocateAnything -----------------------------------------------------------------------------

LOCATEANYTHING_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<IMG_CONTEXT>", "<img>", "</img>"]

# Qwen's turns; an image part renders as the processor's numbered placeholder, one number per image.
LOCATEANYTHING_CHAT_TEMPLATE = (
    "{% set n = namespace(image=0) %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{% set n.image = n.image + 1 %}"
    "<image-{{ n.image }}>{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_locateanything(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight LocateAnything directory (module doc): text hidden 32 and 2 layers, a
    1-layer MoonViT of width 32 (learned 4x4 positions, interpolated)."""
    from mlx_vlm.models import locateanything

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(None, LOCATEANYTHING_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LOCATEANYTHING_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
              "merge_kernel_size": [2, 2]}  # fmt: skip
    text = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": vocab_size, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}  # fmt: skip
    config = {
        "model_type": "locateanything",
        "text_config": text,
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_index": ids["<IMG_CONTEXT>"],
        "eos_token_id": [ids["<|im_end|>"]],
    }
    _save_model(out_dir, _instantiate(locateanything, config, seed), config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, LOCATEANYTHING_CHAT_TEMPLATE)
    _write_json(out_dir / "preprocessor_config.json", {"patch_size": 14, "merge_kernel_size": [2, 2],
                                                       "in_token_limit": 256})  # fmt: skip
    return out_dir


# -- Inkling ------------------------------------------------------------------------------------

INKLING_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unused_200054|>", "<|content_image|>",
                          "<|unused_200053|>"]  # fmt: skip

# A sliding layer (window 8, shorter than every image prompt) and a global one with log-scaled
# queries (floor 4); the first MLP dense, the second a MoE of 4 routed experts (top 2) and a shared one.
INKLING_TEXT_CONFIG = {
    "model_type": "inkling", "hidden_size": 32, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "swa_num_attention_heads": 2, "swa_num_key_value_heads": 1, "swa_head_dim": 16, "sliding_window_size": 8,
    "layer_types": ["hybrid_sliding", "full_attention"], "d_rel": 4, "rel_extent": 16, "log_scaling_n_floor": 4,
    "log_scaling_alpha": 0.5, "sconv_kernel_size": 4, "mlp_layer_types": ["dense", "sparse"],
    "intermediate_size": 32, "dense_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "route_scale": 2.0,
}  # fmt: skip


def build_tiny_inkling(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Inkling directory (module doc): text hidden 32, a sliding layer and a
    global one; a 2-layer patchifier; the relative-bias projections random (zero at init)."""
    import mlx.core as mx
    from mlx_vlm.models import inkling

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(None, INKLING_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in INKLING_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {**INKLING_TEXT_CONFIG, "vocab_size": vocab_size}
    config = {"model_type": "inkling", "text_config": text, "vision_config": {"n_layers": 2},
              "audio_config": {"mel_vocab_size": 16}, "image_token_id": ids["<|unused_200054|>"],
              "audio_token_id": ids["<|unused_200053|>"], "vocab_size": vocab_size,
              "eos_token_id": [ids["<|im_end|>"]]}  # fmt: skip
    model = _instantiate(inkling, config, seed)
    for layer in model.language_model.model.layers:  # zeros at init: the relative bias would vanish
        layer.self_attn.rel_proj = mx.random.normal(layer.self_attn.rel_proj.shape) * 0.5
    _save_model(out_dir, model, config)
    template = _simple_chat_template("<|content_image|><|unused_200054|>", "<|im_start|>", "<|im_end|>\n")
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, template)
    return out_dir

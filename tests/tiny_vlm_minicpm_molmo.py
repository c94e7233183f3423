"""Tiny random-weight MiniCPM-V / MiniCPM-o and Molmo directories for mlx-vlm (tests/tiny_vlm.py's pattern).

* :func:`build_tiny_molmo` (refused): Molmo's processor names no image placeholder; it puts
  every image's tokens before the whole text and gives several images one prompt each.
* :func:`build_tiny_molmo_point` (refused): Molmo 2's layout with a point predictor that keeps
  per-request image state on the model between steps.
* :func:`build_tiny_molmo2`: Molmo 2 (a ViT over 14 px patches of fixed-size crops, attention
  pooling of 2x2 patches, a Qwen3-style text model with an extra embedding table for the
  image tokens). The processor expands ``<|image|>`` (its ``image_placeholder_token``) to a
  low-resolution view and the high-resolution crops, each framed by ``<low_res_im_start>`` or
  ``<im_start>`` and ``<im_end>`` with an ``<im_col>`` closing each row; the features are
  *added* to the ``<im_patch>`` embeddings.

Weights, tokenizer and sizes as in tests/tiny_vlm.py: random weights scaled as ``_save_model``
does, a character-level tokenizer with the family's special tokens.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer, _write_json

# -- Molmo 2 ---------------------------------------------------------------------------------

MOLMO2_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>", "<im_start>", "<im_end>", "<im_patch>",
    "<im_col>", "<low_res_im_start>", "<im_low>", "<frame_start>", "<frame_end>",
]  # fmt: skip

# Molmo 2's template shape: "<|im_start|>user\n<|image|>...<|im_end|>\n<|im_start|>assistant\n".
MOLMO2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|image|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# mlx-vlm's ``load`` builds Molmo 2's image processor with its defaults whatever
# preprocessor_config.json says: crops of 378 px = 27x27 patches of 14 px, pooled 2x2 (14x14
# tokens), a low-resolution view and up to 8 high-resolution crops. So the tower must take
# 27x27 patches, and an image is at least 424 tokens even in a tiny model.
MOLMO2_CROP = 378
MOLMO2_TEXT_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "additional_vocab_size": 8, "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}  # fmt: skip
MOLMO2_VIT_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "image_patch_size": 14, "image_num_pos": 729,
    "image_default_input_size": [MOLMO2_CROP, MOLMO2_CROP],
}  # fmt: skip
MOLMO2_ADAPTER_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "text_hidden_size": 64, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "vit_layers": [-1],
}  # fmt: skip


def build_tiny_molmo2(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Molmo 2 directory (module doc). ``tokenizer_dir`` is not used: the
    image token ids sit past the text vocabulary (``additional_vocab_size``), as in Molmo 2."""
    from mlx_vlm.models import molmo2

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(MOLMO2_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MOLMO2_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "molmo2",
        "architectures": ["Molmo2ForConditionalGeneration"],
        "text_config": {**MOLMO2_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": {"vit_config": MOLMO2_VIT_CONFIG, "adapter_config": MOLMO2_ADAPTER_CONFIG},
        "image_start_token_id": ids["<im_start>"],
        "low_res_image_start_token_id": ids["<low_res_im_start>"],
        "image_end_token_id": ids["<im_end>"],
        "image_low_res_id": ids["<im_low>"],
        "image_patch_id": ids["<im_patch>"],
        "image_col_id": ids["<im_col>"],
        "frame_start_token_id": ids["<frame_start>"],
        "frame_end_token_id": ids["<frame_end>"],
        "eos_token_id": [ids["<|im_end|>"]],
    }
    model = _instantiate(molmo2, config, seed)
    # Weights x2, not x4: with x4 the ~900 image tokens of two images swamp the text, and every
    # prompt answers the same token over and over (two images in either order alike).
    _save_model(out_dir, model, config, scale=2.0)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, MOLMO2_CHAT_TEMPLATE)
    preprocessor = {"size": {"height": MOLMO2_CROP, "width": MOLMO2_CROP}, "max_crops": 8, "overlap_margins": [4, 4],
                    "patch_size": 14, "pooling_size": [2, 2]}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


# -- MolmoPoint -----------------------------------------------------------------------------

MOLMO_POINT_SPECIAL_TOKENS = [
    *MOLMO2_SPECIAL_TOKENS, "<im_non_indexable>", "<|patch|>", "<|subpatch|>", "<|location|>",
]  # fmt: skip


def build_tiny_molmo_point(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight MolmoPoint directory: Molmo 2's tower and text model (module doc)
    with a point predictor, which extends the logits over the image's patches from the prefill's
    hidden states; mlx-vlm routes its generation through the whole model (``language_model``
    is the model itself). ``tokenizer_dir`` is not used."""
    from mlx_vlm.models import molmo_point

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(MOLMO_POINT_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MOLMO_POINT_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vit = dict(MOLMO2_VIT_CONFIG)
    adapter = {**MOLMO2_ADAPTER_CONFIG, "model_type": "molmo_point"}
    config = {
        "model_type": "molmo_point",
        "architectures": ["MolmoPointForConditionalGeneration"],
        "text_config": {**MOLMO2_TEXT_CONFIG, "model_type": "molmo2_text", "vocab_size": vocab_size},
        "vision_config": vit,  # the engine takes a directory with a vision_config to mlx-vlm
        "adapter_config": adapter,
        "image_start_token_id": ids["<im_start>"],
        "image_end_token_id": ids["<im_end>"],
        "image_patch_id": ids["<im_patch>"],
        "image_high_res_id": ids["<im_patch>"],
        "image_col_id": ids["<im_col>"],
        "image_non_indexable_patch_id": ids["<im_non_indexable>"],
        "frame_start_token_id": ids["<frame_start>"],
        "frame_end_token_id": ids["<frame_end>"],
        "patch_token_id": ids["<|patch|>"],
        "subpatch_token_id": ids["<|subpatch|>"],
        "location_token_id": ids["<|location|>"],
        "patch_embed_dim": 32,
        "eos_token_id": [ids["<|im_end|>"]],
    }
    model = _instantiate(molmo_point, config, seed)
    _save_model(out_dir, model, config, scale=2.0)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, MOLMO2_CHAT_TEMPLATE)
    return out_dir


# -- Molmo -----------------------------------------------------------------------------------

MOLMO_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<im_start>", "<im_end>", "<im_patch>", "<im_col>"]


def build_tiny_molmo(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Molmo directory (a CLIP-style tower over 112 px crops of 14 px
    patches pooled 2x2, an OLMo-style text model). mlx-vlm's processor names no image
    placeholder: it puts every image's tokens *before* the whole text, and gives several images
    one prompt each. ``tokenizer_dir`` is not used."""
    from mlx_vlm.models import molmo

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(MOLMO_SPECIAL_TOKENS)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "mlp_hidden_size": 256, "mlp_ratio": 4,
            "vocab_size": vocab_size, "embedding_size": vocab_size, "additional_vocab_size": 8,
            "max_position_embeddings": 4096, "rope_theta": 10000.0}  # fmt: skip
    # Two ViT layers taken (the same one twice): the pad embedding is sized for two.
    vision = {"image_default_input_size": [112, 112], "image_patch_size": 14, "image_pos_patch_size": 14,
              "hidden_size": 256, "image_emb_dim": 32, "image_num_heads": 2, "image_num_key_value_heads": 2,
              "image_num_layers": 1, "image_head_dim": 16, "image_mlp_dim": 64, "image_num_pos": 65,
              "d_model": 64, "vit_layers": [-1, -1]}  # fmt: skip
    config = {"model_type": "molmo", "architectures": ["MolmoForCausalLM"], "text_config": text,
              "vision_config": vision, "eos_token_id": [tok.token_to_id("<|im_end|>")]}  # fmt: skip
    model = _instantiate(molmo, config, seed)
    _save_model(out_dir, model, config, scale=2.0)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, MOLMO2_CHAT_TEMPLATE)
    # Real Molmo's proportions: crops of 2x the pooled tokens per side in patches, margins a sixth.
    preprocessor = {"base_image_input_size": [112, 112], "image_token_length_w": 4, "image_token_length_h": 4,
                    "image_patch_size": 14, "max_crops": 2, "overlap_margins": [2, 2]}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

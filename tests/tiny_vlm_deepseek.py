"""Tiny random-weight DeepSeek vision-language models (DeepSeek-VL2 and its relatives), saved as
directories that mlx-vlm loads offline; the helpers are tests/tiny_vlm.py's.

* :func:`build_tiny_deepseek_vl_v2`: DeepSeek-VL2: a SigLIP tower at 28 px tiles (2x2 patches of
  14 px), a 2x2 downsampling MLP projector (one token per tile), a DeepSeek-V2
  text model (multi-head latent attention, a dense layer then a mixture of experts). Its own
  processor (``processing_deepsek_vl_v2.py``) picks a tiling among ``candidate_resolutions``,
  expands ``<image>`` to a global view with a newline per row, a view separator and the tiles'
  rows with newlines (all ``<image>`` tokens; the model writes its learned newline and separator
  embeddings there), and returns the pixels under ``images`` and an ``images_seq_mask`` over the
  whole prompt, BOS included. A 100x60 picture: 2x1 tiles, 6 tokens.

  mlx-vlm's model reads ``images_spatial_crop`` out of bounds for an image of several tiles
  (``vlm_families.DeepseekVL2Model``): the engine pads it in bounds, and so does the oracle
  (:func:`spatial_crops_in_bounds`), else its answer changes from run to run.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _instantiate, _make_tokenizer, _save_model, _save_tokenizer, _write_json

DEEPSEEK_SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<image>",
    "<|ref|>", "<|/ref|>", "<|det|>", "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>",
]  # fmt: skip

# DeepSeek's conversation shape, with list content: an image part is "<image>" alone (what a bare
# prompt gets in front), text parts as they are.
DEEPSEEK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|User|>: {% else %}<|Assistant|>: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)

# DeepSeek-V2 (mlx-vlm's deepseek_vl_v2 text model): MLA with a low-rank query, layer 0 dense,
# layer 1 a mixture of 4 routed experts (2 per token) and a shared one.
DEEPSEEK_V2_TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 4096,
}

DEEPSEEK_VL_V2_TILE = 28


def _deepseek_tokenizer(out_dir: Path, tokenizer_dir: Path | None):
    """The DeepSeek special tokens; a BOS in front of every prompt, as the processors put one
    (the engine tokenizes a prompt with the tokenizer, mlx-vlm with the processor)."""
    from tokenizers.processors import TemplateProcessing

    tok = _make_tokenizer(tokenizer_dir, DEEPSEEK_SPECIAL_TOKENS)
    bos = DEEPSEEK_SPECIAL_TOKENS[0]
    special = [(bos, tok.token_to_id(bos))]
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=special)
    extra = {"bos_token": bos, "add_bos_token": True}
    _save_tokenizer(out_dir, tok, "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", 4096, DEEPSEEK_CHAT_TEMPLATE, extra)
    return tok


def build_tiny_deepseek_vl_v2(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight DeepSeek-VL2 directory (module doc)."""
    from mlx_vlm.models import deepseek_vl_v2

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _deepseek_tokenizer(out_dir, tokenizer_dir)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    tile = DEEPSEEK_VL_V2_TILE
    config = {
        "model_type": "deepseek_vl_v2",
        "architectures": ["DeepseekVLV2ForCausalLM"],
        "language_config": {**DEEPSEEK_V2_TINY_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": {"model_type": "vision", "layers": 1, "width": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "image_size": tile, "patch_size": 14, "mlp_ratio": 2.0},
        "projector_config": {"projector_type": "downsample_mlp_gelu", "input_dim": 32, "n_embed": 64,
                             "depth": 2, "mlp_ratio": 1, "downsample_ratio": 2},
        "tile_tag": "2D",
        "global_view_pos": "head",
        "candidate_resolutions": [[tile, tile], [2 * tile, tile], [tile, 2 * tile]],
        "image_token_index": tok.token_to_id("<image>"),
        "pad_id": tok.token_to_id("<｜▁pad▁｜>"),
        "vocab_size": vocab_size,
        "eos_token_id": [tok.token_to_id("<｜end▁of▁sentence｜>")],
    }  # fmt: skip
    model = _instantiate(deepseek_vl_v2, {**config, "text_config": config["language_config"]}, seed)
    _save_model(out_dir, model, config)
    processor = {
        "processor_class": "DeepseekVLV2Processor",
        "candidate_resolutions": config["candidate_resolutions"],
        "patch_size": 14,
        "downsample_ratio": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_token": "<image>",
        "pad_token": "<｜▁pad▁｜>",
        "sft_format": "deepseek",
    }
    _write_json(out_dir / "processor_config.json", processor)
    return out_dir


def spatial_crops_in_bounds(model) -> None:
    """Make mlx-vlm's DeepSeek-VL2 read ``images_spatial_crop`` in bounds (a no-op for other models).

    Its ``get_input_embeddings`` walks ``images_spatial_crop[b][j]`` for ``j`` up to the pixels'
    tile count and stops at the first zero row; the processor gives one row per image, so for an
    image of several tiles it reads past the array, whatever memory follows (MLX indexes without
    bounds checks): the image is dropped in about one call of two on the CPU backend. Zero rows
    up to the tile count (the processor's own batch padding) give what it computes when that
    memory happens to be zeros, every time."""
    import mlx.core as mx

    if getattr(model.config, "model_type", None) != "deepseek_vl_v2":
        return
    embeddings = model.get_input_embeddings

    def in_bounds(input_ids=None, pixel_values=None, images_spatial_crop=None, **kwargs):
        if pixel_values is not None and images_spatial_crop is not None:
            missing = pixel_values.shape[1] - images_spatial_crop.shape[1]
            if missing > 0:
                padding = mx.zeros((images_spatial_crop.shape[0], missing, 2), dtype=images_spatial_crop.dtype)
                images_spatial_crop = mx.concatenate([images_spatial_crop, padding], axis=1)
        return embeddings(input_ids, pixel_values, images_spatial_crop=images_spatial_crop, **kwargs)

    model.get_input_embeddings = in_bounds

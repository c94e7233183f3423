"""Tiny random-weight Granite vision-language models whose image features reach the text model in
whole-prompt arrays, built as tests/tiny_vlm.py builds its families (its helpers, char-level
tokenizer, weights scaled x4 so greedy logits are far from ties), with mlx-vlm's own processor:

* :func:`build_tiny_granite4_vision`: Granite 4 Vision (LLaVA-NeXT's tiles and processor, a SigLIP
  tower whose layers feed window Q-Former projectors, one per granite text layer they are added
  to). Its embeddings are zeros at every image token: an image reaches the text model through its
  deepstack features alone, which come as whole-prompt arrays (``[layers, prompt tokens, hidden]``
  and a ``[1, prompt tokens]`` mask) that its text model slices at the cache's offset; the engine
  gives it each call's rows (``vlm_generic.StepWindow``). Its granite multipliers are set to the
  plain transformer's (the defaults, embeddings x12 and attention scaled 1/64 at a head of 16,
  leave a tiny model's greedy tokens the same for every picture). Its template writes an image
  part as ``<image>`` alone (LLaVA's adds a newline, which this model's answers notice: a bare
  prompt, given the template's image text, would then be another prompt than ``<image>`` + text).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    LLAVA_CHAT_TEMPLATE,
    LLAVA_SPECIAL_TOKENS,
    _build_llava_layout,
    _make_tokenizer,
)

__all__ = ["build_tiny_granite4_vision"]

# SigLIP at 32 px in 8 px patches (a 4x4 grid): the Q-Former projectors need a width of 64 (64 per
# head) and pool 4x4 windows to 2x2 queries ("2/4"): 4 tokens a tile.
GRANITE4_VISION_VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}
# Text: hidden 64, 2 layers, heads of 16; multipliers of a plain transformer (module doc).
GRANITE4_VISION_TEXT_CONFIG = {
    "model_type": "granite",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "embedding_multiplier": 1.0,
    "attention_multiplier": 0.25,
    "residual_multiplier": 1.0,
    "logits_scaling": 1.0,
}


def build_tiny_granite4_vision(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Granite 4 Vision directory (module doc): deepstack from vision layers 0
    and 1 into text layers 0 and 1, no spatial sampling; tiles of 32 px up to 2x2."""
    vision = dict(GRANITE4_VISION_VISION_CONFIG)
    tile = vision["image_size"]
    pinpoints = [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    vocab_size = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS).get_vocab_size(with_added_tokens=True)
    return _build_llava_layout(
        out_dir, tokenizer_dir, seed, "granite4_vision", "Granite4VisionForConditionalGeneration",
        config_extra={"text_config": {**GRANITE4_VISION_TEXT_CONFIG, "vocab_size": vocab_size},
                      "vision_config": vision, "image_grid_pinpoints": pinpoints,
                      "vision_feature_select_strategy": "full", "downsample_rate": "2/4",
                      "deepstack_layer_map": [[0, 0], [1, 1]], "use_spatial_sampling": False},
        preprocessor_extra={"image_processor_type": "LlavaNextImageProcessor", "image_grid_pinpoints": pinpoints,
                            "size": {"shortest_edge": tile}, "crop_size": {"height": tile, "width": tile},
                            "do_pad": True, "patch_size": vision["patch_size"],
                            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        processor_extra={"vision_feature_select_strategy": "full", "num_additional_image_tokens": 0,
                         "patch_size": vision["patch_size"], "downsample_rate": "2/4"},
        processor_class="Granite4VisionProcessor", chat_template=LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<image>"),
    )  # fmt: skip

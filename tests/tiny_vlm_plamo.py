"""Tiny random-weight PLaMo 2 VL, built so that its greedy output depends on the image.

* :func:`build_tiny_plamo2vl`: PLaMo 2 VL (SigLIP tiles with a thumbnail, a PLaMo 2 hybrid text
  model of Mamba and attention layers, whose state lives in the state pool). Its processor writes
  the prompt into a fixed Japanese instruction template (mlx-vlm's code, no file of the checkpoint)
  with every image's tokens at the start of the instruction; a placeholder in the text is counted as
  an extra image, so its tests write none. Its tokenizer is its own (a JSON-lines vocabulary with the
  256 byte tokens it insists on): here one piece a character plus the template's two lines around the
  instruction as one piece each, as a real vocabulary has long pieces, so the template is 2 tokens,
  not 190 bytes a random model forgets the image behind. Image features are scaled up (the
  projector's last layer) so they outweigh the text embeddings in the attention layer's values.
  Tiles are 14 px, one patch: one token a tile. A prompt's tiles share one budget
  (``tile_context_length``), so an image's run depends on the others: for four large images it
  bites, and the engine's check at load takes one image a prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_vlm import CLIP_MEAN, CLIP_STD, _instantiate, _save_model, _write_json
from tiny_vlm_misc import PLAMO2VL_SPECIAL_TOKENS, _plamo2_vocabulary

__all__ = ["build_tiny_plamo2vl"]

PLAMO2VL_TEMPLATE_PIECES = [
    (
        "以下はタスクを説明する指示で、文脈を説明した入力とペアになっています。要求を適切に補完するよう応答を書いてください。"
        "\n\n### 指示:\n"
    ),
    "\n\n### 応答:\n",
]
"""mlx-vlm's ``_apply_ja01_template`` around the instruction (images, then the text), as two pieces."""

MIXER_GAIN = 5.0
"""Each layer's post-mixer norm weight (an offset to mlx-vlm's 0.2: mixer outputs 5.2 RMS)."""

TILE_BUDGET = 40
"""``tile_context_length``: tokens a prompt's images share (a 14 px tile is one token, an image's run two
more). A test picture alone is at most 19 (16 tiles and a thumbnail), the probe pair at load 30 (less than
the budget: at that size each image's run is its own), four large images would be 108: the processor
gives each fewer tiles with the others than alone."""


def build_tiny_plamo2vl(out_dir: Path, *, seed: int = 0, tile_budget: int = TILE_BUDGET) -> Path:
    """A tiny random-weight PLaMo 2 VL directory (module doc): text hidden 32 (a Mamba layer and an
    attention layer, mixer outputs scaled up), a 1-layer SigLIP of width 32 on 14 px tiles, one token a tile;
    ``tile_budget`` the processor's ``tile_context_length``."""
    import mlx.core as mx
    from mlx_vlm.models import plamo2vl

    out_dir.mkdir(parents=True, exist_ok=True)
    vocabulary = _plamo2_vocabulary(PLAMO2VL_SPECIAL_TOKENS) + [[piece, 0.0] for piece in PLAMO2VL_TEMPLATE_PIECES]
    (out_dir / "tokenizer.jsonl").write_text("".join(json.dumps(row) + "\n" for row in vocabulary))
    ids = {row[0]: i for i, row in enumerate(vocabulary)}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
              "num_attention_heads": 2, "patch_size": 14, "image_size": 14, "image_token_id": ids["<plamo:image>"],
              "image_feature_size": 32, "image_proj_hidden_size": 32}  # fmt: skip
    text = {"model_type": "plamo2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "hidden_size_per_head": 16, "mamba_d_state": 8, "mamba_d_conv": 4,
            "mamba_num_heads": 2, "mamba_step": 2, "mamba_chunk_size": 16, "intermediate_size": 64,
            "vocab_size": len(vocabulary), "max_position_embeddings": 4096}  # fmt: skip
    config = {"model_type": "plamo2vl", "text_config": text, "vision_config": vision,
              "image_token_index": ids["<plamo:image>"], "eos_token_id": [ids["<|plamo:bos|>"]]}  # fmt: skip
    model = _instantiate(plamo2vl, config, seed)
    # The mixers' outputs ~25x their init (the post-mixer norm's weight is an offset to 0.2): at init the
    # residual stream, the last token's own embedding, outweighs what attention brings from the image, and a
    # tied head then greedily repeats the last token whatever the image.
    for layer in model.language_model.model.layers.layers:
        layer.post_mixer_norm.weight = mx.full(layer.post_mixer_norm.weight.shape, MIXER_GAIN)
    mx.eval(model.parameters())
    _save_model(out_dir, model, config)
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "Plamo2Tokenizer", "unk_token": "<|plamo:unk|>", "bos_token": "<|plamo:bos|>",
        "eos_token": "<|plamo:bos|>", "pad_token": "<|plamo:pad|>", "add_bos_token": True, "add_eos_token": False,
        "additional_special_tokens": PLAMO2VL_SPECIAL_TOKENS[3:], "model_max_length": 512,
    })  # fmt: skip
    # SigLIP's processor with PLaMo's tiling settings on 14 px tiles: no downsampling, as mlx-vlm's model
    # projects every patch (one a tile).
    _write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "SiglipImageProcessor", "processor_class": "Plamo2VLProcessor",
        "do_resize": True, "size": {"height": 14, "width": 14}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "patch_size": 14,
        "max_image_width": 56, "max_image_height": 56, "downsample_ratio": 1.0,
        "tile_context_length": tile_budget,
    })  # fmt: skip
    return out_dir

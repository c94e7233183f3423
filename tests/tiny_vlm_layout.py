"""Tiny random-weight vision-language models whose processor lays out the prompt itself.

mlx-vlm serves these with the image where the processor puts it, whatever the prompt says, and so
does the engine (``GenericVisionModel.places_images_itself``): the processor writes the prompt, each
image's run becomes one stand-in token, expanded as any image's. The builders of Molmo
(tests/tiny_vlm_minicpm_molmo.py), Moondream 3 (tests/tiny_vlm_phi_idefics.py) and GOT-OCR
(tests/tiny_vlm_llava_like.py) stay where their processor's or text model's kin are; here:

* :func:`build_tiny_plamo2vl`: PLaMo 2 VL (SigLIP tiles with a thumbnail, a PLaMo 2 hybrid text
  model of Mamba and attention layers, whose state lives in the state pool). Its processor has a
  tokenizer of its own (a JSON-lines vocabulary, written character by character with the 256 byte
  tokens it insists on), and it writes the prompt into a fixed Japanese instruction template with
  every image's tokens at the start of the instruction; a placeholder in the text is counted as an
  extra image, so its tests write none. A prompt's tiles share one context budget, so an image's run
  depends on the others: one image a prompt.

The others' layouts: Molmo's processor puts every image's tokens before the whole text (two images
make two prompts), Moondream 3's writes BOS, 729 image tokens, then its "Question:/Answer:" template
around the text; GOT-OCR's wraps the text in its own conversation, the image at the start of the
user's turn (or at an ``<image>`` the text writes). Each takes one image a prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_vlm import CLIP_MEAN, CLIP_STD, _instantiate, _save_model, _write_json
from tiny_vlm_misc import PLAMO2VL_SPECIAL_TOKENS, _plamo2_vocabulary

__all__ = ["build_tiny_plamo2vl"]


def build_tiny_plamo2vl(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight PLaMo 2 VL directory (module doc): text hidden 32 (a Mamba layer and an
    attention layer), a 1-layer SigLIP of width 32 on 28 px tiles, 4 tokens a tile."""
    from mlx_vlm.models import plamo2vl

    out_dir.mkdir(parents=True, exist_ok=True)
    vocabulary = _plamo2_vocabulary(PLAMO2VL_SPECIAL_TOKENS)
    (out_dir / "tokenizer.jsonl").write_text("".join(json.dumps(row) + "\n" for row in vocabulary))
    ids = {row[0]: i for i, row in enumerate(vocabulary)}
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 14,
        "image_size": 28,
        "image_token_id": ids["<plamo:image>"],
        "image_feature_size": 32,
        "image_proj_hidden_size": 32,
    }
    text = {
        "model_type": "plamo2",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size_per_head": 16,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_num_heads": 2,
        "mamba_step": 2,
        "mamba_chunk_size": 16,
        "intermediate_size": 64,
        "vocab_size": len(vocabulary),
        "attention_window_size": 64,
        "max_position_embeddings": 4096,
    }
    config = {"model_type": "plamo2vl", "text_config": text, "vision_config": vision,
              "image_token_index": ids["<plamo:image>"], "eos_token_id": [ids["<|plamo:bos|>"]]}  # fmt: skip
    _save_model(out_dir, _instantiate(plamo2vl, config, seed), config)
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "Plamo2Tokenizer", "unk_token": "<|plamo:unk|>", "bos_token": "<|plamo:bos|>",
        "eos_token": "<|plamo:bos|>", "pad_token": "<|plamo:pad|>", "add_bos_token": True, "add_eos_token": False,
        "additional_special_tokens": PLAMO2VL_SPECIAL_TOKENS[3:], "model_max_length": 512,
    })  # fmt: skip
    # SigLIP's processor with PLaMo's tiling settings on 28 px tiles: no downsampling, as mlx-vlm's model
    # projects every patch (4 a tile; a ratio of 0.5 would write 1 token a tile for its 4 features).
    _write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "SiglipImageProcessor", "processor_class": "Plamo2VLProcessor",
        "do_resize": True, "size": {"height": 28, "width": 28}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "patch_size": 14,
        "max_image_width": 56, "max_image_height": 56, "downsample_ratio": 1.0, "tile_context_length": 256,
    })  # fmt: skip
    return out_dir

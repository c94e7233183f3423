"""Tiny random-weight Hunyuan-VL (``hunyuan_vl``), saved as a directory mlx-vlm loads offline. Same
recipe as tests/tiny_vlm.py (char-level tokenizer with the family's special tokens, scaled random weights):

* :func:`build_tiny_hunyuan_vl`: Hunyuan-VL: mlx-vlm's own processor, which hard-codes the real
  model's image ids (120118-120121) and writes an image as ``patch_h * (patch_w + 1) + 2`` copies of
  the image token (the tower's begin, rows of merged patches each closed by a newline feature, end),
  with ``tokenizer.vocab_size - 1`` as its scratch placeholder: the tokenizer pins those ids with
  filler tokens in between (``_pinned_tokenizer``) and ends on the placeholder. Its image processor
  resizes every image to at least 512x512 pixels (fixed: mlx-vlm's ``load`` passes it nothing), so
  an image is 274 tokens or more and its pools are larger. Its text model rotates by four position
  axes (base, w, h, t: xdrope), the grid ones set inside each image by the processor.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_vlm import _instantiate, _save_model, _save_tokenizer
from tiny_vlm_others import _simple_chat_template
from tiny_vlm_qwen_like import _pinned_tokenizer

__all__ = ["build_tiny_hunyuan_vl"]

# The real model's ids that mlx-vlm's processor hard-codes (HunYuanVLProcessor), by the token's text here.
HUNYUAN_VL_PINNED = {"<hy_im_start>": 120118, "<hy_im_end>": 120119, "<hy_image>": 120120, "<hy_newline>": 120121}
# The chat tokens, then the processor's scratch placeholder, which must be the vocabulary's last id.
HUNYUAN_VL_SPECIAL_TOKENS = [*HUNYUAN_VL_PINNED, "<hy_bos>", "<hy_eos>", "<hy_start>", "<hy_end>", "<hy_placeholder>"]
HUNYUAN_VL_IMAGE = "<hy_im_start><hy_image><hy_im_end>"
# The config's ``<name>_token_id`` keys, by the token (``<hy_<token>>``).
HUNYUAN_VL_IMAGE_IDS = {"image_start": "im_start", "image_end": "im_end", "image": "image", "image_newline": "newline"}

# Four rotary axes over head_dim 16 (8 frequencies, 2 each); no NTK alpha, so positions matter.
HUNYUAN_VL_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_head_dim": 16,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "xdrope", "xdrope_section": [2, 2, 2, 2], "factor": 1.0},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# 16 px patches merged 2x2 (the processor's fixed sizes); learned positions on a 32x32 grid, interpolated.
HUNYUAN_VL_VISION_CONFIG = {
    "hidden_size": 32,
    "out_hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "max_image_size": 512,
}


def build_tiny_hunyuan_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Hunyuan-VL directory (module doc): 2 text layers of width 64, a 1-block
    tower of width 32; a 100x60 picture is resized to 672x416 pixels, 13 * 22 + 2 = 288 image tokens."""
    arch = importlib.import_module("mlx_vlm.models.hunyuan_vl")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _pinned_tokenizer(HUNYUAN_VL_SPECIAL_TOKENS, HUNYUAN_VL_PINNED)
    ids = {t: tok.token_to_id(t) for t in HUNYUAN_VL_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    assert ids["<hy_placeholder>"] == vocab_size - 1  # the processor's scratch token: tokenizer.vocab_size - 1
    text = {**HUNYUAN_VL_TEXT_CONFIG, "vocab_size": vocab_size, "org_vocab_size": vocab_size}
    text.update(bos_token_id=ids["<hy_bos>"], eos_token_id=ids["<hy_eos>"])
    image_ids = {f"{name}_token_id": ids[f"<hy_{token}>"] for name, token in HUNYUAN_VL_IMAGE_IDS.items()}
    config = {
        "model_type": "hunyuan_vl",
        "architectures": ["HunYuanVLForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(HUNYUAN_VL_VISION_CONFIG),
        **image_ids,
        "vocab_size": vocab_size,
        "org_vocab_size": vocab_size,
        "bos_token_id": ids["<hy_bos>"],
        "eos_token_id": ids["<hy_eos>"],
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    template = _simple_chat_template(HUNYUAN_VL_IMAGE, "<hy_start>", "<hy_end>")
    _save_tokenizer(out_dir, tok, "<hy_eos>", "<hy_eos>", 4096, template)
    return out_dir

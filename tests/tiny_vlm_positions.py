"""Tiny random-weight vision-language models whose positions mlx-vlm keeps as state on the text
model, saved as directories mlx-vlm loads offline (the recipe of tiny_vlm.py: the package's own
config, sizes overridden, scaled random weights, a char-level tokenizer):

* :func:`build_tiny_falcon_ocr` (refused): Falcon OCR: no vision tower (16 px patches projected
  straight to the text width), a text model with 1-D rotary positions beside 2-D "golden" ones
  (``pos_hw``) for image tokens, and an attention mask in which an image's block, from its start
  marker to its end marker, attends to itself both ways: the engine's causal prefill cannot.
* :func:`build_tiny_falcon_perception` (refused): Falcon Perception: Falcon OCR's layout and mask,
  with coordinate, size and segmentation heads whose outputs its decode steps feed back into the
  next token's embedding (per-request state on the model).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_vlm import _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer

# The text model: head_dim 16 (8 rotary frequencies: 4 on the 1-D axis, 4 on the 2-D golden ones).
FALCON_TEXT = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "ffn_dim": 64,
               "max_seq_len": 512}  # fmt: skip
FALCON_SPECIAL_TOKENS = ["<|end_of_text|>", "<|image|>", "<|image_cls|>", "<|image_end|>"]
FALCON_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tiny_falcon_ocr(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    return _build_falcon(out_dir, "falcon_ocr", {}, seed)


def build_tiny_falcon_perception(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    heads = {"coord_enc_dim": 16, "coord_dec_dim": 32, "coord_out_dim": 16, "size_enc_dim": 16,
             "size_dec_dim": 32, "size_out_dim": 16, "do_segmentation": False}  # fmt: skip
    return _build_falcon(out_dir, "falcon_perception", heads, seed)


def _build_falcon(out_dir: Path, model_type: str, extra: dict, seed: int) -> Path:
    """A Falcon package's model under the tiny tokenizer's ids for its image tokens."""
    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(FALCON_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in FALCON_SPECIAL_TOKENS}
    config = {
        "model_type": model_type,
        **FALCON_TEXT,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "img_id": ids["<|image|>"],
        "image_cls_token_id": ids["<|image_cls|>"],
        "img_end_id": ids["<|image_end|>"],
        "eos_id": ids["<|end_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"]],
        # The package's from_dict reads the patch sizes from the root; the engine takes a config with
        # a vision_config for mlx-vlm's (is_vision_language_config).
        "vision_config": {"spatial_patch_size": 16, "temporal_patch_size": 1, "channel_size": 3},
        **extra,
    }
    _save_model(out_dir, _instantiate(arch, config, seed), config)
    _save_tokenizer(out_dir, tok, "<|end_of_text|>", "<|end_of_text|>", 512, FALCON_TEMPLATE)
    return out_dir

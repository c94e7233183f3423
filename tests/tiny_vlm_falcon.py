"""Tiny random-weight Falcon vision-language models, saved as directories mlx-vlm loads offline
(the recipe of tiny_vlm.py: the package's own config, sizes overridden, scaled random weights, a
char-level tokenizer). Both have no vision tower: 32 px patches (16 in the real models; larger here
so an image is 4-12 tokens) projected straight to the text width.

* :func:`build_tiny_falcon_ocr` (served): Falcon OCR: an image's run is ``<|image_cls|>``, four
  register tokens, a patch token per patch and ``<|image_end|>``; its text model rotates half of
  each head by a 1-D position that stands still over the whole run, the other half by 2-D "golden"
  positions of the image's patches (``pos_hw``: floats, zero at every other token), and its mask lets
  the run, from ``<|image_cls|>`` to the last patch, attend to itself both ways. Its processor writes
  the whole prompt itself: the text is only the name of an OCR category.
  (Falcon Perception, Falcon OCR's layout with heads whose outputs its decode steps feed back:
  tests/tiny_vlm_perception2.py.)
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_vlm import _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer

# The text model: head_dim 16 (8 rotary frequencies: 4 on the 1-D axis, 4 on the 2-D golden ones); two
# layers, so the image block's both-ways attention in the first reaches the keys of the second.
FALCON_TEXT = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "ffn_dim": 64,
               "max_seq_len": 512}  # fmt: skip
FALCON_PATCH = 32
"""Pixels a side of a patch: the processor resizes an image to a multiple of it, at least 64 px a side."""
FALCON_REGISTERS = [f"<|image_reg_{n}|>" for n in range(1, 5)]
FALCON_SPECIAL_TOKENS = ["<|end_of_text|>", "<|image|>", "<|image_cls|>", "<|image_end|>", *FALCON_REGISTERS]
FALCON_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tiny_falcon_ocr(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Falcon OCR directory (module doc)."""
    return _build_falcon(out_dir, "falcon_ocr", {}, seed)


def _build_falcon(
    out_dir: Path,
    model_type: str,
    extra: dict,
    seed: int,
    tokens: dict | None = None,
    adjust=None,
    patch: int = FALCON_PATCH,
) -> Path:
    """A Falcon package's model under the tiny tokenizer's ids for its image tokens (the config's
    defaults are the real vocabulary's, outside the tiny one); ``tokens``: more special tokens, by the
    config key that names each one's id; ``adjust(model, ids)``: changes to the model before it is saved;
    ``patch``: pixels a side of a patch."""
    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = tokens or {}
    tok = _char_level_tokenizer([*FALCON_SPECIAL_TOKENS, *tokens.values()])
    ids = {t: tok.token_to_id(t) for t in [*FALCON_SPECIAL_TOKENS, *tokens.values()]}
    registers = {f"image_reg_{n}_token_id": ids[token] for n, token in enumerate(FALCON_REGISTERS, start=1)}
    config = {
        "model_type": model_type,
        **FALCON_TEXT,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "img_id": ids["<|image|>"],
        "image_cls_token_id": ids["<|image_cls|>"],
        "img_end_id": ids["<|image_end|>"],
        **registers,
        "eos_id": ids["<|end_of_text|>"],
        "eos_token_id": [ids["<|end_of_text|>"]],
        # The package's from_dict and its processor read the patch size from the root; the engine
        # takes a config with a vision_config for mlx-vlm's (is_vision_language_config).
        "spatial_patch_size": patch,
        "vision_config": {"spatial_patch_size": patch, "temporal_patch_size": 1, "channel_size": 3},
        **extra,
        **{key: ids[token] for key, token in tokens.items()},
    }
    model = _instantiate(arch, config, seed)
    _randomize_zero_initialized(model.language_model.model)
    if adjust is not None:
        adjust(model, ids)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|end_of_text|>", "<|end_of_text|>", 512, FALCON_TEMPLATE)
    return out_dir


def _randomize_zero_initialized(text_model) -> None:
    """Random golden frequencies and attention sinks where the package initialises them to zeros (a
    checkpoint sets them): zero frequencies would make the 2-D positions a no-op."""
    import mlx.core as mx

    text_model.freqs_cis_golden = mx.random.normal(text_model.freqs_cis_golden.shape)
    for layer in text_model.layers:
        layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)

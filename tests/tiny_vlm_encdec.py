"""Tiny random-weight encoder-decoder vision-language models (BART-like text models).

* :func:`build_tiny_florence2`: Florence-2 (a DaViT tower, a BART encoder-decoder). Its processor writes
  the prompt itself: the image's tokens, BOS, the text, EOS (no placeholder in the text). The encoder
  reads the image's features then the text's embeddings once; the decoder starts from
  ``decoder_start_token_id`` and generates with self-attention and cross-attention caches: the engine
  holds them per request (``executor/held_caches.py``, the adapter's ``encoder_decoder``). One DaViT
  stage of width 32 on 16 px images (stride 4): 16 patch tokens and their mean, 17 tokens an image.
  Its processor's patch adds the task and 1000 location tokens to any tokenizer (ids after the
  characters'), so the text model's vocabulary is sized from the patched tokenizer.
* :func:`build_tiny_nemotron_parse`: NeMo Parse (a C-RADIO tower and its neck, an mBART-style decoder, no
  text encoder). Its encoder input is the image alone (the tower's states); the prompt's ids, BOS and EOS
  stripped, seed the decoder (mlx-vlm's text model does it): the engine's ``image_alone`` encoder-decoder.
  Its processor builds its image processor on a hard-coded 2048 x 1664 page: shrunk to 64 x 64 while
  ``nemotron_parse_shrunk`` lasts (tests/tiny_vlm_towers.py's ``shrunk_tower``): 5 encoder states an image.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tiny_vlm import CLIP_MEAN, CLIP_STD, _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer, _write_json

__all__ = ["build_tiny_florence2", "build_tiny_nemotron_parse", "nemotron_parse_shrunk"]

FLORENCE2_IMAGE_PX = 16
"""The image processor's size: one DaViT stage of stride 4 gives 4 x 4 patch tokens."""

FLORENCE2_IMAGE_TOKENS = (FLORENCE2_IMAGE_PX // 4) ** 2 + 1
"""The patch tokens and their spatial mean (``image_feature_source``): the processor's ``image_seq_length``."""


def build_tiny_florence2(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Florence-2 directory (module doc): BART d_model 32, one encoder and one decoder
    layer, a one-stage DaViT of width 32."""
    import mlx.core as mx
    from mlx_vlm.models import florence2
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(["<s>", "</s>", "<pad>"])
    _save_tokenizer(out_dir, tok, eos="</s>", pad="<pad>", max_length=1024, chat_template="",
                    extra={"bos_token": "<s>"})  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    florence2.processing_florence2._ensure_florence_tokens(tokenizer)  # what its processor adds at every load
    image_token_id = tokenizer.convert_tokens_to_ids("<florence_image>")
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<s>", "</s>", "<pad>")}
    text = {"d_model": 32, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "encoder_layers": 1, "decoder_layers": 1, "vocab_size": len(tokenizer),
            "max_position_embeddings": 512, "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"], "decoder_start_token_id": ids["</s>"]}  # fmt: skip
    vision = {"model_type": "davit", "depths": [1], "dim_embed": [32], "num_heads": [2], "num_groups": [2],
              "window_size": 2, "patch_size": [7], "patch_stride": [4], "patch_padding": [3],
              "patch_prenorm": [False], "image_size": [FLORENCE2_IMAGE_PX, FLORENCE2_IMAGE_PX]}  # fmt: skip
    config = {"model_type": "florence2", "text_config": text, "vision_config": vision,
              "image_token_id": image_token_id, "image_token_index": image_token_id, "vocab_size": len(tokenizer),
              "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"]}  # fmt: skip
    model = _instantiate(florence2, config, seed)
    # mlx-vlm starts the image projection at zeros (a checkpoint's weight replaces it): random here, or every
    # image's features would be the same (the norm's bias alone).
    model.image_projection = mx.random.normal(model.image_projection.shape) * 0.1
    _save_model(out_dir, model, config)
    _write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "Florence2Processor",
        "do_resize": True, "size": {"height": FLORENCE2_IMAGE_PX, "width": FLORENCE2_IMAGE_PX}, "do_center_crop": False,
        "crop_size": {"height": FLORENCE2_IMAGE_PX, "width": FLORENCE2_IMAGE_PX}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_convert_rgb": True, "image_seq_length": FLORENCE2_IMAGE_TOKENS,
    })  # fmt: skip
    _write_json(out_dir / "processor_config.json", {"processor_class": "Florence2Processor",
                                                     "num_additional_image_tokens": 0})  # fmt: skip
    return out_dir


NEMOTRON_PARSE_PAGE = (64, 64)
"""The shrunk page (height, width) its image processor pads every image to (its default, 2048 x 1664, is
hard-coded in mlx-vlm's processor): 4 x 4 patches of 16 px, which its neck narrows 4x to 4 x 1, plus one
summary token: 5 encoder states an image."""


@contextmanager
def nemotron_parse_shrunk() -> Iterator[None]:
    """mlx-vlm's NeMo Parse processor builds its image processor with its defaults (a 2048 x 1664 page),
    whatever the directory says: built here on ``NEMOTRON_PARSE_PAGE`` while the context lasts."""
    from mlx_vlm.models.nemotron_parse import processing_nemotron_parse as processing

    small = functools.partial(processing.NemotronParseImageProcessor, final_size=NEMOTRON_PARSE_PAGE)
    saved = processing.NemotronParseImageProcessor
    processing.NemotronParseImageProcessor = small
    try:
        yield
    finally:
        processing.NemotronParseImageProcessor = saved


def build_tiny_nemotron_parse(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight NeMo Parse directory (module doc): an mBART-style decoder of d_model 32, one
    layer; a one-block C-RADIO tower of width 32 and its neck, on the shrunk page."""
    from mlx_vlm.models import nemotron_parse
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(["<s>", "</s>", "<pad>"])
    _save_tokenizer(out_dir, tok, eos="</s>", pad="<pad>", max_length=1024, chat_template="",
                    extra={"bos_token": "<s>"})  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<s>", "</s>", "<pad>")}
    special = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["<pad>"],
               "decoder_start_token_id": ids["</s>"], "vocab_size": len(tokenizer)}  # fmt: skip
    text = {"d_model": 32, "decoder_attention_heads": 2, "decoder_ffn_dim": 64, "decoder_layers": 1,
            "max_position_embeddings": 512, **special}  # fmt: skip
    vision = {"hidden_size": 32, "num_heads": 2, "mlp_ratio": 2.0, "num_layers": 1, "patch_size": 16,
              "num_cls_tokens": 3, "num_register_tokens": 1, "neck_dim": 32,
              "image_size": list(NEMOTRON_PARSE_PAGE), "final_size": list(NEMOTRON_PARSE_PAGE)}  # fmt: skip
    config = {"model_type": "nemotron_parse", "text_config": text, "vision_config": vision,
              "image_size": list(NEMOTRON_PARSE_PAGE), **special}  # fmt: skip
    model = _instantiate(nemotron_parse, config, seed)
    _save_model(out_dir, model, config)
    _write_json(out_dir / "preprocessor_config.json", {"processor_class": "NemotronParseProcessor",
                                                        "final_size": list(NEMOTRON_PARSE_PAGE)})  # fmt: skip
    return out_dir

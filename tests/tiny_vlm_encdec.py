"""Tiny random-weight encoder-decoder vision-language models (BART-like text models).

* :func:`build_tiny_florence2`: Florence-2 (a DaViT tower, a BART encoder-decoder). Its processor writes
  the prompt itself: the image's tokens, BOS, the text, EOS (no placeholder in the text). The encoder
  reads the image's features then the text's embeddings once; the decoder starts from
  ``decoder_start_token_id`` and generates with self-attention and cross-attention caches: the engine
  holds them per request (``executor/held_caches.py``, the adapter's ``encoder_decoder``). One DaViT
  stage of width 32 on 16 px images (stride 4): 16 patch tokens and their mean, 17 tokens an image.
  Its processor's patch adds the task and 1000 location tokens to any tokenizer (ids after the
  characters'), so the text model's vocabulary is sized from the patched tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import CLIP_MEAN, CLIP_STD, _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer, _write_json

__all__ = ["build_tiny_florence2"]

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

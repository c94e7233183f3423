"""Tiny random-weight VLMs of the LLaVA-like families mlx-vlm adds beyond tests/tiny_vlm.py.

Same pattern as tiny_vlm.py (its helpers are reused): mlx-vlm's own config dataclasses with only
the sizes made small, random weights scaled so greedy logits are far from ties, a char-level
tokenizer with the family's special tokens, and the processor files mlx-vlm's ``load`` reads.

* :func:`build_tiny_mage_vl`: Mage-VL (Mage-ViT with 3-D rotary, 16 px patches merged 2x2, a
  plain qwen3 text model with 1-D positions): Qwen3-VL's processor layout (a 64x64 picture is
  4 image tokens, 100x60 is 6), features written position by position over ``<|image_pad|>``.
* :func:`build_tiny_llmjpvl`: LLM-jp-VL (SigLIP at 48 px, 8 px patches, InternVL's 0.5 pixel
  shuffle and ``mlp1`` projector, a llama text model): 9 tokens per image. mlx-vlm ships no
  processor for it, so ``load`` takes transformers' ``LlavaProcessor`` from the files written
  here, counting one ``<image>`` per shuffled patch (its ``patch_size`` is the tower's x2).
* :func:`build_tiny_granite_vision`: Granite Vision (LLaVA-NeXT's layout: SigLIP at 28 px,
  any-resolution tiles up to 2x2, a granite text model with its multipliers) under mlx-vlm's
  own processor. Refused at load: mlx-vlm's model puts a whole block of features (and a block
  of newlines) per image token, where its processor counts LLaVA-NeXT's unpadded run.
* :func:`build_tiny_llava_bunny`: Bunny (SigLIP at 378 px: mlx-vlm's model asserts 729 features,
  a qwen2-sized tiny text model at the config's root). Refused at load: mlx-vlm gives the
  tokenizer alone as its processor; its prompt builder splits at ``<image>`` and inserts
  ``image_token_index`` (-200), which the model replaces by the image's features itself.
* :func:`build_tiny_got`: GOT-OCR 2.0 (a SAM-style tower at the fixed 1024 px of mlx-vlm's
  processor: 256 image tokens; a flat qwen2 config). Refused at load: its processor names no
  placeholder (it expands ``<image>`` and wraps every prompt in GOT's own conversation).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    LLAVA_BARE_IMAGE_CHAT_TEMPLATE,
    LLAVA_SPECIAL_TOKENS,
    LLAVA_TEXT_CONFIG,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_MAX_PIXELS,
    QWEN3_VL_MIN_PIXELS,
    QWEN_SPECIAL_TOKENS,
    TINY_SIGLIP_VISION_CONFIG,
    _build_llava_layout,
    _instantiate,
    _make_tokenizer,
    _patch_image_processor,
    _save_model,
    _save_tokenizer,
    _write_json,
    qwen_vision_ids,
    square_image_processor,
)

# Mage-VL's text model: stock qwen3 (q/k RMSNorm, 1-D rotary positions); two layers.
MAGE_VL_TEXT_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# Mage-ViT: one block of width 32 (one head: the 4:6:6 rotary split needs half a head to divide
# by 16), 16 px patches, one frame per patch, merged 2x2 to the text width.
MAGE_VL_VISION_CONFIG = {
    "model_type": "mage_vl_vision",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "intermediate_size": 64,
    "patch_size": 16,
    "temporal_patch_size": 1,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "text_hidden_size": 64,
}


def build_tiny_mage_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Mage-VL directory (Mage-ViT, a qwen3 text model, mlx-vlm's own
    torch-free processor over Qwen3-VL's image processor)."""
    from mlx_vlm.models import mage_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "mage_vl",
        "architectures": ["MageVLForConditionalGeneration"],
        "text_config": {**MAGE_VL_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(MAGE_VL_VISION_CONFIG),
        "vocab_size": vocab_size,
        **qwen_vision_ids(ids),
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
    }
    model = _instantiate(mage_vl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE)
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "MageVLProcessor", config["vision_config"], (QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
        min_pixels=QWEN3_VL_MIN_PIXELS, max_pixels=QWEN3_VL_MAX_PIXELS,
    )  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "MageVLProcessor"})
    return out_dir


# LLM-jp-VL's tower: SigLIP without a CLS position; 48 px at 8 px patches is a 6x6 grid, which
# the 0.5 pixel shuffle folds to 3x3 = 9 image tokens of 4x the width.
LLMJPVL_VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 48,
    "patch_size": 8,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}


def build_tiny_llmjpvl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LLM-jp-VL directory (module doc): SigLIP, pixel shuffle, llama text."""
    from mlx_vlm.models import llmjpvl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(LLMJPVL_VISION_CONFIG)
    config = {
        "model_type": "llmjpvl",
        "architectures": ["LlmJpVLForConditionalGeneration"],
        "text_config": {**LLAVA_TEXT_CONFIG, "vocab_size": vocab_size, "tie_word_embeddings": True},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "img_context_token_id": ids["<image>"],
        "downsample_ratio": 0.5,
        "select_layer": -1,
        "eos_token_id": ids["</s>"],
    }
    model = _instantiate(llmjpvl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", 4096, LLAVA_BARE_IMAGE_CHAT_TEMPLATE)
    preprocessor = square_image_processor(
        "SiglipImageProcessor", vision["image_size"], processor_class="LlavaProcessor", do_convert_rgb=True
    )
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        # One token per shuffled patch: the processor counts (size / patch_size)^2.
        "patch_size": int(vision["patch_size"] / config["downsample_ratio"]),
        "vision_feature_select_strategy": "full",
        "num_additional_image_tokens": 0,
    }
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


# Granite's text model (llama-like with muP multipliers: embeddings x12, residuals x0.22,
# attention scale 1/64, logits / 8), at the tiny llama's sizes.
GRANITE_TEXT_CONFIG = {
    **{k: v for k, v in LLAVA_TEXT_CONFIG.items() if k != "model_type"},
    "model_type": "granite",
}


def build_tiny_granite_vision(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Granite Vision directory (module doc): LLaVA-NeXT's layout with a
    SigLIP tower at 28 px (2x2 patches, all kept), tiles of 28 px up to 2x2, a granite text model."""
    vision = dict(TINY_SIGLIP_VISION_CONFIG)
    tile = vision["image_size"]
    pinpoints = [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    vocab_size = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS).get_vocab_size(with_added_tokens=True)
    return _build_llava_layout(
        out_dir, tokenizer_dir, seed, "granite_vision", "LlavaNextForConditionalGeneration",
        config_extra={"text_config": {**GRANITE_TEXT_CONFIG, "vocab_size": vocab_size}, "vision_config": vision,
                      "image_grid_pinpoints": pinpoints, "vision_feature_select_strategy": "full",
                      "vision_feature_layer": -1},
        preprocessor_extra={"image_processor_type": "LlavaNextImageProcessor", "image_grid_pinpoints": pinpoints,
                            "do_pad": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        processor_extra={"vision_feature_select_strategy": "full", "num_additional_image_tokens": 0},
        processor_class="LlavaNextProcessor", chat_template=LLAVA_BARE_IMAGE_CHAT_TEMPLATE,
    )  # fmt: skip


# Bunny's tower: SigLIP with its attention-pooling head, at 378 px in 14 px patches, since
# mlx-vlm's model asserts 729 (27x27) features per image.
LLAVA_BUNNY_VISION_CONFIG = {
    **TINY_SIGLIP_VISION_CONFIG,
    "image_size": 378,
    "projection_dim": 32,
}


def build_tiny_llava_bunny(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Bunny directory (module doc): a qwen2 text model at the root of the
    config (Bunny's flat layout), SigLIP at 378 px, a 2-layer projector, no processor files:
    mlx-vlm's ``load`` gives the tokenizer and the package's own ``ImageProcessor``."""
    from mlx_vlm.models import llava_bunny

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(LLAVA_BUNNY_VISION_CONFIG)
    config = {
        "model_type": "llava_bunny",
        "architectures": ["BunnyQwen2ForCausalLM"],
        **{k: v for k, v in LLAVA_TEXT_CONFIG.items() if k != "model_type"},
        "vocab_size": vocab_size,
        "vision_config": vision,
        "auto_map": {},
        "mm_hidden_size": vision["hidden_size"],
        "mm_projector_type": "mlp2x_gelu",
        "image_token_index": -200,  # Bunny's: spliced into the ids by the prompt builder, not a token
        "eos_token_id": ids["</s>"],
    }
    model = _instantiate(llava_bunny, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", 4096, LLAVA_BARE_IMAGE_CHAT_TEMPLATE)
    preprocessor = square_image_processor("SiglipImageProcessor", vision["image_size"])
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


GOT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>"]

# GOT's SAM-style tower at the 1024 px its processor always resizes to (16 px patches, a 64x64
# grid, two stride-2 convolutions: 256 features), one windowed block of width 32.
GOT_VISION_CONFIG = {
    "img_size": 1024,
    "patch_size": 16,
    "embed_dim": 32,
    "depth": 1,
    "num_heads": 2,
    "mlp_ratio": 2.0,
    "out_chans": 16,
    "out_dim": 32,
    "window_size": 14,
    "global_attn_indexes": [],
}


def build_tiny_got(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight GOT-OCR 2.0 directory (module doc): a flat qwen2 config, the SAM-style
    tower at 1024 px, and mlx-vlm's own processor (which reads no file but the tokenizer's)."""
    from mlx_vlm.models import got

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GOT_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in GOT_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "got",
        "architectures": ["GOTQwenForCausalLM"],
        **{k: v for k, v in LLAVA_TEXT_CONFIG.items() if k != "model_type"},
        "vocab_size": vocab_size,
        "vision_config": dict(GOT_VISION_CONFIG),
        "im_patch_token": ids["<imgpad>"],
        "im_start_token": ids["<img>"],
        "im_end_token": ids["</img>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    model = _instantiate(got, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE)
    return out_dir

"""Tiny random-weight Qwen-VL-like vision-language models (Qwen2-VL's patch processor or a
relative of it), saved as directories that mlx-vlm loads offline. Same recipe as tiny_vlm.py
(char-level tokenizer with the family's special tokens, scaled random weights, tiny images):

* :func:`build_tiny_dots_ocr`: dots.ocr: a Qwen2-VL-style image processor (14 px patches, no
  temporal depth: ``temporal_patch_size`` 1), its own RMSNorm/SwiGLU tower with 2x2 merge, and a
  plain Qwen2 text model (1-D rotary positions: no ``get_rope_index``); images are
  ``<|img|><|imgpad|><|endofimg|>``. mlx-vlm's processor counts image tokens by the real
  model's ids (``<|imgpad|>`` 151665), so the tokenizer pins them there with filler tokens in
  between (:func:`_pinned_tokenizer`): a vocabulary of the real size, at text width 32.
* :func:`build_tiny_paddleocr_vl`: PaddleOCR-VL: mlx-vlm's own image processor (14 px patches,
  no temporal depth), a SigLIP-like tower with interpolated learned positions, and an ERNIE text
  model with Qwen2-VL's multi-axis rotary from its ``get_rope_index``; text width 1024 (mlx-vlm's
  projector hard-codes that output width; heads and MLP stay narrow). One image a prompt
  (test_vlm_families.py's ``ONE_IMAGE``): mlx-vlm's image processor takes a prompt's images as
  one stack (two of different sizes raise, two of one size become one grid of two frames), so
  its generation, the oracle, fails for two images, and the engine refuses a prompt of two.
* :func:`build_tiny_clef`: CLEF: tiny_vlm's Qwen3.5 (hybrid delta-net text model) under CLEF's
  name, with its decision head (loaded, never called by generation).
* :func:`build_tiny_indic_ocr`: IndicOCR's OCR stage: the same Qwen3.5 under its name.
* :func:`build_tiny_prism_hadamard_qwen35`: a Prism Hadamard pack of Qwen3.5: the embedding and
  the MLP down projections 2-bit packed (group 128, one input rotated by a Walsh-Hadamard
  transform of block 512), so text width 128 and MLP width 512; the rest in float.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_vlm import (
    qwen_vision_ids,
    CHARS,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_MAX_PIXELS,
    QWEN2_VL_MIN_PIXELS,
    QWEN3_5_TEXT_CONFIG,
    QWEN3_VL_MAX_PIXELS,
    QWEN3_VL_MIN_PIXELS,
    QWEN3_VL_VISION_CONFIG,
    QWEN_SPECIAL_TOKENS,
    _instantiate,
    _make_tokenizer,
    _patch_image_processor,
    _save_model,
    _save_tokenizer,
    _write_json,
)


def _pinned_tokenizer(special_tokens: list[str], pinned: dict[str, int]):
    """:func:`tiny_vlm._char_level_tokenizer` where some special tokens must have given ids (a
    processor that hard-codes its real model's ids): filler tokens ``<fN>`` (never produced by
    encoding: there are no merges; each decodes to its own text) take the ids in between, the
    pinned tokens theirs, the other special tokens the ids after the largest."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{ch: i for i, ch in enumerate(CHARS, start=1)}}
    for token, token_id in sorted(pinned.items(), key=lambda item: item[1]):
        vocab.update({f"<f{i}>": i for i in range(len(vocab), token_id)})
        vocab[token] = token_id
    vocab.update({token: len(vocab) + i for i, token in enumerate(t for t in special_tokens if t not in pinned)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", *special_tokens])
    return tok


def _qwen_like_template(image: str) -> str:
    """Qwen2-VL's tiny chat template with ``image`` for an image part."""
    return QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image)


# dots.ocr: the Qwen2 chat tokens and its own image frame.
DOTS_OCR_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|img|>", "<|endofimg|>", "<|imgpad|>",
                           "<|video_pad|>"]  # fmt: skip
DOTS_OCR_IMAGE = "<|img|><|imgpad|><|endofimg|>"

# Its tower: 14 px patches without temporal depth, RMSNorm + SwiGLU blocks, 2x2 merge to the text width.
DOTS_OCR_VISION_CONFIG = {
    "model_type": "dots_vit",
    "embed_dim": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 1,
}

# Hidden size 32: the vocabulary is the real model's size (see build_tiny_dots_ocr) and the head is untied.
DOTS_OCR_TEXT_CONFIG = {
    "model_type": "dots_ocr",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def build_tiny_dots_ocr(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight dots.ocr directory: 2 Qwen2 text layers, a 1-block tower; a 64x64
    picture is 4 image tokens, 100x60 is 8 (as Qwen2-VL's processor sizes them)."""
    arch = importlib.import_module("mlx_vlm.models.dots_ocr")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # mlx-vlm's processor counts image tokens by the real model's ids (151665, 151656).
    pinned = {"<|video_pad|>": 151656, "<|imgpad|>": 151665}
    tok = _pinned_tokenizer(DOTS_OCR_SPECIAL_TOKENS, pinned) if tokenizer_dir is None else None
    tok = tok or _make_tokenizer(tokenizer_dir, DOTS_OCR_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in DOTS_OCR_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "dots_ocr",
        "architectures": ["DotsOCRForCausalLM"],
        "text_config": {**DOTS_OCR_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(DOTS_OCR_VISION_CONFIG),
        "vocab_size": vocab_size,
        "image_token_id": ids["<|imgpad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "eos_token_id": [ids["<|im_end|>"]],
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    template = _qwen_like_template(DOTS_OCR_IMAGE)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, template)
    pixels = (QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS)
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "DotsVLProcessor", config["vision_config"], pixels, do_resize=True,
        min_pixels=pixels[0], max_pixels=pixels[1],
    )  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


# PaddleOCR-VL: ERNIE-style chat tokens and its own image frame.
PADDLEOCR_VL_SPECIAL_TOKENS = ["<|end_of_sentence|>", "<|begin_of_sentence|>", "<|IMAGE_START|>", "<|IMAGE_END|>",
                               "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_PLACEHOLDER|>"]  # fmt: skip
PADDLEOCR_VL_IMAGE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"

# Its tower: SigLIP-like (learned positions on a 4x4 grid, interpolated to each image's patch grid,
# 2-D rotary), 14 px patches, merged 2x2 by the projector to the text width.
PADDLEOCR_VL_VISION_CONFIG = {
    "model_type": "paddleocr_vl",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 56,
    "patch_size": 14,
    "spatial_merge_size": 2,
}

# Its text model: Qwen2-VL's multi-axis rotary (head_dim 16: 8 frequencies, 2/3/3 over t, h, w), computed
# by its own get_rope_index. The config's defaults are partly tuples (an mlx-vlm slip): all set here.
# Hidden size 1024: mlx-vlm's projector hard-codes that output width (narrow heads and MLP keep it small).
PADDLEOCR_VL_TEXT_CONFIG = {
    "hidden_size": 1024,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "default", "type": "default", "mrope_section": [2, 3, 3]},
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "use_bias": False,
    "tie_word_embeddings": False,
}


def build_tiny_paddleocr_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight PaddleOCR-VL directory: 2 text layers with multi-axis rotary, a 1-block
    tower; mlx-vlm's own image processor at 56x56 to 112x112 pixels (4 to 16 image tokens)."""
    arch = importlib.import_module("mlx_vlm.models.paddleocr_vl")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, PADDLEOCR_VL_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in PADDLEOCR_VL_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "paddleocr_vl",
        "architectures": ["PaddleOCRVLForConditionalGeneration"],
        **PADDLEOCR_VL_TEXT_CONFIG,  # the text config is the root (its from_dict copies it)
        "vocab_size": vocab_size,
        "vision_config": dict(PADDLEOCR_VL_VISION_CONFIG),
        "image_token_id": ids["<|IMAGE_PLACEHOLDER|>"],
        "video_token_id": ids["<|VIDEO_PLACEHOLDER|>"],
        "vision_start_token_id": ids["<|IMAGE_START|>"],
        "vision_end_token_id": ids["<|IMAGE_END|>"],
        "bos_token_id": ids["<|begin_of_sentence|>"],
        "eos_token_id": ids["<|end_of_sentence|>"],
        "pad_token_id": 0,
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    template = _qwen_like_template(PADDLEOCR_VL_IMAGE)
    _save_tokenizer(out_dir, tok, "<|end_of_sentence|>", "<unk>", 4096, template)
    vision = {**config["vision_config"], "temporal_patch_size": 1}
    pixels = (QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS)
    preprocessor = _patch_image_processor(
        "PaddleOCRVLImageProcessor", "PaddleOCRVLProcessor", vision, pixels, do_resize=True,
        min_pixels=pixels[0], max_pixels=pixels[1], image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


def _build_qwen3_5_like(
    out_dir: Path, tokenizer_dir: Path | None, seed: int, model_type: str, extra: dict | None = None, *, save=None
) -> Path:
    """A directory in Qwen3.5's layout (tiny_vlm's Qwen3.5 text model and tower, Qwen3-VL's
    processor files) for mlx-vlm's ``model_type`` package, with ``extra`` root config keys;
    ``save(out_dir, model, config)`` replaces ``_save_model`` (packed weights)."""
    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    extra = dict(extra or {})
    text = {**QWEN3_5_TEXT_CONFIG, **extra.pop("text_config", {}), "vocab_size": vocab_size}
    vision = {**QWEN3_VL_VISION_CONFIG, "deepstack_visual_indexes": [], **extra.pop("vision_config", {})}
    config = {
        "model_type": model_type,
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {**vision, "model_type": "qwen3_5"},
        "vocab_size": vocab_size,
        **qwen_vision_ids(ids),
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
        **extra,
    }
    model = _instantiate(arch, config, seed)
    (save or _save_model)(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE)
    pixels = (QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS)
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "Qwen3VLProcessor", config["vision_config"], pixels,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    # mlx-vlm's Qwen3-VL processor reads all three files and asks the hub for a missing one.
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        _write_json(out_dir / name, preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})
    return out_dir


# CLEF's decision head (unused by generation, but loaded with the backbone): one routing and one decoder layer.
CLEF_HEAD_CONFIG = {"hidden_size": 64, "width": 32, "routing_layers": 1, "layers": 1, "heads": 2, "feedforward": 64}


def build_tiny_clef(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight CLEF directory: tiny_vlm's Qwen3.5 (hybrid delta-net text model,
    Qwen3-VL's tower without deepstack) with CLEF's decision head beside it."""
    return _build_qwen3_5_like(out_dir, tokenizer_dir, seed, "clef", {"head_config": CLEF_HEAD_CONFIG})


def build_tiny_indic_ocr(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight IndicOCR (OCR stage) directory: tiny_vlm's Qwen3.5 under IndicOCR's
    name (mlx-vlm's model is Qwen3.5's, its config a copy with the real model's token ids as
    defaults, here set to the tiny tokenizer's)."""
    return _build_qwen3_5_like(out_dir, tokenizer_dir, seed, "indic_ocr")


# Prism's Hadamard packs: 2-bit affine weights (group 128) for the modules its manifest lists, the
# input of each rotated by a signed Walsh-Hadamard transform in blocks of ``block`` (0: none).
# Packed inputs must be multiples of 128 wide: text width 128, MLP width 512 (the rotated block).
PRISM_PACKED_MODULES = [
    {"path": "model.embed_tokens", "embedding": True, "dtype": "float16", "block": 0},
    {"path": "model.layers.0.mlp.down_proj", "embedding": False, "dtype": "float16", "block": 512},
    {"path": "model.layers.1.mlp.down_proj", "embedding": False, "dtype": "float16", "block": 0},
]
PRISM_PACK = {
    "schema_version": 2,
    "base_model_type": "qwen3_5",
    "tensor_namespace": "mlx-vlm-qwen3_5",
    "gdn_activation_layout": "grouped",
    "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
    "modules": PRISM_PACKED_MODULES,
}


def build_tiny_prism_hadamard_qwen35(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Prism Hadamard pack of Qwen3.5: tiny_vlm's Qwen3.5 at text width 128,
    the embedding and the MLP down projections packed (2-bit, one of them Hadamard-rotated), the
    rest in float as the pack's loader keeps what has no ``scales``."""
    text, vision = {"hidden_size": 128, "intermediate_size": 512}, {"out_hidden_size": 128}
    extra = {**PRISM_PACK, "text_config": text, "vision_config": vision}
    return _build_qwen3_5_like(out_dir, tokenizer_dir, seed, "prism_hadamard_qwen35", extra, save=_save_prism_pack)


def _save_prism_pack(out_dir: Path, model, config: dict) -> None:
    """Float weights as ``_save_model`` scales them, the packed modules' replaced by 2-bit
    quantized random matrices of the same scale and random +-1 rotation signs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    weights = {k: v * 4.0 if v.ndim == 2 else v for k, v in weights.items()}
    for record in config["modules"]:
        prefix = f"language_model.{record['path']}"
        rows, columns = weights[f"{prefix}.scales"].shape[0], weights[f"{prefix}.scales"].shape[1] * 128
        dense = mx.random.normal((rows, columns)) * (1.0 if record["embedding"] else 4.0 / columns**0.5)
        packed, scales, biases = mx.quantize(dense, group_size=128, bits=2)
        weights.update({f"{prefix}.weight": packed, f"{prefix}.scales": scales.astype(mx.float16),
                        f"{prefix}.biases": biases.astype(mx.float16)})  # fmt: skip
        if record["block"]:
            weights[f"{prefix}.signs"] = mx.where(mx.random.uniform(shape=(columns,)) < 0.5, -1.0, 1.0)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    _write_json(out_dir / "config.json", config)

"""Tiny random-weight InternVL-style vision-language models (``<img>``-framed image runs, 2x2 pixel
shuffle, an MLP projector), saved as directories mlx-vlm loads offline.

* :func:`build_tiny_internvl_chat`: InternVL 2.5/3 in OpenGVLab's own layout (``internvl_chat``:
  InternViT ``intern_vit_6b``, ``mlp1`` projector, a Qwen2 text model). The prompt's image
  placeholder is the *text* ``<image>``, no token of the tokenizer (several characters here, as
  for InternVL's Qwen2 tokenizer): the processor replaces it with
  ``<img><IMG_CONTEXT> x (4 per tile)</img>`` before tokenizing, so the engine stands a single
  token in for it (``GenericVisionModel.prompt_text``).
* :func:`build_tiny_internvl`: InternVL 3 in transformers' layout (``internvl``: the HF port of
  InternViT with layer scale, a Qwen3 text model with q/k norms); its template writes the single
  token ``<IMG_CONTEXT>`` for an image, which mlx-vlm's processor expands the same way.

* :func:`build_tiny_nemotron_h_nano_omni`: Nemotron 3 Nano Omni (no sound encoder): InternVL's
  ``<img>`` frame around ``<image>`` tokens, but one RADIO view at the image's own size (16 px
  patches, 16 to 64 of them, shuffled 2x2: 4 to 16 tokens) and a Nemotron-H hybrid text model
  (Mamba-2 then attention: the engine keeps the Mamba state in its state pool).

InternVL's two tile an image as InternVL does (``dynamic_preprocess``): 56 px tiles of 4x4 patches, shuffled
to 4 tokens each; at most 2 tiles, plus a thumbnail when there are 2. A square picture is one tile
(4 tokens), a 100x60 one two tiles and the thumbnail (12): with ``<img>`` and ``</img>``, 6 to 14
tokens an image.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    CLIP_MEAN,
    CLIP_STD,
    QWEN2_VL_CHAT_TEMPLATE,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)

# InternVL's added tokens (its tokenizer has no "<image>": the processor replaces that text).
INTERNVL_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
    "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>",
]  # fmt: skip

TILE = 56  # px: 4x4 patches of 14 px, pixel-shuffled 2x2 to 4 tokens
TILING = {"max_dynamic_patch": 2, "min_dynamic_patch": 1, "use_thumbnail": True, "downsample_ratio": 0.5}

INTERNVL_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _internvl_template(image_text: str) -> str:
    return QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", image_text)


def _start(out_dir: Path, tokenizer_dir: Path | None):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, INTERNVL_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in INTERNVL_SPECIAL_TOKENS}
    return out_dir, tok, ids, tok.get_vocab_size(with_added_tokens=True)


def build_tiny_internvl_chat(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight ``internvl_chat`` directory (InternViT, ``mlp1``, Qwen2 text model)."""
    from mlx_vlm.models import internvl_chat

    out_dir, tok, ids, vocab_size = _start(out_dir, tokenizer_dir)
    vision = {"model_type": "intern_vit_6b", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": TILE, "patch_size": 14, "drop_path_rate": 0.0}  # fmt: skip
    config = {
        "model_type": "internvl_chat",
        "architectures": ["InternVLChatModel"],
        "text_config": {**INTERNVL_TEXT_CONFIG, "model_type": "qwen2", "vocab_size": vocab_size},
        "vision_config": vision,
        "image_token_index": ids["<IMG_CONTEXT>"],
        "force_image_size": TILE,
        "eos_token_id": [ids["<|im_end|>"]],
        **TILING,
    }
    model = _instantiate(internvl_chat, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, _internvl_template("<image>"))
    _write_json(out_dir / "processor_config.json", {"processor_class": "InternVLChatProcessor"})
    return out_dir


def build_tiny_internvl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight ``internvl`` directory (HF InternViT port, projector, Qwen3 text model)."""
    from mlx_vlm.models import internvl

    out_dir, tok, ids, vocab_size = _start(out_dir, tokenizer_dir)
    vision = {"model_type": "internvl_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": [TILE, TILE], "patch_size": [14, 14]}  # fmt: skip
    config = {
        "model_type": "internvl",
        "architectures": ["InternVLForConditionalGeneration"],
        "text_config": {**INTERNVL_TEXT_CONFIG, "model_type": "qwen3", "vocab_size": vocab_size},
        "vision_config": vision,
        "image_token_id": ids["<IMG_CONTEXT>"],
        "eos_token_id": [ids["<|im_end|>"]],
        **TILING,
    }
    model = _instantiate(internvl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, _internvl_template("<IMG_CONTEXT>"))
    tokens_per_tile = (TILE // 14) ** 2 // 4
    _write_json(out_dir / "processor_config.json", {"processor_class": "InternVLProcessor",
                                                    "image_seq_length": tokens_per_tile})  # fmt: skip
    return out_dir


NEMOTRON_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<img>", "</img>", "<video>",
    "<so_embedding>", "<so_start>", "<so_end>",
]  # fmt: skip

# Nemotron-H: a Mamba-2 layer then an attention layer ("M*"); the Mamba state lives in the
# engine's state pool (nemotron_h's rows are never right-padded: its SSM ignores lengths).
NEMOTRON_H_TEXT_CONFIG = {
    "model_type": "nemotron_h",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hybrid_override_pattern": "M*",
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "n_groups": 1,
    "chunk_size": 16,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "tie_word_embeddings": False,
}


def build_tiny_nemotron_h_nano_omni(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Nemotron 3 Nano Omni directory (RADIO at the image's own size, 16 px
    patches shuffled 2x2, a Nemotron-H hybrid text model); no sound encoder."""
    from mlx_vlm.models import nemotron_h_nano_omni

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, NEMOTRON_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in NEMOTRON_SPECIAL_TOKENS}
    vision = {"model_type": "radio", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "patch_size": 16, "image_size": 64, "max_resolution": 128,
              "args": {}}  # fmt: skip
    config = {
        "model_type": "nemotron_h_nano_omni",
        "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "text_config": {**NEMOTRON_H_TEXT_CONFIG, "vocab_size": tok.get_vocab_size(with_added_tokens=True)},
        "vision_config": vision,
        "downsample_ratio": 0.5,
        "vit_hidden_size": 32,
        "projector_hidden_size": 64,
        "img_context_token_id": ids["<image>"],
        "video_context_token_id": ids["<video>"],
        "eos_token_id": [ids["<|im_end|>"]],
    }
    model = _instantiate(nemotron_h_nano_omni, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, _internvl_template("<image>"))
    preprocessor = {"norm_mean": CLIP_MEAN, "norm_std": CLIP_STD, "patch_size": 16, "downsample_ratio": 0.5,
                    "min_num_patches": 16, "max_num_patches": 64, "max_model_len": 4096}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "NemotronHNanoOmniProcessor"})
    return out_dir

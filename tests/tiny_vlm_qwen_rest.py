"""Tiny random-weight models of the remaining Qwen-era families, saved as directories that mlx-vlm
loads offline (helpers and conventions: tests/tiny_vlm.py's).

* :func:`build_tiny_qwen3_omni_moe`: Qwen3-Omni-MoE's thinker (the talker and its codec off, as
  ``enable_audio_output`` allows): Qwen3-VL's tower with deepstack, a Qwen3-MoE text model with
  interleaved multi-axis rotary (``get_rope_index``), and an audio tower (loaded, never called:
  audio is not an input the engine takes). ``Model.get_input_embeddings`` delegates to the
  thinker, which gives deepstack features per token (zeros at text tokens) beside the
  embeddings; its processor needs a Whisper feature extractor too.
* :func:`build_tiny_step3p7`: Step 3.7: a perception-encoder tower (2-D rotary, learned positions,
  layer scale) whose output two stride-2 convolutions shrink 4x4 before the projector, under a
  Step 3.5 text model (sliding-window and global layers with different head counts, partial
  rotary, head-wise gates, a sigmoid-routed MoE with a shared expert). mlx-vlm's processor
  (``Step3VLProcessor``, no files of its own: the tokenizer alone) resizes every image to 728 px
  (171 tokens framed by ``<im_start>`` / ``<im_end>``; larger ones add 504 px crops) and puts all
  of a prompt's images at its single ``<im_patch>``: one image a prompt.
* :func:`build_tiny_qwen4_exp`: Qwen4-Exp (mlx-vlm's ``Model`` subclasses Qwen3.5's): Qwen3.5's tower
  and processor over a text model of gated delta-net layers with per-layer n-gram embeddings (PLE:
  hashed n-grams of the ids, n-gram state kept in the layer's cache) and sparse-attention (QSA)
  layers whose top-k indexer keeps pooled keys in ``QSAKVCache``, hyper-connections and a MoE.
  Refused at load (test_vlm_families.py's ``REFUSED_AT_LOAD``). fp8 and ``ple_storage``
  (checkpoint formats: fp8 weights dequantized by ``sanitize``; PLE tables read row by row from the
  checkpoint file) are off.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny_vlm import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_5_TEXT_CONFIG,
    QWEN3_VL_MAX_PIXELS,
    QWEN3_VL_MIN_PIXELS,
    QWEN3_VL_MOE_TEXT_CONFIG,
    QWEN3_VL_VISION_CONFIG,
    QWEN_SPECIAL_TOKENS,
    _instantiate,
    _make_tokenizer,
    _patch_image_processor,
    _save_model,
    _save_tokenizer,
    _write_json,
)

# Qwen3-Omni's tokens: Qwen's, with audio markers and its audio pad.
QWEN3_OMNI_SPECIAL_TOKENS = [*QWEN_SPECIAL_TOKENS, "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
QWEN3_OMNI_TOKEN_NAMES = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                          "audio_token": "<|audio_pad|>", "vision_bos_token": "<|vision_start|>",
                          "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                          "audio_eos_token": "<|audio_end|>"}  # fmt: skip
"""The tokenizer attributes its processor reads (``extra_special_tokens``)."""

# The thinker's text model: Qwen3-VL-MoE's sizes (4 experts, 2 a token; 2/3/3 rotary, interleaved by its code).
QWEN3_OMNI_TEXT_CONFIG = {**QWEN3_VL_MOE_TEXT_CONFIG, "model_type": "qwen3_omni_moe_text",
                          "rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]}}  # fmt: skip
# Its audio tower: a Whisper-like encoder, one layer of width 32 (never run by the tests).
QWEN3_OMNI_AUDIO_CONFIG = {"d_model": 32, "encoder_layers": 1, "num_hidden_layers": 1, "encoder_attention_heads": 2,
                           "encoder_ffn_dim": 64, "output_dim": 64, "downsample_hidden_size": 16,
                           "num_mel_bins": 128}  # fmt: skip
# The talker's config is parsed even with the talker off: its text model needs every size.
QWEN3_OMNI_TALKER_CONFIG = {"text_config": {**QWEN3_OMNI_TEXT_CONFIG, "vocab_size": 64}, "thinker_hidden_size": 64}
WHISPER_FEATURE_EXTRACTOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
                             "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
                             "padding_value": 0.0, "return_attention_mask": True}  # fmt: skip


def build_tiny_qwen3_omni_moe(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Qwen3-Omni-MoE directory (thinker only): 3 MoE text layers, Qwen3-VL's
    2-block tower with deepstack into text layers 0 and 1 (images as in ``build_tiny_qwen3_vl``:
    64x64 is 4 tokens, 100x60 is 6), a 1-layer audio tower."""
    arch = importlib.import_module("mlx_vlm.models.qwen3_omni_moe")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN3_OMNI_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN3_OMNI_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = {**QWEN3_VL_VISION_CONFIG, "model_type": "qwen3_omni_moe_vision_encoder"}
    thinker = {
        "text_config": {**QWEN3_OMNI_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "audio_config": dict(QWEN3_OMNI_AUDIO_CONFIG),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_token_id": ids["<|audio_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"],
    }
    config = {
        "model_type": "qwen3_omni_moe",
        "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "thinker_config": thinker,
        "talker_config": QWEN3_OMNI_TALKER_CONFIG,
        "code2wav_config": {},
        "enable_audio_output": False,
        "vocab_size": vocab_size,
        "eos_token_id": ids["<|im_end|>"],
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE,
                    {"extra_special_tokens": QWEN3_OMNI_TOKEN_NAMES})  # fmt: skip
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "Qwen3OmniMoeProcessor", vision, (QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], **WHISPER_FEATURE_EXTRACTOR,
    )  # fmt: skip
    # Its processor reads the image processor's and the feature extractor's settings from one file.
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        _write_json(out_dir / name, preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Qwen3OmniMoeProcessor"})
    return out_dir


# Step 3.7: its processor's frame and patch tokens beside the chat tokens.
STEP3P7_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<im_start>", "<im_end>",
                          "<patch_start>", "<patch_end>", "<patch_newline>"]  # fmt: skip
STEP3P7_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<im_patch>")

# A perception-encoder tower (2-D rotary, learned positions, layer scale, two stride-2 convolutions
# after it): mlx-vlm's processor resizes every image to 728 px (52x52 patches of 14 px), fixed.
STEP3P7_VISION_CONFIG = {"width": 32, "layers": 1, "heads": 2, "mlp_ratio": 2.0, "image_size": 728, "patch_size": 14}

# Its text model (Step 3.5's): a sliding-window layer (window 8, fewer heads, half-rotary) and a
# global layer with a sigmoid-routed MoE plus a shared expert, clamped SwiGLU, head-wise gates.
STEP3P7_TEXT_CONFIG = {
    "model_type": "step3p5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_attention_groups": 2,
    "num_hidden_layers": 2,
    "head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 8,
    "attention_other_setting": {"num_attention_heads": 2, "num_attention_groups": 1},
    "partial_rotary_factors": [0.5, 1.0],
    "rope_theta": [10000.0, 5000.0],
    "use_head_wise_attn_gate": True,
    "moe_layers_enum": "1",
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "share_expert_dim": 32,
    "use_moe_router_bias": True,
    "swiglu_limits": [0.0, 7.0],
    "max_position_embeddings": 4096,
    "max_seq_len": 4096,
}


def build_tiny_step3p7(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Step 3.7 directory: 2 text layers (sliding, then global MoE), a 1-block
    tower; every image up to 728 px is ``<im_start>``, 169 ``<im_patch>``, ``<im_end>``."""
    arch = importlib.import_module("mlx_vlm.models.step3p7")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, STEP3P7_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in STEP3P7_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "step3p7",
        "architectures": ["Step3p7ForConditionalGeneration"],
        "text_config": {**STEP3P7_TEXT_CONFIG, "vocab_size": vocab_size, "eos_token_id": ids["<|im_end|>"]},
        "vision_config": dict(STEP3P7_VISION_CONFIG),
        "vocab_size": vocab_size,
        "image_token_id": ids["<im_patch>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, STEP3P7_CHAT_TEMPLATE)
    return out_dir


# Qwen4-Exp's text model: Qwen3.5's gated delta-net layer (with per-layer n-gram embeddings of the
# prompt's ids, PLE, mixed in by a short convolution) and a sparse-attention layer (QSA: a top-k
# indexer over pooled keys, kept in a cache of its own), hyper-connections (the hidden state as 2
# streams), a MoE with a shared expert. The n-gram tables are kept small (``ngram_vocab_size_base``).
QWEN3_5_DELTA_NET_KEYS = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_conv_kernel_dim", "rope_parameters")  # fmt: skip
QWEN4_EXP_TEXT_CONFIG = {
    **{key: QWEN3_5_TEXT_CONFIG[key] for key in QWEN3_5_DELTA_NET_KEYS},
    "model_type": "qwen4_exp_text",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "hc_count": 2,
    "hc_lowrank": 8,
    "ple_layer_ids": [1],
    "ple_embed_dim": 32,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 2,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "tie_word_embeddings": True,
}


def build_tiny_qwen4_exp(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Qwen4-Exp directory: Qwen3.5's layout (tower without deepstack,
    Qwen3-VL's processor) over a delta-net layer with n-gram PLE and a QSA layer."""
    from tiny_vlm_qwen_like import _build_qwen3_5_like

    # PLE's n-grams restart after the end-of-sequence token: its config needs that id (the tokenizer's).
    eos = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS).token_to_id("<|im_end|>")
    text = {**QWEN4_EXP_TEXT_CONFIG, "eos_token_id": eos}
    extra = {"text_config": text, "architectures": ["Qwen4ExpForConditionalGeneration"]}
    return _build_qwen3_5_like(out_dir, tokenizer_dir, seed, "qwen4_exp", extra)

"""Tiny random-weight MiniCPM-o / MiniCPM-V 4.6 / MiniCPM-V 4.7 directories for mlx-vlm (tests/tiny_vlm.py's pattern).

* :func:`build_tiny_minicpmo`: MiniCPM-o (a SigLIP tower over the resized image, a resampler of
  ``query_num`` learned queries, Qwen3-VL's text model with plain 1-D positions). Its processor
  expands ``<image>`` to ``<image>`` + ``<unk>`` x ``image_feature_size`` + ``</image>``, gives
  ``tgt_sizes`` (the patch grid) rather than ``image_grid_thw``, and ``image_bound`` (where each
  image's features go) counted over its whole prompt.
* :func:`build_tiny_minicpmv4_6`: MiniCPM-V 4.6 (a SigLIP-style tower with a 2x2 ViT merger after
  its first layer, a 2x2 merger, Qwen3.5's hybrid text model on plain 1-D positions). Its
  processor slices a larger image into crops (``<image>`` ... ``</image>`` then one ``<slice>``
  ... ``</slice>`` a crop) and numbers the images of a prompt (``<image_id>k</image_id>``).
* :func:`build_tiny_minicpmv4_7`: MiniCPM-V 4.7, 4.6's layout with "canvas" positions: each
  image's thumbnail and crops laid on one 3-D canvas, from the crop grids (``tgt_sizes``).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import QWEN3_5_TEXT_CONFIG, _char_level_tokenizer, _instantiate, _save_model, _save_tokenizer, _write_json

MINICPM_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "</image>", "<slice>", "</slice>",
    "<image_id>", "</image_id>", "<|image_pad|>", "<|video_pad|>", "<|listen|>",
    "<|audio_start|>", "<|audio_end|>", "<|spk_bos|>", "<|spk_eos|>", "<|tts_bos|>", "<|tts_eos|>",
]  # fmt: skip
"""MiniCPM-o's processor looks up its audio and speech markers and drops ``<|listen|>`` from every
prompt: each must be a token of its own, or it takes ``<unk>``'s id, the image's fill."""

# The Qwen chat shape; an image part renders as "<image>" (MiniCPM-o's image marker) or as
# "<|image_pad|>" (MiniCPM-V's: its processor names it ``image_token``, the engine's placeholder).
MINICPM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}IMAGE"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_template(image_text: str) -> str:
    return MINICPM_CHAT_TEMPLATE.replace("IMAGE", image_text)


# Qwen3-VL's text model, tiny; head_dim 16 -> 8 rotary frequencies over the three (equal) axes.
MINICPMO_TEXT_CONFIG = {
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
    "rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]},
}  # fmt: skip
MINICPM_VISION_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "image_size": 56, "patch_size": 14,
}  # fmt: skip
MINICPMO_QUERIES = 4
"""Tokens per image: the resampler's queries, as many as the processor's ``image_feature_size``."""


def build_tiny_minicpmo(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight MiniCPM-o directory (module doc), no audio tower or TTS: images
    resized to about 56x56 px (4x4 patches of 14 px), 4 tokens each. ``tokenizer_dir`` is not used."""
    import mlx.core as mx
    from mlx_vlm.models import minicpmo

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(MINICPM_SPECIAL_TOKENS)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "minicpmo",
        "architectures": ["MiniCPMO"],
        "text_config": {**MINICPMO_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": {**MINICPM_VISION_CONFIG, "model_type": "siglip_vision_model"},
        "query_num": MINICPMO_QUERIES,
        "image_size": 56,
        "patch_size": 14,
        "init_audio": False,
        "init_tts": False,
        "slice_mode": False,
        "eos_token_id": [tok.token_to_id("<|im_end|>")],
    }
    model = _instantiate(minicpmo, config, seed)
    # The resampler's queries start at zero (every query alike): random ones give each image
    # token its own feature.
    model.resampler.query = mx.random.normal(model.resampler.query.shape) * 0.5
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, _chat_template("<image>"))
    preprocessor = {"patch_size": 14, "scale_resolution": 56, "image_feature_size": MINICPMO_QUERIES,
                    "feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
                    "n_fft": 400}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


# -- MiniCPM-V 4.6 / 4.7 --------------------------------------------------------------------

MINICPMV_VISION_CONFIG = {**MINICPM_VISION_CONFIG, "model_type": "minicpmv4_6_vision", "window_kernel_size": [2, 2]}
MINICPMV_PREPROCESSOR = {
    "patch_size": 14, "scale_resolution": 56, "max_slice_nums": 4, "slice_mode": True, "use_image_id": True,
    "downsample_mode": "16x", "pack_image_by_patch": True,
}  # fmt: skip
"""Images resized to about 56x56 px: 4x4 patches of 14 px, merged 2x2 twice (the ViT merger after
vision layer 0, then the merger) into one token; a larger image is sliced into crops of its own."""


def build_tiny_minicpmv4_6(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight MiniCPM-V 4.6 directory (module doc). ``tokenizer_dir`` is not used."""
    return _build_minicpmv(out_dir, seed, "minicpmv4_6", {})


def _build_minicpmv(out_dir: Path, seed: int, model_type: str, extra: dict) -> Path:
    import importlib

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(MINICPM_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MINICPM_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": model_type,
        "architectures": ["MiniCPMV"],
        "text_config": {**QWEN3_5_TEXT_CONFIG, "vocab_size": vocab_size, "tie_word_embeddings": True},
        "vision_config": MINICPMV_VISION_CONFIG,
        "image_size": 56,
        "patch_size": 14,
        "insert_layer_id": 0,
        "downsample_mode": "16x",
        "eos_token_id": [ids["<|im_end|>"]],
        **{key: (ids[value] if isinstance(value, str) else value) for key, value in extra.items()},
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, _chat_template("<|image_pad|>"))
    _write_json(out_dir / "preprocessor_config.json", MINICPMV_PREPROCESSOR)
    return out_dir


def build_tiny_minicpmv4_7(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight MiniCPM-V 4.7 directory: 4.6's (module doc) with "canvas" positions,
    for which the config names the image, video, marker and newline tokens. ``tokenizer_dir`` is not used."""
    markers = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>", "image_start_id": "<image>",
               "image_end_id": "</image>", "slice_start_id": "<slice>", "slice_end_id": "</slice>",
               "newline_id": 2}  # fmt: skip
    return _build_minicpmv(out_dir, seed, "minicpmv4_7", markers)

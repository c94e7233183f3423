"""Tiny random-weight vision-language models whose image embeddings come with features their text
model takes beside them (``visual_pos_masks``, ``deepstack_visual_embeds``), built as tests/tiny_vlm.py
builds its families (its helpers, char-level tokenizer, weights scaled x4 so greedy logits are far
from ties), each with mlx-vlm's own processor:

* :func:`build_tiny_cohere_compass`: Cohere Compass (Qwen3-VL-style packed tower, 16 px patches,
  2x2 merge, learned positions, deepstack from vision blocks 0 and 1 added after text layers 0 and
  1 at the image tokens), a text model of layer-normed parallel blocks with interleaved multi-axis
  rotary positions from its ``get_rope_index``. ``<|IMAGE_PAD|>`` expands to one pad per merged
  patch (no markers of its own: the template frames it with ``<|VISION_START|>`` / ``<|VISION_END|>``,
  which ``get_rope_index`` reads); a 100x60 picture is 6 tokens.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)

__all__ = ["build_tiny_cohere_compass"]


def _frame_chat_template(image_text: str, start: str, end: str) -> str:
    """A template of ``{start}role\\n...{end}`` turns whose image parts render as ``image_text``."""
    return (
        "{% for message in messages %}" + start + "{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + image_text +
        "{% elif 'text' in part %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}" + end + "{% endfor %}"
        "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )  # fmt: skip


# -- Cohere Compass ------------------------------------------------------------------------------

COHERE_COMPASS_SPECIAL_TOKENS = [
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>",
    "<|placeholder|>", "<PAD>",
]  # fmt: skip
COHERE_COMPASS_IMAGE_TEXT = "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"

# Text: hidden 64, 2 layers, head_dim 16 (8 rotary frequencies: 4/2/2 over t, h, w, interleaved).
COHERE_COMPASS_TEXT_CONFIG = {
    "model_type": "cohere_compass_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    # Per layer type: transformers' config (which mlx-vlm's load also builds) takes no list at the top.
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}},
}

# Vision: width 32, 2 blocks (deepstack taps both), 16 px patches merged 2x2 to the text width.
COHERE_COMPASS_VISION_CONFIG = {
    "model_type": "cohere_compass_vision",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
}


def build_tiny_cohere_compass(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Cohere Compass directory (module doc): images of 64x64 (4 tokens) up to
    128x128 px (16 tokens)."""
    from mlx_vlm.models import cohere_compass

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, COHERE_COMPASS_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in COHERE_COMPASS_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "cohere_compass",
        "text_config": {**COHERE_COMPASS_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": COHERE_COMPASS_VISION_CONFIG,
        "image_token_id": ids["<|IMAGE_PAD|>"],
        "vision_start_token_id": ids["<|VISION_START|>"],
        "vision_end_token_id": ids["<|VISION_END|>"],
        "eos_token_id": ids["<|END_OF_TURN_TOKEN|>"],
        "pad_token_id": ids["<PAD>"],
        "min_pixels": 64 * 64,
        "max_pixels": 128 * 128,
    }
    model = _instantiate(cohere_compass, config, seed)
    _save_model(out_dir, model, config)
    template = _frame_chat_template(COHERE_COMPASS_IMAGE_TEXT, "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
    _save_tokenizer(out_dir, tok, "<|END_OF_TURN_TOKEN|>", "<PAD>", 4096, template)
    preprocessor = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                    "min_pixels": 64 * 64, "max_pixels": 128 * 128}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

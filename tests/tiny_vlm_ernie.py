"""Tiny random-weight vision-language models the engine serves by their model's own call, not by
mlx-vlm's generation (which disagrees with it), saved as directories that mlx-vlm loads offline.
Helpers and conventions are tests/tiny_vlm.py's.

* :func:`build_tiny_ernie4_5_moe_vl`: ERNIE 4.5 VL: a DFN-RoPE tower with a resampler (2x2
  spatial and 2-frame temporal merge), a text model with 3-D rotary positions that its
  ``get_rope_index`` gives batch first (``[batch, tokens, 3]``), and a MoE with separate text and
  vision experts, chosen per token by ``token_type_ids`` (1 at image tokens) that its
  ``Model.__call__`` builds from the ids and mlx-vlm's generation never passes (so there its image
  tokens take the text experts). Its processor expands the chat template's whole
  ``<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>``, and has its own SentencePiece tokenizer
  (trained here, one piece per character, ``tokenizer.model``). The vision experts are scaled as
  the text experts are (``_save_model`` scales ``switch_mlp`` only), so the token types decide
  the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _instantiate, _save_model, _write_json
from tiny_vlm_moe_text import _save_char_sentencepiece

ERNIE_SPECIAL_TOKENS = [
    "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>", "<mask:7>", "<|IMAGE_START|>", "<|IMAGE_END|>",
    "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_START|>", "<|VIDEO_END|>", "<|image@placeholder|>",
]  # fmt: skip

# ERNIE 4.5 VL's template shape: "User: <|IMAGE_START|><|image@placeholder|><|IMAGE_END|>Describe\nAssistant: ".
ERNIE_IMAGE = "<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>"
ERNIE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 'User: ' if message['role'] == 'user' else 'Assistant: ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + ERNIE_IMAGE +
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)  # fmt: skip

# ERNIE 4.5 VL's text model (flat at the config's root): both layers a MoE of 4 text and 4 vision
# experts (2 per token): the real model's first layer is dense, but in two layers the vision experts
# would then act at the last one alone, where an image token's MLP output reaches no later token
# (nothing would test them); head_dim 16: 8 rotary frequencies, (h, w, t) = 3, 3, 2.
ERNIE_TEXT_CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "head_dim": 16, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "moe_num_experts": [4, 4], "moe_layer_start_index": 0, "moe_layer_end_index": 1,
    "moe_intermediate_size": [32, 32], "moe_k": 2, "mrope_section": [3, 3, 2], "freq_allocation": 2,
}  # fmt: skip

VISION_EXPERT_SCALE = 4.0
"""What ``_save_weights`` multiplies the text experts (``switch_mlp``) by: the vision experts
(``switch_mlp_1``, which it leaves as they are) get the same here."""


def build_tiny_ernie4_5_moe_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight ERNIE 4.5 VL directory (``ERNIE_TEXT_CONFIG``, a one-block tower of
    width 32; mlx-vlm's image processor at its defaults: 56x56 px and up, 28 px per token).
    ``tokenizer_dir`` is not used: the family's tokenizer is SentencePiece's."""
    from mlx.utils import tree_map_with_path
    from mlx_vlm.models import ernie4_5_moe_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = _save_char_sentencepiece(out_dir / "tokenizer.model", ERNIE_SPECIAL_TOKENS)
    ids = {t: pieces.index(t) for t in ERNIE_SPECIAL_TOKENS}
    vision = {"model_type": "DFNRope_vision_transformer", "depth": 1, "embed_dim": 32, "hidden_size": 32,
              "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 14, "spatial_merge_size": 2}  # fmt: skip
    config = {
        "model_type": "ernie4_5_moe_vl",
        "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"],
        **ERNIE_TEXT_CONFIG,
        "vocab_size": len(pieces),
        "vision_config": vision,
        "pixel_hidden_size": 32,
        "im_patch_id": ids["<|IMAGE_PLACEHOLDER|>"],
        "image_start_token_id": ids["<|IMAGE_START|>"],
        "image_end_token_id": ids["<|IMAGE_END|>"],
        "video_start_token_id": ids["<|VIDEO_START|>"],
        "video_end_token_id": ids["<|VIDEO_END|>"],
        "eos_token_id": [pieces.index("</s>")],
    }
    model = _instantiate(ernie4_5_moe_vl, config, seed)
    scaled = tree_map_with_path(
        lambda name, value: value * VISION_EXPERT_SCALE if ".switch_mlp_1." in name else value, model.parameters()
    )
    model.update(scaled)
    _save_model(out_dir, model, config)
    tokenizer_config = {
        "tokenizer_class": "Ernie4_5_VLTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "unk_token": "<unk>", "model_max_length": 4096, "chat_template": ERNIE_CHAT_TEMPLATE,
        "additional_special_tokens": ERNIE_SPECIAL_TOKENS,
    }  # fmt: skip
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "processor_config.json", {"spatial_conv_size": 2, "temporal_conv_size": 2})
    return out_dir

"""Tiny random-weight Llama 3.2 Vision models (mlx-vlm loads them offline).

As tests/tiny_vlm.py (its helpers build the tokenizer, weights and config files here):

* :func:`build_tiny_mllama`: ``mllama`` (Llama 3.2 Vision): an image is one ``<|image|>`` token in the
  prompt, whose row is that token's own embedding; its features never enter the token stream: the
  tower's states (up to 4 tiles of 28 px, 5 states a tile, all tiles kept, padding tiles too) reach the
  text model's cross-attention layer beside the embeddings, with a per-token mask of the images each
  prompt token sees (the images from the last ``<|image|>`` before it; none before the first: that row
  attends to all states uniformly and its MLP output is masked out). mlx-vlm's decode steps pass the
  states alone (every image, unmasked). Its processor writes the BOS after the prompt's leading
  images. The engine holds its caches per request and passes these per-request inputs with each call.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import HALF, _instantiate, _make_tokenizer, _save_model, _save_tokenizer, _write_json

MLLAMA_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|image|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
                         "<|python_tag|>"]  # fmt: skip
MLLAMA_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "cross_attention_layers": [1],
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
MLLAMA_VISION_CONFIG = {
    "image_size": 28,
    "patch_size": 14,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_global_layers": 1,
    "num_attention_heads": 2,
    "intermediate_layers_indices": [0],
    "vision_output_dim": 64,  # hidden_size x (1 + the intermediate layers taken)
    "max_num_tiles": 4,
}
MLLAMA_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_tiny_mllama(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Llama 3.2 Vision directory (module doc): a 1-layer tower on 28 px tiles, a
    2-layer text model whose second layer cross-attends to the image states."""
    from mlx_vlm.models import mllama

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, MLLAMA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MLLAMA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["<|eot_id|>"]]
    config = {
        "model_type": "mllama",
        "architectures": ["MllamaForConditionalGeneration"],
        "text_config": {**MLLAMA_TEXT_CONFIG, "model_type": "mllama", "vocab_size": vocab_size, "eos_token_id": eos},
        "vision_config": dict(MLLAMA_VISION_CONFIG),
        "image_token_index": ids["<|image|>"],
        "vocab_size": vocab_size,
        "eos_token_id": eos,
    }
    model = _instantiate(mllama, config, seed)
    # The gates start at zero (tanh(0) = 0: no cross-attention at all): open them, so images count.
    for layer in model.language_model.model.layers:
        if hasattr(layer, "cross_attn_attn_gate"):
            layer.cross_attn_attn_gate = layer.cross_attn_attn_gate + 1.0
            layer.cross_attn_mlp_gate = layer.cross_attn_mlp_gate + 1.0
    _save_model(out_dir, model, config)
    extra = {"bos_token": "<|begin_of_text|>"}  # its processor writes it after the prompt's leading images
    _save_tokenizer(out_dir, tok, "<|eot_id|>", "<|finetune_right_pad_id|>", 4096, MLLAMA_CHAT_TEMPLATE, extra)
    tile = MLLAMA_VISION_CONFIG["image_size"]
    preprocessor = {"image_processor_type": "MllamaImageProcessor", "processor_class": "MllamaProcessor",
                    "size": {"height": tile, "width": tile}, "max_image_tiles": MLLAMA_VISION_CONFIG["max_num_tiles"],
                    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_pad": True,
                    "do_convert_rgb": True, "image_mean": HALF, "image_std": HALF}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

"""Tiny random-weight DeepSeek OCR-side and Janus vision-language models, saved as directories
that mlx-vlm loads offline; the helpers are tests/tiny_vlm.py's and tests/tiny_vlm_deepseek.py's.

* :func:`build_tiny_multi_modality`: Janus (``multi_modality``): a SigLIP tower (96 px patches of
  a 384 px image: 16 features an image), an MLP aligner and a llama text model. mlx-vlm
  ships no processor class that transformers can find for it, so ``load`` gives the tokenizer
  with the model's image processor attached, and the model inserts ``num_image_tokens`` image
  tokens itself for each ``<image>`` mark (``add_image_token``): served as an image the model
  expands, the prompt built as mlx-vlm's ``prepare_inputs`` builds it (a BOS on each text piece).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _instantiate, _save_model, _write_json
from tiny_vlm_deepseek import _deepseek_tokenizer

JANUS_IMAGE_SIZE, JANUS_PATCH = 384, 96
"""mlx-vlm's image processor resizes to 384 px whatever the config says; 96 px patches give 16 features.
The tower is as wide as a patch: mlx-vlm's sanitize takes a patch kernel wider than its channel count
for PyTorch's layout and transposes it."""


def build_tiny_multi_modality(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Janus directory (module doc)."""
    from mlx_vlm.models import multi_modality

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _deepseek_tokenizer(out_dir, tokenizer_dir)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    tokens = (JANUS_IMAGE_SIZE // JANUS_PATCH) ** 2
    config = {
        "model_type": "multi_modality",
        "architectures": ["MultiModalityCausalLM"],
        "language_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "vocab_size": vocab_size},
        "vision_config": {"model_type": "vision", "cls": "SigLIPVisionTower", "params": {},
                          "num_hidden_layers": 1, "hidden_size": JANUS_PATCH, "intermediate_size": 64,
                          "num_attention_heads": 2, "image_size": JANUS_IMAGE_SIZE, "patch_size": JANUS_PATCH},
        "aligner_config": {"cls": "MlpProjector", "model_type": "aligner",
                           "params": {"projector_type": "mlp_gelu", "depth": 2}},
        "image_token_index": tok.token_to_id("<image>"),
        "num_image_tokens": tokens,
        "pad_id": tok.token_to_id("<｜▁pad▁｜>"),
        "vocab_size": vocab_size,
        "eos_token_id": [tok.token_to_id("<｜end▁of▁sentence｜>")],
    }  # fmt: skip
    config["text_config"] = config["language_config"]  # mlx-vlm's load reads this name
    model = _instantiate(multi_modality, {**config, "projector_config": config["aligner_config"]}, seed)
    _save_model(out_dir, model, config)
    _write_json(out_dir / "processor_config.json", {"processor_class": "MultiModalityProcessor",
                                                    "num_image_tokens": tokens})  # fmt: skip
    return out_dir

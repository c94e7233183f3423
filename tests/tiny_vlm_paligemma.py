"""A tiny random-weight PaliGemma, saved as a directory that mlx-vlm loads offline (tests/tiny_vlm.py
describes the pattern and its helpers).

* :func:`build_tiny_paligemma`: PaliGemma (a SigLIP tower at 28x28 in 14 px patches, 4 tokens an image,
  a linear projector, a gemma text model) under mlx-vlm's own processor, which writes the prompt itself:
  every image's ``<image>`` tokens, then the BOS after the last image, the text and a closing newline.
  Its text model is a prefix LM (``use_bidirectional_attention`` is True where a config leaves it unset):
  mlx-vlm prefills the whole prompt in one call, without a mask, so every prompt token sees every other,
  text-only prompts too; decode steps are causal.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    HALF,
    _char_level_tokenizer,
    _instantiate,
    _save_model,
    _save_tokenizer,
    _write_json,
)

PALIGEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<image>"]

PALIGEMMA_TEXT_CONFIG = {
    "model_type": "gemma",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}

PALIGEMMA_VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 28,
    "projection_dim": 32,
}


def build_tiny_paligemma(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, weight_scale: float = 4.0
) -> Path:
    """A tiny PaliGemma directory (module doc): 4 image tokens an image, whatever its size.

    The root ``hidden_size`` equals the text model's: mlx-vlm divides image features by the root
    one's square root, the text model multiplies by its own. Weights are scaled x4 (``_save_model``'s
    default): at x0.75 this 32-wide model writes the same token whatever the prompt."""
    from mlx_vlm.models import paligemma

    del tokenizer_dir  # the character-level tokenizer: PaliGemma's processor adds its own tokens to any
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _char_level_tokenizer(PALIGEMMA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in PALIGEMMA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {**PALIGEMMA_TEXT_CONFIG, "vocab_size": vocab_size}
    vision = PALIGEMMA_VISION_CONFIG
    tokens_per_image = (vision["image_size"] // vision["patch_size"]) ** 2
    config = {
        "model_type": "paligemma",
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(vision),
        "vocab_size": vocab_size,
        "hidden_size": text["hidden_size"],
        "projection_dim": text["hidden_size"],
        "image_token_index": ids["<image>"],
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": ids["<eos>"],
    }
    _save_model(out_dir, _instantiate(paligemma, config, seed), config, weight_scale)
    extra = {"bos_token": "<bos>", "extra_special_tokens": {"image_token": "<image>"}}
    _save_tokenizer(out_dir, tok, "<eos>", "<pad>", text["max_position_embeddings"], PALIGEMMA_CHAT_TEMPLATE, extra)
    preprocessor = {
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "PaliGemmaProcessor",
        "do_resize": True,
        "size": {"height": vision["image_size"], "width": vision["image_size"]},
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": HALF,
        "image_std": HALF,
        "image_seq_length": tokens_per_image,
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(
        out_dir / "processor_config.json",
        {"processor_class": "PaliGemmaProcessor", "image_seq_length": tokens_per_image},
    )
    return out_dir


# PaliGemma checkpoints ship no chat template (its prompts are task prefixes): an image part
# renders as <image>, text as itself.
PALIGEMMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)

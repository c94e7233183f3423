"""Tiny random-weight vision-language models of families with processors of their own.

Built as tests/tiny_vlm.py builds its families (its helpers, char-level tokenizer, weights scaled
x4 so greedy logits are far from ties), each with mlx-vlm's own processor class:

* :func:`build_tiny_muse_glimmer`: Muse Glimmer (Qwen-style 14 px patches, 2x2 pixel shuffle,
  two-layer adapter and RMS-normalized projection), a text model of a sliding-window layer with
  rotary positions and a global layer without, gated attention, soft-capped scaled logits (so
  no backbone/head split). ``<|patch|>`` expands to ``<|image_start|> <|patch|> x n
  <|image_end|>``; a 100x60 picture is 2x3 = 6 tokens.
* :func:`build_tiny_muse_spark`: Muse Spark (Muse Glimmer's tower and prompt, the tower on whole
  images; a mixture-of-experts text model). transformers' config insists on an audio tower as
  wide as the text model, so a tiny one is written. mlx-vlm's text model runs fused Metal
  kernels with no fallback: without Metal the engine refuses it (and mlx-vlm itself fails).
* :func:`build_tiny_d1`: d1 (LFM2-VL's model with typed-decision readouts, which generation does
  not use): tiny_vlm's LFM2-VL directory under model type ``d1``.

Not here: Gemma 3n (mlx-vlm's tower is a fixed MobileNet-V5 of 294 M parameters and 256 tokens
per image whatever the config says, so no tiny model exists).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import _instantiate, _make_tokenizer, _save_model, _save_tokenizer, _write_json, build_tiny_lfm2_vl

__all__ = ["build_tiny_d1", "build_tiny_muse_glimmer", "build_tiny_muse_spark"]

def _simple_chat_template(image_text: str, start: str, end: str) -> str:
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


def _tokenizer_and_ids(tokenizer_dir: Path | None, special_tokens: list[str]):
    tok = _make_tokenizer(tokenizer_dir, special_tokens)
    ids = {t: tok.token_to_id(t) for t in special_tokens}
    return tok, ids, tok.get_vocab_size(with_added_tokens=True)


# -- Muse Glimmer ------------------------------------------------------------------------------

MUSE_GLIMMER_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end|>", "<|start|>", "<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>",
]  # fmt: skip


def build_tiny_muse_glimmer(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Muse Glimmer directory (module doc): text hidden 64, a sliding layer
    (window 8, rotary) and a global one (no rotary); a 1-layer tower of width 32; up to 16 image
    tokens per image."""
    from mlx_vlm.models import muse_glimmer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, ids, vocab_size = _tokenizer_and_ids(tokenizer_dir, MUSE_GLIMMER_SPECIAL_TOKENS)
    eos = ids["<|end|>"]
    text = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "vocab_size": vocab_size,
        "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos, "pad_token_id": eos,
    }  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
              "patch_size": 14, "merge_size": 2, "pos_emb_height": 4, "pos_emb_width": 4}  # fmt: skip
    config = {
        "model_type": "muse_glimmer",
        "architectures": ["MuseGlimmerForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|patch|>"],
        "video_token_id": ids["<|video|>"],
        "out_hidden_size": 32 * 2 * 2,  # the tower's width after the 2x2 pixel shuffle
        "projector_hidden_size": 64,
        "eos_token_id": eos,
    }
    model = _instantiate(muse_glimmer, config, seed)
    _save_model(out_dir, model, config)
    template = _simple_chat_template("<|patch|>", "<|start|>", "<|end|>")
    _save_tokenizer(out_dir, tok, "<|end|>", "<|end|>", 4096, template)
    image = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "max_image_tokens": 16}
    _write_json(out_dir / "processor_config.json", {"image_processor": image})
    return out_dir


# -- Muse Spark ---------------------------------------------------------------------------------

MUSE_SPARK_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end|>", "<|start|>", "<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>",
    "<|audio|>",
]  # fmt: skip


def build_tiny_muse_spark(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Muse Spark directory: Muse Glimmer's tower and prompt (the tower takes
    whole images), a mixture-of-experts text model (every layer sparse: 4 experts at a
    compressed width, top 2) with a sliding-window layer and a global one."""
    from mlx_vlm.models import muse_spark

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, ids, vocab_size = _tokenizer_and_ids(tokenizer_dir, MUSE_SPARK_SPECIAL_TOKENS)
    eos = ids["<|end|>"]
    text = {
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 2, "vocab_size": vocab_size, "rms_norm_eps": 1e-5, "post_norm_eps": 1e-8,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "layer_rope_theta": [10000.0, 0],
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
        "final_logit_softcapping": 20.0, "output_multiplier": 0.2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "moe_hidden_size": 32, "moe_intermediate_size": 64,
    }  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
              "patch_size": 14, "merge_size": 2, "pos_emb_height": 4, "pos_emb_width": 4}  # fmt: skip
    config = {
        "model_type": "muse_spark",
        "architectures": ["MuseSparkForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|patch|>"],
        "video_token_id": ids["<|video|>"],
        "audio_token_id": ids["<|audio|>"],
        "projector_hidden_size": 64,
        # transformers' config validates a tiny audio tower into the text width (it always has one).
        "audio_config": {"hidden_sizes": [8, 8, 8, 8], "depths": [1, 1, 1, 1], "out_hidden_size": 64},
        "eos_token_id": [eos],
    }
    model = _instantiate(muse_spark, config, seed)
    _save_model(out_dir, model, config)
    template = _simple_chat_template("<|patch|>", "<|start|>", "<|end|>")
    _save_tokenizer(out_dir, tok, "<|end|>", "<|end|>", 4096, template)
    _write_json(out_dir / "processor_config.json", {"image_processor": {"max_image_tokens": 16}})
    return out_dir


# -- d1 -----------------------------------------------------------------------------------------


def build_tiny_d1(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight d1 directory: LFM2-VL's model (mlx-vlm's d1 is LFM2-VL's ``Model`` with
    typed-decision readouts added, which generation does not use) under its own model type."""
    import json

    out_dir = build_tiny_lfm2_vl(out_dir, tokenizer_dir, seed=seed)
    config = json.loads((out_dir / "config.json").read_text())
    config.update(model_type="d1", architectures=["D1ForConditionalGeneration"])
    _write_json(out_dir / "config.json", config)
    return out_dir

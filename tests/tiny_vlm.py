"""Tiny random-weight vision-language models, saved as directories that mlx-vlm loads offline.

No model hub is reachable in the test environment, so the multimodal tests build their own VLMs:

* :func:`build_tiny_qwen2_vl`: Qwen2-VL, text hidden size 64 with 2 layers and multi-axis rotary
  positions, a 1-block vision tower of width 32, the vision special tokens, a Qwen2-VL-style chat
  template, and an image processor set to tiny images: 56x56 to 112x112 pixels after resizing,
  i.e. 4 to 16 image tokens (a 64x64 picture: 4; 100x60: 8).
* :func:`build_tiny_qwen2_5_vl`: the same with Qwen2.5-VL's vision tower (window attention).
* :func:`build_tiny_llava`: LLaVA-1.5 (llama text model, CLIP tower at 28x28, projector): every
  image becomes 4 tokens. mlx-vlm's LLaVA processor breaks under transformers 5 when given
  ``padding``; see :func:`drop_text_kwargs_for_images`.

Weights are random (2-D weights scaled x4, as in tiny_model.py, so greedy logits are peaked, far
from ties): the text is gibberish but deterministic, and it depends on the image pixels, which is
all the oracle tests (cache on == cache off, batched == solo, engine == mlx-vlm) need. Building
takes ~10 ms and loading ~20 ms once mlx-vlm is imported (~0.8 s).

The tokenizer is either built here with the ``tokenizers`` library (no files needed: one token
per printable ASCII character, tab or newline, plus the chat/vision special tokens; every id
decodes to valid text on its own), or derived from a real tokenizer directory (e.g. the default
SmolLM2 model's, ``tokenizer_dir``) with the special tokens added.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import TINY_CONFIG

# Special tokens of the Qwen2-VL family, in the order they get ids.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# A Qwen2-VL-style chat template: string or list-of-parts content; image parts render as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands <|image_pad|> to one token
# per merged patch). Unlike the real one it adds no default system message (shorter prompts).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN2_VL_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    # head_dim 16 -> 8 rotary frequencies, split over (temporal, height, width) positions.
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

QWEN2_VL_VISION_CONFIG = {
    "model_type": "qwen2_vl",
    "depth": 1,
    "embed_dim": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "hidden_size": 64,  # the merger projects to the text hidden size
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}

# Qwen2.5-VL's tower: RMSNorm + SwiGLU blocks, windowed attention except in
# fullatt_block_indexes (here block 0 windowed, block 1 full); width in ``hidden_size`` and the
# merger's output (= text hidden size) in ``out_hidden_size``. A window is 112 px = 4x4 merged
# tokens, so images up to 112x112 fit one window.
QWEN2_5_VL_VISION_CONFIG = {
    "model_type": "qwen2_5_vl",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "fullatt_block_indexes": [1],
    "window_size": 112,
    "tokens_per_second": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}

# Qwen2-VL resizes images to multiples of patch_size * merge_size = 28 px, with an area between
# min_pixels and max_pixels: 56x56 (4 image tokens) up to 112x112 (16 image tokens).
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 112 * 112


# The standalone tokenizer's alphabet: tab, newline and printable ASCII, one token per character.
CHARS = ["\t", "\n", *map(chr, range(32, 127))]


def _char_level_tokenizer(special_tokens: list[str]):
    """One token per character of :data:`CHARS` (any other character encodes as ``<unk>``, id 0)
    plus ``special_tokens``. Every id decodes to complete text on its own, so random outputs are
    valid strings and streamed text never holds back partial UTF-8."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{ch: i for i, ch in enumerate(CHARS, start=1)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", *special_tokens])
    return tok


def _make_tokenizer(tokenizer_dir: Path | None, special_tokens: list[str]):
    from tokenizers import Tokenizer

    if tokenizer_dir is None:
        return _char_level_tokenizer(special_tokens)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens(special_tokens)  # existing ones keep their ids
    return tok


def _save_weights(model, path: Path, scale: float = 4.0) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # Larger-than-init weights so logits are peaked: greedy choices are far from ties.
    weights = {k: v * scale if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path), weights)


def _save_tokenizer(out_dir: Path, tok, eos: str, pad: str, max_length: int, chat_template: str) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.json (processors read the last)."""
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": "<unk>" if tok.token_to_id("<unk>") is not None else None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}, indent=2))


def _instantiate(arch, config: dict, seed: int):
    """``arch.Model`` built from ``config`` the way ``mlx_vlm.utils.load_model`` does it (root keys
    double as the text config; ``text_config``/``vision_config`` dicts become their dataclasses)."""
    import mlx.core as mx

    params = json.loads(json.dumps(config))  # from_dict mutates its argument
    params.setdefault("text_config", {})
    params.setdefault("vision_config", {})
    model_config = arch.ModelConfig.from_dict(params)
    for name in ("text", "vision", "projector"):
        if isinstance(getattr(model_config, f"{name}_config", None), dict):
            cls = getattr(arch, f"{name.title()}Config")
            setattr(model_config, f"{name}_config", cls.from_dict(params[f"{name}_config"]))
    mx.random.seed(seed)
    return arch.Model(model_config)


def build_tiny_qwen2_vl(
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    *,
    seed: int = 0,
    text_config: dict | None = None,
    vision_config: dict | None = None,
    max_pixels: int = QWEN2_VL_MAX_PIXELS,
    weight_scale: float = 4.0,
) -> Path:
    """A tiny random-weight Qwen2-VL model directory (config, weights, tokenizer, processor).

    ``tokenizer_dir``: None builds a character-level tokenizer here; else a directory with a
    ``tokenizer.json`` (e.g. the default SmolLM2 model's) to add the Qwen special tokens to.
    ``text_config`` / ``vision_config`` override the tiny sizes and ``max_pixels`` the largest
    image area (bench/multimodal.py builds a model of real widths this way, for timing only).
    """
    return _build_qwen_vl(
        Path(out_dir),
        tokenizer_dir,
        seed,
        "qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        {**QWEN2_VL_VISION_CONFIG, **(vision_config or {})},
        text_config=text_config,
        max_pixels=max_pixels,
        weight_scale=weight_scale,
    )


def build_tiny_qwen2_5_vl(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0
) -> Path:
    """A tiny random-weight Qwen2.5-VL model directory; as :func:`build_tiny_qwen2_vl`, with
    the 2.5 vision tower (one windowed and one full-attention block)."""
    return _build_qwen_vl(
        Path(out_dir),
        tokenizer_dir,
        seed,
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        QWEN2_5_VL_VISION_CONFIG,
    )


def _build_qwen_vl(
    out_dir: Path,
    tokenizer_dir: Path | None,
    seed: int,
    model_type: str,
    architecture: str,
    vision_config: dict,
    *,
    text_config: dict | None = None,
    max_pixels: int = QWEN2_VL_MAX_PIXELS,
    weight_scale: float = 4.0,
) -> Path:
    import importlib

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    config = {
        "model_type": model_type,
        "architectures": [architecture],
        **QWEN2_VL_TEXT_CONFIG,
        **(text_config or {}),
        "vocab_size": vocab_size,
        "vision_config": dict(vision_config),
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }

    model = _instantiate(arch, config, seed)
    _save_weights(model, out_dir / "model.safetensors", weight_scale)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", config["max_position_embeddings"], QWEN2_VL_CHAT_TEMPLATE)
    vision = config["vision_config"]
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": QWEN2_VL_MIN_PIXELS,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": QWEN2_VL_MIN_PIXELS, "longest_edge": max_pixels},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    return out_dir


LLAVA_SPECIAL_TOKENS = ["<pad>", "</s>", "<image>"]

# A LLaVA-1.5-style template: "USER: <image>\nDescribe ASSISTANT:" (no BOS; image parts render as
# one <image>, which is expanded to one token per vision patch before the model sees it).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% endif %} "
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# The tiny llama of tiny_model.py (tied embeddings: logits = embeddings x hidden, peaked with
# the scaled weights), with a longer context.
LLAVA_TEXT_CONFIG = {
    **{k: v for k, v in TINY_CONFIG.items() if k != "eos_token_id"},
    "max_position_embeddings": 4096,
}

# CLIP tower: a 28x28 image is 2x2 patches of 14 px (+ a CLS position that the "default" feature
# strategy drops) -> 4 image tokens. Two layers, since features come from layer -2 (with one
# layer that would be the embeddings, and the layer's weights would be unused). The hidden size
# must stay >= patch_size: mlx-vlm's sanitize guesses the conv weight layout from its shape.
LLAVA_VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "image_size": 28,
    "patch_size": 14,
    "projection_dim": 32,
    "num_channels": 3,
    "layer_norm_eps": 1e-5,
}


def build_tiny_llava(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LLaVA (llama text model, CLIP vision tower, 2-layer projector).

    ``tokenizer_dir`` as in :func:`build_tiny_qwen2_vl`. Call the loaded processor without
    ``padding`` (or see :func:`drop_text_kwargs_for_images` for ``mlx_vlm.generate(image=...)``).
    """
    from mlx_vlm.models import llava

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(LLAVA_VISION_CONFIG)
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {**LLAVA_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_index": ids["<image>"],
        "image_seq_length": (vision["image_size"] // vision["patch_size"]) ** 2,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "pad_token_id": ids["<pad>"],
        "eos_token_id": ids["</s>"],
        "tie_word_embeddings": True,
    }
    model = _instantiate(llava, config, seed)
    _save_weights(model, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    _save_tokenizer(out_dir, tok, "</s>", "<pad>", LLAVA_TEXT_CONFIG["max_position_embeddings"], LLAVA_CHAT_TEMPLATE)
    size = vision["image_size"]
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor_config = {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "patch_size": vision["patch_size"],
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,  # the CLS position
    }
    (out_dir / "processor_config.json").write_text(json.dumps(processor_config, indent=2))
    return out_dir


def drop_text_kwargs_for_images(processor):
    """Make ``mlx_vlm.generate(..., image=...)`` work with a LLaVA ``processor`` on transformers 5.

    mlx-vlm's ``process_inputs`` calls ``processor(text=..., images=..., padding=True, ...)`` and its
    ``LlavaProcessor.__call__`` forwards every kwarg to the image processor, whose ``preprocess``
    (transformers 5 validates kwargs against ``ImagesKwargs``) raises ``TypeError:
    ImagesKwargs.__init__() got an unexpected keyword argument 'padding'``. Calling the
    processor without ``padding`` works; this wrapper lets mlx-vlm's own path (the oracle in
    tests) through by dropping the tokenizer-only kwargs before the image processor sees them.
    """
    image_processor = processor.image_processor
    preprocess = image_processor.preprocess

    def preprocess_images_only(images, *args, padding=None, padding_side=None, **kwargs):
        return preprocess(images, *args, **kwargs)

    image_processor.preprocess = preprocess_images_only
    return processor

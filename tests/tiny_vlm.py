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
* :func:`build_tiny_qwen3_vl` / :func:`build_tiny_qwen3_vl_moe`: Qwen3-VL (dense or
  mixture-of-experts text), 16 px patches, deepstack features into text layers 0 and 1.
* :func:`build_tiny_qwen3_5` / :func:`build_tiny_qwen3_5_moe`: Qwen3.5 (dense or MoE text),
  Qwen3-VL's tower without deepstack, a hybrid text model (gated delta-net + full attention).
* :func:`build_tiny_gemma3`: Gemma 3 (SigLIP at 56x56, pooled to 4 tokens per image), text layers
  alternating a sliding window of 8 and global attention; its tokenizer has newline-run tokens.
* :func:`build_tiny_gemma4`: Gemma 4 (its own tower, 16 px patches pooled 3x3: 2 to 4 soft tokens
  per image), a text model with sliding and global layers, KV-sharing layers and per-layer inputs.
* :func:`build_tiny_mistral3`: Mistral 3 (Pixtral at the image's resolution up to 112 px, 2x2
  patch merger, mistral text model): rows of ``[IMG]`` split by ``[IMG_BREAK]``.

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

import dataclasses
import json
from pathlib import Path

from tiny_model import TINY_CONFIG, TINY_LFM2

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


CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _patch_image_processor(kind: str, processor: str, vision: dict, pixels: tuple[int, int], **extra) -> dict:
    """The ``preprocessor_config.json`` of a Qwen2-VL-style image processor (``kind``): images
    resized to ``pixels`` = (min, max) area, cut in patches, merged ``spatial_merge_size`` x 2."""
    return {
        "image_processor_type": kind,
        "processor_class": processor,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        **extra,
    }


HALF = [0.5, 0.5, 0.5]


def qwen_vision_ids(ids: dict[str, int]) -> dict[str, int]:
    """The config's ids of the Qwen-VL vision tokens (``QWEN_SPECIAL_TOKENS``), from ``ids``
    (token -> id)."""
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def square_image_processor(kind: str, size: int, *, resample: int = 3, **extra) -> dict:
    """The ``preprocessor_config.json`` of an image processor that resizes every image to
    ``size`` x ``size`` and normalizes it to [-1, 1] (SigLIP's, Idefics2's, ...): ``extra`` adds
    or overrides keys (``processor_class``, ``do_pad``, ...)."""
    return {
        "image_processor_type": kind,
        "do_resize": True,
        "size": {"height": size, "width": size},
        "resample": resample,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": HALF,
        "image_std": HALF,
        **extra,
    }


# The standalone tokenizer's alphabet: tab, newline and printable ASCII, one token per character.
CHARS = ["\t", "\n", *map(chr, range(32, 127))]


def _char_level_tokenizer(special_tokens: list[str], newline_runs: bool = False):
    """One token per character of :data:`CHARS` (any other character encodes as ``<unk>``, id 0)
    plus ``special_tokens``. Every id decodes to complete text on its own, so random outputs are
    valid strings and streamed text never holds back partial UTF-8.

    ``newline_runs``: also single tokens for runs of 2, 3 and 4 newlines, as Gemma's tokenizer
    has (text around an image placeholder must then be re-tokenized where newlines meet)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{ch: i for i, ch in enumerate(CHARS, start=1)}}
    merges = []
    if newline_runs:
        merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
        vocab.update({"\n" * n: len(vocab) + n - 2 for n in (2, 3, 4)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", *special_tokens])
    return tok


def _make_tokenizer(tokenizer_dir: Path | None, special_tokens: list[str], newline_runs: bool = False):
    from tokenizers import Tokenizer

    if tokenizer_dir is None:
        return _char_level_tokenizer(special_tokens, newline_runs)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens(special_tokens)  # existing ones keep their ids
    return tok


def _save_model(out_dir: Path, model, config: dict, scale: float = 4.0) -> None:
    """The model's weights (scaled: ``_save_weights``) and its ``config.json``."""
    _save_weights(model, out_dir / "model.safetensors", scale)
    _write_json(out_dir / "config.json", config)


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2))


def _save_weights(model, path: Path, scale: float = 4.0) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # Larger-than-init weights so logits are peaked: greedy choices are far from ties. Linear
    # layers are 2-D, and 3-D for mixture-of-experts ("switch_mlp": one matrix per expert).
    def scaled(name: str, value):
        return value * scale if value.ndim == 2 or ".switch_mlp." in name else value

    weights = {k: scaled(k, v) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path), weights)


def _save_tokenizer(
    out_dir: Path, tok, eos: str, pad: str, max_length: int, chat_template: str, extra: dict | None = None
) -> None:
    """tokenizer.json, tokenizer_config.json (plus ``extra`` keys) and chat_template.json
    (processors read the last)."""
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
        **(extra or {}),
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "chat_template.json", {"chat_template": chat_template})


def _instantiate(arch, config: dict, seed: int):
    """``arch.Model`` built from ``config`` the way ``mlx_vlm.utils.load_model`` does it (root keys
    double as the text config; ``text_config``/``vision_config`` dicts become their dataclasses)."""
    import mlx.core as mx

    from mlx_vlm.utils import update_module_configs

    params = json.loads(json.dumps(config))  # from_dict mutates its argument
    params.setdefault("text_config", {})
    params.setdefault("vision_config", {})
    model_config = arch.ModelConfig.from_dict(params)
    modules = ["text", "vision", "perceiver", "projector", "audio"]  # as mlx_vlm.utils.load_model
    model_config = update_module_configs(model_config, arch, params, modules)
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
    _save_model(out_dir, model, config, weight_scale)

    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", config["max_position_embeddings"], QWEN2_VL_CHAT_TEMPLATE)
    vision = config["vision_config"]
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "Qwen2VLProcessor", vision, (QWEN2_VL_MIN_PIXELS, max_pixels), do_resize=True,
        min_pixels=QWEN2_VL_MIN_PIXELS, max_pixels=max_pixels,
    )  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
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
    return _build_llava_layout(out_dir, tokenizer_dir, seed, "llava", "LlavaForConditionalGeneration")


# LLaVA's template with an image part rendered as the bare placeholder (no newline after it), so
# a prompt without one gets exactly the placeholder the family tests write themselves.
LLAVA_BARE_IMAGE_CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE.replace("<image>\n", "<image>")


def _build_llava_layout(
    out_dir: Path,
    tokenizer_dir: Path | None,
    seed: int,
    model_type: str,
    architecture: str,
    *,
    config_extra: dict | None = None,
    preprocessor_extra: dict | None = None,
    processor_extra: dict | None = None,
    processor_class: str = "LlavaProcessor",
    chat_template: str | None = None,
) -> Path:
    """A directory in LLaVA-1.5's layout (llama text model, CLIP tower at 28 px, projector) for
    mlx-vlm's ``model_type`` package; the ``*_extra`` dicts add or override config keys;
    ``chat_template``: LLaVA's unless given."""
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(LLAVA_VISION_CONFIG)
    config = {
        "model_type": model_type,
        "architectures": [architecture],
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
        **(config_extra or {}),
    }
    model = _instantiate(family, config, seed)
    _save_model(out_dir, model, config)

    template = chat_template or LLAVA_CHAT_TEMPLATE
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", LLAVA_TEXT_CONFIG["max_position_embeddings"], template)
    size = vision["image_size"]
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": processor_class,
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
        **(preprocessor_extra or {}),
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {
        "processor_class": processor_class,
        "image_token": "<image>",
        "patch_size": vision["patch_size"],
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,  # the CLS position
        **(processor_extra or {}),
    }
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


def build_tiny_llava_next(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LLaVA-NeXT directory: LLaVA's layout with any-resolution tiles (a
    28 px base view plus up to 2x2 tiles of 28 px, by aspect ratio) and a learned newline."""
    pinpoints = [[28, 28], [28, 56], [56, 28], [56, 56]]
    return _build_llava_layout(
        out_dir, tokenizer_dir, seed, "llava_next", "LlavaNextForConditionalGeneration",
        config_extra={"image_grid_pinpoints": pinpoints},
        preprocessor_extra={"image_processor_type": "LlavaNextImageProcessor", "image_grid_pinpoints": pinpoints,
                            "do_pad": True},
        processor_class="LlavaNextProcessor", chat_template=LLAVA_BARE_IMAGE_CHAT_TEMPLATE,
    )  # fmt: skip


# LLaVA-OneVision: a qwen2 text model and a SigLIP tower at 28 px (2x2 patches of 14 px, all
# kept: 4 tokens per tile); any-resolution tiles up to 56x56 (2x2 tiles), unpadded to the
# image's aspect ratio with a learned newline after each row of the tiles' features.
LLAVA_ONEVISION_TEXT_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

TINY_SIGLIP_VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 28,
    "patch_size": 14,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}


def build_tiny_llava_onevision(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LLaVA-OneVision directory (qwen2 text, SigLIP at 28 px, any-resolution
    tiles up to 2x2 plus the base view: a 100x60 picture is 4 + 2x4 + 2 newlines = 14 tokens)."""
    from mlx_vlm.models import llava_onevision

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, [*LLAVA_SPECIAL_TOKENS, "<video>"])
    ids = {t: tok.token_to_id(t) for t in [*LLAVA_SPECIAL_TOKENS, "<video>"]}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(TINY_SIGLIP_VISION_CONFIG)
    tile = vision["image_size"]
    pinpoints = [[tile, tile], [tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    config = {
        "model_type": "llava_onevision",
        "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "text_config": {**LLAVA_ONEVISION_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_index": ids["<image>"],
        "video_token_index": ids["<video>"],
        "image_grid_pinpoints": pinpoints,
        "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "eos_token_id": ids["</s>"],
        "tie_word_embeddings": True,
    }
    model = _instantiate(llava_onevision, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", 4096, LLAVA_BARE_IMAGE_CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "LlavaOnevisionImageProcessor",
        "processor_class": "LlavaOnevisionProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": tile, "width": tile},
        "image_grid_pinpoints": pinpoints,
        "do_pad": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {
        "processor_class": "LlavaOnevisionProcessor",
        "num_image_tokens": (tile // vision["patch_size"]) ** 2,
        "vision_feature_select_strategy": "full",
        "image_token": "<image>",
        "video_token": "<video>",
    }
    _write_json(out_dir / "processor_config.json", processor_config)
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
    image_processor = getattr(processor, "image_processor", None)
    preprocess = getattr(image_processor, "preprocess", None)
    # mlx-vlm's own processors that transform images themselves (DeepSeek-VL2's) or call their
    # image processor whole (Muse Spark's): nothing to wrap.
    if preprocess is None:
        return processor

    def preprocess_images_only(images, *args, padding=None, padding_side=None, **kwargs):
        return preprocess(images, *args, **kwargs)

    image_processor.preprocess = preprocess_images_only
    return processor


# Qwen3-VL's text model: Qwen3 blocks (q/k RMSNorm) with interleaved multi-axis rotary (the
# three position axes take alternating frequencies instead of contiguous sections). head_dim 16:
# 8 frequencies, split 2/3/3 over (t, h, w).
QWEN3_VL_TEXT_CONFIG = {
    "model_type": "qwen3_vl_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# Qwen3-VL's tower: 16 px patches, learned position embeddings (a 4x4 grid, interpolated to each
# image's grid), 2x2 merge to the text width, and deepstack: the outputs of blocks 0 and 1, each
# merged by its own projector, are added to the hidden states of text layers 0 and 1 at the
# image's positions.
QWEN3_VL_VISION_CONFIG = {
    "model_type": "qwen3_vl",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0, 1],
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}

# Qwen3-VL resizes to multiples of 16 * 2 = 32 px: 64x64 (4 image tokens) up to 128x128 (16).
QWEN3_VL_MIN_PIXELS = 64 * 64
QWEN3_VL_MAX_PIXELS = 128 * 128


# Qwen3-VL-MoE's text model: every layer's MLP is 4 experts, 2 per token.
QWEN3_VL_MOE_TEXT_CONFIG = {
    **QWEN3_VL_TEXT_CONFIG,
    "model_type": "qwen3_vl_moe_text",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
}


# Qwen3.5's text model: gated delta-net (linear attention) layers with a full-attention layer
# every ``full_attention_interval`` (here 2: layers 1 and 3). Its attention layers gate their
# output and rotate only part of each head (real models a quarter; here half of head_dim 32:
# 8 frequencies, 2/3/3 over (t, h, w), interleaved as in Qwen3-VL).
QWEN3_5_TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# Qwen3.5-MoE's text model: every MLP is 4 experts (2 per token) plus a gated shared expert.
QWEN3_5_MOE_TEXT_CONFIG = {
    **QWEN3_5_TEXT_CONFIG,
    "model_type": "qwen3_5_moe_text",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
}


def build_tiny_qwen3_vl(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, moe: bool = False
) -> Path:
    """A tiny random-weight Qwen3-VL directory: 3 text layers, 2 vision blocks, deepstack into
    text layers 0 and 1. A 64x64 picture is 4 image tokens, 100x60 is 6 (96x64 after resizing).
    ``moe``: Qwen3-VL-MoE (mixture-of-experts MLPs, same vision side). ``tokenizer_dir`` as in
    :func:`build_tiny_qwen2_vl`."""
    model_type = "qwen3_vl_moe" if moe else "qwen3_vl"
    architecture = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    text = QWEN3_VL_MOE_TEXT_CONFIG if moe else QWEN3_VL_TEXT_CONFIG
    return _build_qwen3_vl_layout(out_dir, tokenizer_dir, seed, model_type, architecture, text, QWEN3_VL_VISION_CONFIG)


def build_tiny_qwen3_vl_moe(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """:func:`build_tiny_qwen3_vl` with mixture-of-experts text MLPs."""
    return build_tiny_qwen3_vl(out_dir, tokenizer_dir, seed=seed, moe=True)


def build_tiny_qwen3_5(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, moe: bool = False
) -> Path:
    """A tiny random-weight Qwen3.5 VLM directory: Qwen3-VL's tower without deepstack and a
    hybrid text model (gated delta-net layers 0 and 2, full attention 1 and 3). Images take as
    many tokens as in :func:`build_tiny_qwen3_vl`. ``moe``: Qwen3.5-MoE's text model."""
    model_type = "qwen3_5_moe" if moe else "qwen3_5"
    architecture = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    text = QWEN3_5_MOE_TEXT_CONFIG if moe else QWEN3_5_TEXT_CONFIG
    vision = {**QWEN3_VL_VISION_CONFIG, "deepstack_visual_indexes": []}
    return _build_qwen3_vl_layout(out_dir, tokenizer_dir, seed, model_type, architecture, text, vision)


def build_tiny_qwen3_5_moe(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """:func:`build_tiny_qwen3_5` with mixture-of-experts text MLPs (and a shared expert)."""
    return build_tiny_qwen3_5(out_dir, tokenizer_dir, seed=seed, moe=True)


def _build_qwen3_vl_layout(
    out_dir: Path,
    tokenizer_dir: Path | None,
    seed: int,
    model_type: str,
    architecture: str,
    text_config: dict,
    vision_config: dict,
) -> Path:
    """A directory in Qwen3-VL's layout (config, weights, tokenizer, the processor's three
    files) for mlx-vlm's ``model_type`` package."""
    import importlib

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "text_config": {**text_config, "vocab_size": vocab_size},
        "vision_config": {**vision_config, "model_type": model_type},
        "vocab_size": vocab_size,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "tie_word_embeddings": True,
    }
    model = _instantiate(arch, config, seed)
    _save_model(out_dir, model, config)
    max_length = text_config["max_position_embeddings"]
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", max_length, QWEN2_VL_CHAT_TEMPLATE)
    vision = config["vision_config"]
    preprocessor = _patch_image_processor(
        "Qwen2VLImageProcessor", "Qwen3VLProcessor", vision, (QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    # mlx-vlm's Qwen3-VL processor reads all three files and asks the hub for a missing one.
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (out_dir / name).write_text(json.dumps(preprocessor, indent=2))
    _write_json(out_dir / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})
    return out_dir


GEMMA3_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]

# Gemma 3's template, minus the BOS and the system-prompt folding: an image part renders as
# <start_of_image>, which the processor (and the engine) expand to
# "\n\n<start_of_image>" + <image_soft_token> x mm_tokens_per_image + "<end_of_image>\n\n".
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<start_of_image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Gemma 3's text model: 4 layers alternating sliding-window (window 8) and global attention
# (sliding_window_pattern 2: layers 1 and 3 are global), each kind with its own rotary base.
# A window of 8 is shorter than any image prompt here, so the window matters.
GEMMA3_TEXT_CONFIG = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "rms_norm_eps": 1e-6,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "rope_global_base_freq": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "mm_tokens_per_image": 4,
    "max_position_embeddings": 4096,
}

# SigLIP at 56x56: 4x4 patches of 14 px, average-pooled 2x2 by the projector -> 4 image tokens.
GEMMA3_VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 56,
    "patch_size": 14,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
}


def build_tiny_gemma3(
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    *,
    seed: int = 0,
    sliding_window: int = 8,
    weight_scale: float = 0.75,
) -> Path:
    """A tiny random-weight Gemma 3 VLM directory (SigLIP tower, pooled projector, a gemma3
    text model alternating sliding-window and global layers). Every image is 4 tokens between
    ``<start_of_image>`` and ``<end_of_image>``. ``tokenizer_dir`` as in
    :func:`build_tiny_qwen2_vl`.

    Weights are scaled x0.75, not x4: with Gemma's embedding scaling, larger weights saturate
    and every prompt decodes to the same token; at x0.75 greedy choices vary with the image
    and the top two logits stay >= 0.07 apart on the test prompts.

    The root ``hidden_size`` equals the text model's: mlx-vlm divides image features by the
    root one's square root (its default is 2048), the text model multiplies by its own.
    """
    import mlx.core as mx
    from mlx_vlm.models import gemma3

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GEMMA3_SPECIAL_TOKENS, newline_runs=True)
    ids = {t: tok.token_to_id(t) for t in GEMMA3_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {**GEMMA3_TEXT_CONFIG, "vocab_size": vocab_size, "sliding_window": sliding_window}
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(GEMMA3_VISION_CONFIG),
        "vocab_size": vocab_size,
        "hidden_size": text["hidden_size"],
        "mm_tokens_per_image": text["mm_tokens_per_image"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
    }
    model = _instantiate(gemma3, config, seed)
    # The projection starts as all ones: after SigLIP's final LayerNorm (zero-mean rows) every
    # image feature would be ~0, i.e. pure rounding noise. Random, like the other weights.
    projector = model.multi_modal_projector
    shape = projector.mm_input_projection_weight.shape
    projector.mm_input_projection_weight = mx.random.normal(shape) / shape[0] ** 0.5
    _save_model(out_dir, model, config, weight_scale)
    # The Gemma 3 processor reads these names off the tokenizer.
    extra = {
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    }
    max_length = text["max_position_embeddings"]
    _save_tokenizer(out_dir, tok, "<end_of_turn>", "<pad>", max_length, GEMMA3_CHAT_TEMPLATE, extra)
    size = GEMMA3_VISION_CONFIG["image_size"]
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": size, "width": size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": False,
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {"processor_class": "Gemma3Processor", "image_seq_length": text["mm_tokens_per_image"]}
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


GEMMA4_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
]

# Gemma 4's turn markers, minus the BOS and the system/thinking handling: an image part renders
# as <|image|>, which the processor (and the engine) expand to
# "<|image>" + <|image|> x (soft tokens of that image) + "<image|>".
GEMMA4_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|image|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

# Gemma 4's small-model text layout (E2B/E4B): layers 0 and 2 slide (window 8), 1 and 3 attend
# globally with a wider head (global_head_dim 32) and partial "proportional" rotary positions;
# the last two layers (num_kv_shared_layers 2) compute no keys or values of their own but reuse
# those of the last earlier layer of their kind (2 -> 0, 3 -> 1), with double-wide MLPs; every
# layer adds a per-layer input (hidden_size_per_layer_input 8) computed from the token ids (the
# image tokens' from id 0) and the embeddings.
GEMMA4_TEXT_CONFIG = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 8,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "use_bidirectional_attention": None,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    },
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

# Gemma 4's tower: 16 px patches, pooled 3x3 into soft tokens; images resized (aspect kept) to
# at most max_soft_tokens x 9 patches, sides multiples of 48 px: a 64x64 picture is 96x96 (4
# soft tokens), 100x60 is 48x96 (2).
GEMMA4_VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 16,
    "rms_norm_eps": 1e-6,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 64,
    "default_output_length": 4,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
}
GEMMA4_MAX_SOFT_TOKENS = 4


def build_tiny_gemma4(
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    *,
    seed: int = 0,
    weight_scale: float = 1.25,
) -> Path:
    """A tiny random-weight Gemma 4 VLM directory (Gemma 4 vision tower pooled 3x3, a gemma4
    text model with sliding and global layers, KV-sharing layers and per-layer inputs, no audio
    tower). Every image is its soft tokens (2 to 4 here) between ``<|image>`` and ``<image|>``.
    ``tokenizer_dir`` as in :func:`build_tiny_qwen2_vl`.

    Weights are scaled x1.25, not x4 (Gemma's embedding scaling saturates larger weights, as in
    :func:`build_tiny_gemma3`; at x2 every prompt decodes to one token): the seven test prompts
    decode to seven different sequences, and the top two log-probabilities of mlx-vlm's greedy
    steps stay >= 0.05 apart on them (x1: >= 0.0006).
    """
    import mlx.core as mx
    from mlx_vlm.models import gemma4

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GEMMA4_SPECIAL_TOKENS, newline_runs=True)
    ids = {t: tok.token_to_id(t) for t in GEMMA4_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {**GEMMA4_TEXT_CONFIG, "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size,
            "pad_token_id": ids["<pad>"]}  # fmt: skip
    vision = {**GEMMA4_VISION_CONFIG, "default_output_length": GEMMA4_MAX_SOFT_TOKENS}
    config = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "audio_config": None,
        "vocab_size": vocab_size,
        "hidden_size": text["hidden_size"],
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "audio_token_id": ids["<|audio|>"],
        "boa_token_id": ids["<|audio>"],
        "eoa_token_id": ids["<audio|>"],
        "video_token_id": ids["<|video|>"],
        "vision_soft_tokens_per_image": GEMMA4_MAX_SOFT_TOKENS,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"]],
        "tie_word_embeddings": True,
    }
    model = _instantiate(gemma4, config, seed)
    # The patch position table starts as all ones (the same for every patch): random instead.
    embedder = model.vision_tower.patch_embedder
    table = embedder.position_embedding_table
    embedder.position_embedding_table = mx.random.normal(table.shape) * 0.5
    # Zero (tied) embedding rows for the media placeholders: their logit is then 0, below the
    # best of the others, so the model never writes one. mlx-vlm's decode steps would give a
    # written placeholder the per-layer input of its own id, where its prompt path (as Hugging
    # Face's model, and the engine) gives every placeholder that of id 0.
    embed = model.language_model.model.embed_tokens
    media = mx.array([ids["<|image|>"], ids["<|audio|>"], ids["<|video|>"]])
    embed.weight = embed.weight.at[media].multiply(0.0)
    # Per-layer inputs x3: large enough that giving the image positions those of the image
    # token's id instead of id 0's changes the greedy tokens of most test prompts.
    per_layer = model.language_model.model.embed_tokens_per_layer
    per_layer.weight = per_layer.weight * 3.0
    _save_model(out_dir, model, config, weight_scale)
    # The Gemma 4 processor reads these names off the tokenizer.
    extra = {
        "extra_special_tokens": {
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "audio_token": "<|audio|>",
            "video_token": "<|video|>",
        }
    }
    max_length = text["max_position_embeddings"]
    _save_tokenizer(out_dir, tok, "<turn|>", "<pad>", max_length, GEMMA4_CHAT_TEMPLATE, extra)
    image_processor = {
        "image_processor_type": "Gemma4ImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "patch_size": vision["patch_size"],
        "pooling_kernel_size": vision["pooling_kernel_size"],
        "max_soft_tokens": GEMMA4_MAX_SOFT_TOKENS,
    }
    processor_config = {"processor_class": "Gemma4Processor", "image_processor": image_processor}
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


MISTRAL3_SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]

# Mistral's [INST] template; an image part renders as [IMG], which expands to rows of [IMG]
# separated by [IMG_BREAK] and closed by [IMG_END].
MISTRAL3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}[IMG]"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "[/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}"
    "{% endfor %}"
)

MISTRAL3_TEXT_CONFIG = {
    "model_type": "mistral",
    "hidden_size": 64,
    "head_dim": 16,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Pixtral at up to 112 px on the longest edge, 14 px patches, merged 2x2: a 64x64 picture is
# 3x3 tokens (+ 3 separators: 12 ids), 100x60 is 3 rows of 4 (15 ids).
MISTRAL3_VISION_CONFIG = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "head_dim": 16,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "image_size": 112,
    "patch_size": 14,
    "num_channels": 3,
    "rope_theta": 10000.0,
}


def build_tiny_mistral3(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Mistral 3 VLM directory (Pixtral tower at the image's resolution,
    2x2 patch merger, a mistral text model). ``tokenizer_dir`` as in :func:`build_tiny_qwen2_vl`."""
    return _build_pixtral_layout(out_dir, tokenizer_dir, seed, "mistral3", merge=2)


def build_tiny_pixtral(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Pixtral directory: Mistral 3's tower and prompt layout, one token
    per patch (no merger) and a two-layer projector."""
    return _build_pixtral_layout(out_dir, tokenizer_dir, seed, "pixtral", merge=1)


def _build_pixtral_layout(out_dir: Path, tokenizer_dir: Path | None, seed: int, model_type: str, merge: int) -> Path:
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, MISTRAL3_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MISTRAL3_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(MISTRAL3_VISION_CONFIG)
    config = {
        "model_type": model_type,
        "architectures": [f"{'Mistral3' if model_type == 'mistral3' else 'Llava'}ForConditionalGeneration"],
        "text_config": {**MISTRAL3_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_index": ids["[IMG]"],
        "vision_feature_layer": -1,
        "eos_token_id": ids["</s>"],
        **({"spatial_merge_size": merge, "multimodal_projector_bias": False} if merge > 1 else {}),
    }
    model = _instantiate(family, config, seed)
    _save_model(out_dir, model, config)
    max_length = MISTRAL3_TEXT_CONFIG["max_position_embeddings"]
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", max_length, MISTRAL3_CHAT_TEMPLATE)
    patch = vision["patch_size"]
    preprocessor = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": vision["image_size"]},
        "patch_size": {"height": patch, "width": patch},
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {
        "processor_class": "PixtralProcessor",
        "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "patch_size": patch,
        "spatial_merge_size": merge,
    }
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


# SmolVLM's markers: tiles are framed by <fake_token_around_image> and tagged <row_i_col_j>.
SMOLVLM_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<end_of_utterance>",
    "<pad>",
    "<fake_token_around_image>",
    "<global-img>",
    "<image>",
    *[f"<row_{i}_col_{j}>" for i in range(1, 5) for j in range(1, 5)],
]

# SmolVLM's template shape: "<|im_start|>User:<image>Describe.<end_of_utterance>\nAssistant:".
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

SMOLVLM_TEXT_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# 56 px tiles of 14 px patches (16 patches), pixel-shuffled 2x2: 4 tokens per tile. Images are
# resized to at most 112 px, split into up to 2x2 tiles, plus the global view.
SMOLVLM_VISION_CONFIG = {
    "model_type": "smolvlm_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "patch_size": 14,
    "image_size": 56,
    "num_channels": 3,
}


def build_tiny_smolvlm(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight SmolVLM directory (tiles + global view, pixel-shuffle connector,
    llama text model). ``tokenizer_dir`` as in :func:`build_tiny_qwen2_vl`."""
    return _build_idefics3_layout(out_dir, tokenizer_dir, seed, "smolvlm", "SmolVLM")


def build_tiny_idefics3(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Idefics3 directory: SmolVLM's layout under Idefics3's own names
    (mlx-vlm's ``idefics3`` package and transformers' Idefics3 processor)."""
    return _build_idefics3_layout(out_dir, tokenizer_dir, seed, "idefics3", "Idefics3")


def _build_idefics3_layout(out_dir: Path, tokenizer_dir: Path | None, seed: int, model_type: str, name: str) -> Path:
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, SMOLVLM_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in SMOLVLM_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = {**SMOLVLM_VISION_CONFIG, "model_type": f"{model_type}_vision"}
    config = {
        "model_type": model_type,
        "architectures": [f"{name}ForConditionalGeneration"],
        "text_config": {**SMOLVLM_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "scale_factor": 2,
        "image_token_id": ids["<image>"],
        "eos_token_id": ids["<end_of_utterance>"],
    }
    model = _instantiate(family, config, seed)
    _save_model(out_dir, model, config)
    max_length = SMOLVLM_TEXT_CONFIG["max_position_embeddings"]
    _save_tokenizer(out_dir, tok, "<end_of_utterance>", "<pad>", max_length, SMOLVLM_CHAT_TEMPLATE)
    tile = vision["image_size"]
    preprocessor = {
        "image_processor_type": f"{name}ImageProcessor",
        "processor_class": f"{name}Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": 2 * tile},
        "max_image_size": {"longest_edge": tile},
        "do_image_splitting": True,
        "resample": 1,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    tokens_per_tile = (tile // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
    processor_config = {"processor_class": f"{name}Processor", "image_seq_len": tokens_per_tile}
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


AYA_VISION_SPECIAL_TOKENS = [
    "<PAD>", "<EOS>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
    "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>",
]  # fmt: skip

# Aya Vision's turn markers; an image part renders as <image>, which the processor replaces by
# <|START_OF_IMG|>, per tile "TILE_i" + <|IMG_PATCH|> x n, "TILE_GLOBAL" + the thumbnail's, <|END_OF_IMG|>.
AYA_VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|START_OF_TURN_TOKEN|>"
    "{{ '<|USER_TOKEN|>' if message['role'] == 'user' else '<|CHATBOT_TOKEN|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
)

# Cohere 2's text model: layers alternating a sliding window (rotary) and global attention (no
# rotary; pattern 2), logits scaled; SigLIP at 56 px tiles (4x4 patches, pixel-shuffled 2x2 by the SwiGLU
# projector: 4 tokens per tile); images cropped to up to 2 tiles plus a thumbnail.
AYA_VISION_TEXT_CONFIG = {
    "model_type": "cohere2",
    "hidden_size": 64,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "layer_norm_eps": 1e-5,
    "logit_scale": 0.25,
    "sliding_window": 32,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 4096,
}


def build_tiny_aya_vision(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, sliding_window: int = 32
) -> Path:
    """A tiny random-weight Aya Vision directory (SigLIP tiles + thumbnail, pixel-shuffle SwiGLU
    projector, a Cohere 2 text model with a sliding window of 32, shorter than the image prompts).

    Cohere 2's global layers have no rotary positions: with a window much shorter than an image's
    run (36 tokens for 100x60), image tokens mix only with each other before the global layer,
    which then cannot tell the order of two images (the two-image test needs it to)."""
    from mlx_vlm.models import aya_vision

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, AYA_VISION_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in AYA_VISION_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = {**TINY_SIGLIP_VISION_CONFIG, "image_size": 56}
    tile = vision["image_size"]
    config = {
        "model_type": "aya_vision",
        "architectures": ["AyaVisionForConditionalGeneration"],
        "text_config": {**AYA_VISION_TEXT_CONFIG, "vocab_size": vocab_size, "sliding_window": sliding_window},
        "vision_config": vision,
        "image_token_index": ids["<|IMG_PATCH|>"],
        "downsample_factor": 2,
        "alignment_intermediate_size": 128,
        "max_splits_per_img": 2,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
        "eos_token_id": [ids["<EOS>"], ids["<|END_OF_TURN_TOKEN|>"]],
    }
    model = _instantiate(aya_vision, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|END_OF_TURN_TOKEN|>", "<PAD>", 4096, AYA_VISION_CHAT_TEMPLATE)
    preprocessor = {
        "image_processor_type": "GotOcr2ImageProcessor",
        "processor_class": "AyaVisionProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": tile, "width": tile},
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 2,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor_config = {"processor_class": "AyaVisionProcessor", "image_token": "<image>",
                        "patch_size": vision["patch_size"], "img_size": tile, "downsample_factor": 2}  # fmt: skip
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


LFM2_VL_SPECIAL_TOKENS = [
    "<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>", "<|image_end|>",
    "<|img_thumbnail|>", *[f"<|img_row_{i}_col_{j}|>" for i in range(1, 4) for j in range(1, 4)],
]  # fmt: skip

# LFM2-VL: an LFM2 text model (full attention, then a short-convolution layer: the other way
# round, two images swapped give the same greedy tokens on these seeds), a SigLIP2
# NaFlex tower (16 px patches, learned 4x4 position grid resized to the image), pixel-unshuffle
# 2x2 and a projector; images resized to 4-16 tokens, framed by <|image_start|> / <|image_end|>.
LFM2_VL_TEXT_CONFIG = {
    **{k: v for k, v in TINY_LFM2.items() if k != "full_attn_idxs"},
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "layer_types": ["full_attention", "conv"],  # mlx-vlm's LFM2 reads layer_types, not full_attn_idxs
    "tie_word_embeddings": True,
}

LFM2_VL_VISION_CONFIG = {
    "model_type": "lfm2_vl",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_channels": 3,
    "patch_size": 16,
    "num_patches": 16,
}


def build_tiny_lfm2_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight LFM2-VL directory (SigLIP2 NaFlex, pixel unshuffle, LFM2 hybrid text)."""
    from mlx_vlm.models import lfm2_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LFM2_VL_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LFM2_VL_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    image = {"downsample_factor": 2, "encoder_patch_size": 16, "min_image_tokens": 4, "max_image_tokens": 16,
             "tile_size": 64, "max_num_patches": 64, "use_image_special_tokens": True}  # fmt: skip
    config = {
        "model_type": "lfm2_vl",
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "text_config": {**LFM2_VL_TEXT_CONFIG, "vocab_size": vocab_size, "eos_token_id": ids["<|im_end|>"]},
        "vision_config": dict(LFM2_VL_VISION_CONFIG),
        "image_token_id": ids["<image>"],
        "projector_hidden_size": 64,
        "eos_token_id": ids["<|im_end|>"],
        **image,
    }
    model = _instantiate(lfm2_vl, config, seed)
    _save_model(out_dir, model, config)
    template = QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|pad|>", 4096, template)
    preprocessor = {
        "image_processor_type": "Lfm2VlImageProcessor",
        "processor_class": "Lfm2VlProcessor",
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        **image,
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Lfm2VlProcessor"})
    return out_dir


GLM4V_SPECIAL_TOKENS = [
    "<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>",
]  # fmt: skip

# GLM-4.1V's template shape: "<|user|>\n<|begin_of_image|><|image|><|end_of_image|>Describe<|assistant|>\n".
GLM4V_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

GLM4V_TEXT_CONFIG = {
    **TINY_CONFIG,
    "model_type": "glm4v_text",
    "partial_rotary_factor": 0.5,
    # head_dim 16, half of it rotated: 4 frequencies over (temporal, height, width).
    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
    "max_position_embeddings": 4096,
    "attention_bias": True,
}

GLM4V_VISION_CONFIG = {
    "model_type": "glm4v",
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 14,
    "image_size": 56,
    "out_hidden_size": 64,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


GLM4V_MOE_TEXT_CONFIG = {
    "model_type": "glm4v_moe_text", "head_dim": 16, "moe_intermediate_size": 32, "norm_topk_prob": True,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "use_qk_norm": False,
}  # fmt: skip


def build_tiny_glm4v(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight GLM-4.1V directory: Qwen2-VL's patches and merge, a GLM text model
    with partial multi-axis rotary, whose positions mlx-vlm's text model computes itself
    (``get_rope_index``). ``tokenizer_dir`` as in :func:`build_tiny_qwen2_vl`."""
    return _build_glm4v_layout(out_dir, tokenizer_dir, seed, "glm4v", "Glm4vForConditionalGeneration")


def build_tiny_glm4v_moe(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight GLM-4.5V directory: GLM-4.1V's layout, a mixture-of-experts text model."""
    return _build_glm4v_layout(
        out_dir, tokenizer_dir, seed, "glm4v_moe", "Glm4vMoeForConditionalGeneration", GLM4V_MOE_TEXT_CONFIG
    )


def build_tiny_glm_ocr(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight GLM-OCR directory: GLM-4.1V's layout under GLM-OCR's names."""
    text = {"model_type": "glm_ocr_text", "head_dim": 16, "rope_parameters": {
        "rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5, "rope_theta": 10000.0}}  # fmt: skip
    return _build_glm4v_layout(out_dir, tokenizer_dir, seed, "glm_ocr", "GlmOcrForConditionalGeneration", text)


def _build_glm4v_layout(
    out_dir: Path, tokenizer_dir: Path | None, seed: int, model_type: str, architecture: str, text: dict | None = None
) -> Path:
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GLM4V_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in GLM4V_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["<|endoftext|>"], ids["<|user|>"]]
    text_config = {**GLM4V_TEXT_CONFIG, **(text or {}), "vocab_size": vocab_size, "eos_token_id": eos,
                   "pad_token_id": ids["<|endoftext|>"]}  # fmt: skip
    known = {field.name for field in dataclasses.fields(family.TextConfig)}
    config = {
        "model_type": model_type,
        "architectures": [architecture],
        "text_config": {key: value for key, value in text_config.items() if key in known},
        "vision_config": {**GLM4V_VISION_CONFIG, "model_type": model_type},
        "vocab_size": vocab_size,
        "image_token_id": ids["<|image|>"],
        "image_token_index": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "video_token_index": ids["<|video|>"],
        "vision_start_token_id": ids["<|begin_of_image|>"],
        "vision_end_token_id": ids["<|end_of_image|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(family, config, seed)
    _save_model(out_dir, model, config)
    extra = {"image_token": "<|image|>", "video_token": "<|video|>"}
    _save_tokenizer(out_dir, tok, "<|endoftext|>", "<|endoftext|>", 4096, GLM4V_CHAT_TEMPLATE, extra)
    vision = config["vision_config"]
    pixels = (QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS)
    preprocessor = _patch_image_processor("Glm4vImageProcessor", "Glm46VProcessor", vision, pixels, do_resize=True)
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


KIMI_VL_SPECIAL_TOKENS = [
    "[PAD]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
    "<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
]  # fmt: skip

# Kimi-VL's template shape: "<|im_user|>user<|im_middle|>...<|im_end|>"; an image part renders as
# <|media_start|>image<|media_content|><|media_pad|><|media_end|> (the processor repeats <|media_pad|>).
KIMI_VL_IMAGE = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"
KIMI_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_user|>user' if message['role'] == 'user' else '<|im_assistant|>assistant' }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + KIMI_VL_IMAGE +
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# DeepSeek-V3's text model (multi-head latent attention: kv_lora_rank 16, keys of 16 + 8 rotary
# dims, values of 16; a dense layer, then a sigmoid-routed MoE layer with a shared expert).
DEEPSEEK_V3_TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": None,
}


def build_tiny_kimi_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Kimi-VL directory: MoonViT (14 px patches at the image's own size,
    cropped to multiples of 28 px, learned 4x4 positions interpolated, 2-D rotary), 2x2 patch
    merge and projector, a DeepSeek-V3 text model (MLA, MoE). A 100x60 picture: 3x2 = 6 tokens."""
    from mlx_vlm.models import kimi_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, KIMI_VL_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in KIMI_VL_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = {
        "model_type": "moonvit", "depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
        "intermediate_size": 64, "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
        "merge_kernel_size": [2, 2],
    }  # fmt: skip
    eos = [ids["[EOS]"], ids["<|im_end|>"]]
    config = {
        "model_type": "kimi_vl",
        "architectures": ["KimiVLForConditionalGeneration"],
        "text_config": {**DEEPSEEK_V3_TINY_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(kimi_vl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "[PAD]", 4096, KIMI_VL_CHAT_TEMPLATE)
    preprocessor = {"processor_class": "KimiVLProcessor", "image_processor_type": "KimiVLImageProcessor",
                    "patch_size": 14, "merge_kernel_size": [2, 2], "in_token_limit": 256}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


LLAMA4_SPECIAL_TOKENS = [
    "<|finetune_right_pad_id|>", "<|eot|>", "<|header_start|>", "<|header_end|>", "<|image_start|>", "<|image_end|>",
    "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
]  # fmt: skip

# Llama 4's template shape: "<|header_start|>user<|header_end|>\n\n<|image|>Describe<|eot|>"; the
# processor replaces <|image|> by <|image_start|>, the tiles' <|patch|> runs split by the tile
# separators, <|image|>, the global view's <|patch|> run and <|image_end|>.
LLAMA4_CHAT_TEMPLATE = (
    "{% for message in messages %}<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|image|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)

# Llama 4's text model: layers 0-2 chunked attention (rotary, qk norm; chunks of 16 tokens,
# shorter than every image prompt), layer 3 global attention without rotary (temperature
# tuned), a mixture of experts every second layer (one routed expert plus the shared one).
LLAMA4_TEXT_CONFIG = {
    "model_type": "llama4_text",
    "hidden_size": 64,
    "head_dim": 16,
    "intermediate_size": 64,
    "intermediate_size_mlp": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "num_local_experts": 4,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "attention_chunk_size": 16,
    "floor_scale": 8,
    "attn_scale": 0.1,
    "max_position_embeddings": 4096,
}

# Llama 4's vision model at 56 px tiles: 4x4 patches of 14 px (plus a class position, dropped),
# pixel-shuffled 0.5 to 2x2 = 4 tokens per tile; up to 4 tiles plus the global view.
LLAMA4_VISION_CONFIG = {
    "model_type": "llama4_vision_model",
    "hidden_size": 32,
    "intermediate_size": 128,  # = hidden_size / pixel_shuffle_ratio**2: the projector's input
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "image_size": 56,
    "patch_size": 14,
    "num_channels": 3,
    "norm_eps": 1e-5,
    "initializer_range": 0.02,
    "pixel_shuffle_ratio": 0.5,
    "projector_dropout": 0.0,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
    "vision_output_dim": 64,
    "rope_theta": 10000.0,
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
}


def build_tiny_llama4(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Llama 4 directory (tiled vision model with pixel shuffle, a text
    model with chunked attention, a global layer without rotary, and a mixture of experts).

    One 56 px tile per image (``max_patches`` 1): for an image of several tiles mlx-vlm's
    processor writes the global view's ``<|patch|>`` run while its model adds no global view,
    so their counts disagree (the engine then fails that request, saying so)."""
    from mlx_vlm.models import llama4

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAMA4_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAMA4_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["<|eot|>"]]
    text = {**LLAMA4_TEXT_CONFIG, "vocab_size": vocab_size, "eos_token_id": eos,
            "pad_token_id": ids["<|finetune_right_pad_id|>"], "bos_token_id": None}  # fmt: skip
    config = {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(LLAMA4_VISION_CONFIG),
        "image_token_index": ids["<|patch|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(llama4, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|eot|>", "<|finetune_right_pad_id|>", 4096, LLAMA4_CHAT_TEMPLATE)
    tile = LLAMA4_VISION_CONFIG["image_size"]
    preprocessor = {"image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
                    "size": {"height": tile, "width": tile}, "max_patches": 1,
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir

"""Tiny random-weight VLMs of the families whose vision tower mlx-vlm builds at a size no config sets.

Same pattern as tiny_vlm.py (its helpers are reused), plus a *shrink*: the construction parameters
mlx-vlm hard-codes (class constants of its config or tower classes) set small for as long as a
:func:`shrunk_tower` context lasts. The builders here build inside it, and the family tests
(tests/multimodal/test_vlm_families.py) load inside it, so the engine and the mlx-vlm oracle run the
same small model. Only construction parameters change, never forward code; the output widths the
projector expects come from the config as they do for a real checkpoint.

* :func:`build_tiny_fastvlm`: FastVLM (FastViTHD: its stage depths and widths are class constants of
  mlx-vlm's ``VisionConfig``, shrunk to one block a stage, widths 8-32; the tower still downsamples
  64x, so a 128 px image is 2x2 features). Its processor marks an image with the id -200, which the
  model replaces by the image's features (an image the model expands, served as LLaVA-NeXT's).
* :func:`build_tiny_jina_vlm`: Jina VLM (``jvlm``: a SigLIP-style tower, 2x2 attention pooling, a
  Qwen3-style text model with extra embeddings past the vocabulary). Its processor builds its image
  processor with its defaults whatever the directory says (378 px crops, 424+ tokens an image): shrunk
  to one 56 px crop plus the global view, 4x4 patches pooled to 2x2 tokens each, columns closed by
  ``<im_col>``. It writes the real model's token ids (151665-151668, ``<|image|>`` 151940), so the
  vocabulary is pinned at its real size (as dots.ocr's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from tiny_vlm import (
    LLAVA_BARE_IMAGE_CHAT_TEMPLATE,
    LLAVA_SPECIAL_TOKENS,
    LLAVA_TEXT_CONFIG,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)
from tiny_vlm_encdec import nemotron_parse_shrunk
from tiny_vlm_others import _simple_chat_template
from tiny_vlm_phi3v import phi3_v_shrunk
from tiny_vlm_qwen_like import _pinned_tokenizer


@contextmanager
def _class_attributes(owner, **values) -> Iterator[None]:
    """``owner``'s (class or module) attributes set to ``values`` inside the context, restored after it (nesting
    restores each level's own values)."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


# FastViTHD's stages, small: one block each; the attention stages' width a multiple of its MHSA's
# fixed head_dim (32). Its output width is embed_dims[-1] * cls_ratio (2): the config's mm_hidden_size.
FASTVIT_TINY = {
    "layers": [1, 1, 1, 1, 1],
    "embed_dims": [8, 16, 16, 32, 32],
    "mlp_ratios": [2, 2, 2, 2, 2],
}
FASTVIT_TINY_OUT = 64


FASTVIT_CONV_SCALE = 2.25
"""The shrunk FastViTHD's convolutions at their random init shrink the signal, so all images give
nearly the same features (5e-5 apart); at x2.25 an image's features depend on it (~0.7 apart, ~0.5 in
size; x3.4 grows them past 1000)."""


def _tower_convolutions_scaled(model, factor: float):
    """``model`` with its vision tower's convolution kernels (4-D) times ``factor``; the rest is
    scaled by ``_save_model`` as usual."""
    from mlx.utils import tree_flatten, tree_unflatten

    def scaled(name: str, value):
        return value * factor if name.startswith("vision_tower.") and value.ndim == 4 else value

    model.update(tree_unflatten([(k, scaled(k, v)) for k, v in tree_flatten(model.parameters())]))
    return model


def _fastvlm_shrunk():
    from mlx_vlm.models.fastvlm.config import VisionConfig

    return _class_attributes(VisionConfig, **FASTVIT_TINY)


# Jina VLM's processor builds its image processor with its defaults (378 px crops of 14 px patches, up
# to 12 of them, margins of 4 patches), whatever the directory says: 56 px crops (4x4 patches, pooled
# 2x2: 2x2 tokens a crop), at most 2, margins of one patch.
JINA_VLM_TINY_CROP = {"base_input_size": (56, 56), "max_crops": 1, "overlap_margins": (1, 1)}


@contextmanager
def _jina_vlm_shrunk() -> Iterator[None]:
    from mlx_vlm.models.jina_vlm import processing_jinavlm

    small = functools.partial(processing_jinavlm.ImageProcessor, **JINA_VLM_TINY_CROP)
    with _class_attributes(processing_jinavlm, ImageProcessor=small):
        yield


def _gemma3n_shrunk():
    from tiny_vlm_gemma3n import (
        gemma3n_shrunk,  # its own module (tests/tiny_vlm_gemma3n.py)
    )

    return gemma3n_shrunk()


def _deepseekocr_shrunk():
    from tiny_vlm_ocr import (
        _deepseekocr_shrunk as shrunk,  # lazily: it imports this module
    )

    return shrunk()


TOWER_SHRINKS: dict[str, Callable] = {
    "fastvlm": _fastvlm_shrunk,
    "jina_vlm": _jina_vlm_shrunk,
    "gemma3n": _gemma3n_shrunk,
    "phi3_v": phi3_v_shrunk,
    "nemotron_parse": nemotron_parse_shrunk,
    **dict.fromkeys(("deepseekocr", "unlimited_ocr"), _deepseekocr_shrunk),
}
"""Families whose tiny model exists only while its shrink is applied: building and loading both."""


def shrunk_tower(name: str):
    """The context in which ``name``'s tiny model is built and loaded (no-op for other families)."""
    shrink = TOWER_SHRINKS.get(name)
    return shrink() if shrink is not None else nullcontext()


def build_tiny_fastvlm(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight FastVLM directory (module doc): a tiny qwen2 text model at the config's
    root, the shrunk FastViTHD tower at 128 px (2x2 features) and mlx-vlm's own processor."""
    from mlx_vlm.models import fastvlm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, LLAVA_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in LLAVA_SPECIAL_TOKENS}
    size = 128  # the tower downsamples 64x: 2x2 features
    config = {
        "model_type": "fastvlm",
        "architectures": ["LlavaQwen2ForCausalLM"],
        **{k: v for k, v in LLAVA_TEXT_CONFIG.items() if k != "model_type"},
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "vision_config": {"image_size": size},
        "mm_hidden_size": FASTVIT_TINY_OUT,
        "mm_projector_type": "mlp2x_gelu",
        "image_token_index": -200,  # FastVLM's: spliced into the ids by the processor, not a token
        "eos_token_id": ids["</s>"],
    }
    with shrunk_tower("fastvlm"):
        model = _instantiate(fastvlm, config, seed)
    _save_model(out_dir, _tower_convolutions_scaled(model, FASTVIT_CONV_SCALE), config)
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", 4096, LLAVA_BARE_IMAGE_CHAT_TEMPLATE)
    preprocessor = {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


JINA_VLM_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<im_patch>", "<im_start>", "<im_end>",
                           "<im_col>", "<|image|>"]  # fmt: skip
# The ids mlx-vlm's image processor and processor write, whatever the directory says: the image
# markers in the base vocabulary (151936), "<|image|>" among the 128 extra embeddings after it.
JINA_VLM_PINNED = {"<im_patch>": 151665, "<im_start>": 151666, "<im_end>": 151667, "<im_col>": 151668,
                   "<|image|>": 151940}  # fmt: skip
JINA_VLM_VOCAB, JINA_VLM_EXTRA_VOCAB = 151936, 128


def build_tiny_jina_vlm(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Jina VLM directory (module doc): text hidden 32, 2 layers; a 1-layer
    tower of width 32 on the shrunk crops, whose last layer feeds the connector. Embeddings random
    (zeros at init)."""
    import mlx.core as mx
    from mlx_vlm.models import jina_vlm

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _pinned_tokenizer(JINA_VLM_SPECIAL_TOKENS, JINA_VLM_PINNED)
    ids = {t: tok.token_to_id(t) for t in JINA_VLM_SPECIAL_TOKENS}
    # Each size twice: the checkpoint's nested keys (ModelConfig.from_dict) and the dataclass's flat
    # ones (mlx-vlm's load then rebuilds each sub-config from the flat keys alone).
    vision = {
        "hidden_size": 32,
        "n_layers": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "patch_size": 14,
        "input_size": list(JINA_VLM_TINY_CROP["base_input_size"]),
        "image_size": JINA_VLM_TINY_CROP["base_input_size"][0],
        "vit_layers": [-1],
        "output_size": 32,
        "connector_hidden_size": 64,
        "block_config": {"attn_config": {"n_heads": 2, "head_dim": 16}, "ffn_config": {"size": 64}},
        "vl_connector_config": {"pooling_h": 2, "pooling_w": 2, "mlp_projector_config": {"size": 64}},
    }
    text = {"hidden_size": 32, "n_layers": 2, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": JINA_VLM_VOCAB,
            "additional_vocab_size": JINA_VLM_EXTRA_VOCAB,
            "block_config": {"attn_config": {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16},
                             "ffn_config": {"size": 64}}}  # fmt: skip
    eos = ids["<|im_end|>"]
    config = {
        "model_type": "jvlm",
        "text_config": text,
        "vision_config": vision,
        "vocab_size": JINA_VLM_VOCAB,
        "image_token_index": ids["<|image|>"],
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
    }
    with shrunk_tower("jina_vlm"):
        model = _instantiate(jina_vlm, config, seed)
    embedding = model.language_model.embedding  # zeros at init: every token would look alike
    embedding.embedding = mx.random.normal(embedding.embedding.shape) * 0.25
    embedding.new_embedding = mx.random.normal(embedding.new_embedding.shape) * 0.25
    _save_model(out_dir, model, config)
    _save_tokenizer(
        out_dir,
        tok,
        "<|im_end|>",
        "<|endoftext|>",
        8192,
        _simple_chat_template("<|image|>", "<|im_start|>", "<|im_end|>\n"),
    )
    return out_dir

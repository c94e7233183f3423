"""Tiny random-weight Phi-3-vision, whose CLIP tower mlx-vlm builds at a size no config sets.

Same pattern as tiny_vlm.py and tiny_vlm_towers.py (its helpers are reused): the tower's construction
parameters set small inside :func:`phi3_v_shrunk`, which ``tiny_vlm_towers.shrunk_tower("phi3_v")`` opens
for building and for every load in the family tests, so the engine and the mlx-vlm oracle run the same model.

* :func:`build_tiny_phi3_v`: Phi-3-vision / Phi-3.5-vision (``phi3_v``). mlx-vlm builds its tower from a
  class constant (``VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG``: CLIP ViT-L/14-336, 24 layers), shrunk
  to 1 layer with a 64-wide MLP. Its width stays 1024 and its crops 336 px: the forward code writes them as
  literals (``image_dim_out = 1024``, ``img_sizes // 336``, 12x12 merged patches a crop, 144 tokens), so an
  image is 313 tokens at least (one crop plus the global view: ``num_crops`` 1). The features are the
  tower's second-to-last hidden states (with one layer: its patch and position embeddings, normalized).
  Its processor numbers a prompt's images (``<|image_1|>``, ``<|image_2|>``: a number twice raises) and
  writes each image's run as ids -N (the image's number), which the model overwrites with the image's rows:
  the engine serves them as an image the model expands, under an in-vocabulary stand-in (the pad token).
  The text model is Phi-3's, with its su-scaled rotary positions (short and long factors).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from tiny_vlm import _instantiate, _make_tokenizer, _save_model, _save_tokenizer, _write_json
from tiny_vlm_others import _simple_chat_template

PHI3_V_SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]

# CLIP ViT-L/14-336 as mlx-vlm's VisionModel builds it, all but its depth and MLP width: 1024 wide and 336 px
# crops of 14 px patches are literals of its forward code.
PHI3_V_TINY_CLIP = {
    "model_type": "phi3_v",
    "hidden_size": 1024,
    "image_size": 336,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-05,
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 1,
    "patch_size": 14,
}

PHI3_V_HEAD_DIM = 16
PHI3_V_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # Phi-3.5-vision's su-scaled rotary positions (LongRoPE): a factor per rotary frequency pair.
    "rope_scaling": {
        "type": "su",
        "short_factor": [1.0 + 0.05 * i for i in range(PHI3_V_HEAD_DIM // 2)],
        "long_factor": [1.0 + 0.5 * i for i in range(PHI3_V_HEAD_DIM // 2)],
    },
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
}


@contextmanager
def phi3_v_shrunk() -> Iterator[None]:
    """mlx-vlm's Phi-3-vision tower built from ``PHI3_V_TINY_CLIP`` inside the context."""
    from mlx_vlm.models.phi3_v.vision import VisionModel

    saved = VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG
    VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG = SimpleNamespace(**PHI3_V_TINY_CLIP)
    try:
        yield
    finally:
        VisionModel.CLIP_VIT_LARGE_PATCH14_336_CONFIG = saved


def build_tiny_phi3_v(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Phi-3-vision directory (module doc): a phi3 text model of width 64 and 2 layers,
    the shrunk CLIP tower, and mlx-vlm's own processor on one 336 px crop an image (313 tokens)."""
    from mlx_vlm.models import phi3_v

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, PHI3_V_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in PHI3_V_SPECIAL_TOKENS}
    config = {
        "model_type": "phi3_v",
        "architectures": ["Phi3VForCausalLM"],
        **PHI3_V_TEXT_CONFIG,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_token_id": ids["<|end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        # As Phi-3.5-vision's checkpoint names its tower (no vision_config; mlx-vlm reads neither key).
        "img_processor": {"image_dim_out": 1024, "model_name": "openai/clip-vit-large-patch14-336",
                          "name": "clip_vision_model", "num_img_tokens": 144},
        "embd_layer": {"embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp",
                       "use_hd_transform": True, "with_learnable_separator": True},
    }  # fmt: skip
    with phi3_v_shrunk():
        model = _instantiate(phi3_v, config, seed)
    _save_model(out_dir, model, config)
    template = _simple_chat_template("<|image_1|>", "<|", "<|end|>\n")
    _save_tokenizer(out_dir, tok, "<|end|>", "<|endoftext|>", 4096, template)
    _write_json(out_dir / "preprocessor_config.json", {"num_crops": 1, "num_img_tokens": 144})
    return out_dir

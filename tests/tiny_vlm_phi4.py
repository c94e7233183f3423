"""Tiny random-weight Phi-4-SigLIP models (mlx-vlm loads them offline).

As tests/tiny_vlm.py (its helpers build the tokenizer, weights and config files here):

* :func:`build_tiny_phi4_siglip`: Phi-4-reasoning-vision (a SigLIP2 NaFlex tower of width 32 with
  1 layer, a phi3 text model). Its processor (mlx-vlm's ``Phi4SigLipProcessor``) wraps a prompt
  without ``<|im_start|>`` in the chat template, then writes one ``-200`` per ``<image>``; the model
  splices the image's features (one per valid 14 px patch, 16 at most: 15 for a 100x60 picture) in
  its place. mlx-vlm builds the image processor in code, not from ``preprocessor_config.json``: a
  SigLIP2 NaFlex one where ``mm_vision_tower`` says ``naflex`` (patch size and patch budget from
  ``config.json``), else SigLIP's square one, whose pixels this tower (a Linear over flattened
  patches) cannot take. Without torch, transformers' ``Siglip2ImageProcessor`` cannot be imported:
  mlx-vlm then asks ``AutoProcessor`` for the directory's processor, which its own patch routes back
  to ``Phi4SigLipProcessor`` (a few hundred nested loads, ~2 s) until the recursion limit lets
  transformers' own loader answer; ``processor_config.json`` / ``preprocessor_config.json`` make that
  answer a ``Siglip2Processor`` whose image processor is the NaFlex one (the PIL backend).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    HALF,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)
from tiny_vlm_phi_idefics import (
    PHI4_CHAT_TEMPLATE,
    PHI4_SPECIAL_TOKENS,
    PHI4_TEXT_CONFIG,
    PHI4_VISION_CONFIG,
)

# SigLIP2 NaFlex: 14 px patches flattened (3 x 14 x 14 = 588 inputs), 2x2 learned positions
# interpolated to each image's patch grid.
PHI4_SIGLIP_VISION_CONFIG = PHI4_VISION_CONFIG  # Phi-4-multimodal's tiny SigLIP2, as NaFlex patches here
PHI4_SIGLIP_PATCHES = {"min_num_patches": 4, "max_num_patches": 16}
"""An image's patch budget (the real model's: 256 to 3600): 4 to 16 image tokens."""


def build_tiny_phi4_siglip(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Phi-4-SigLIP directory (SigLIP2 NaFlex, a phi3 text model); the processor
    writes one -200 per image, which the model expands into the image's features (module doc)."""
    from mlx_vlm.models import phi4_siglip

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, PHI4_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in PHI4_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = PHI4_SIGLIP_VISION_CONFIG
    config = {
        "model_type": "phi4-siglip",
        "architectures": ["Phi4ForCausalLMV"],
        **PHI4_TEXT_CONFIG,
        "vocab_size": vocab_size,
        "text_config": {**PHI4_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(vision),
        "mm_hidden_size": vision["hidden_size"],
        "mm_vision_tower": f"siglip2-tiny-patch{vision['patch_size']}-naflex",  # "naflex": the NaFlex processor
        **PHI4_SIGLIP_PATCHES,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    model = _instantiate(phi4_siglip, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, PHI4_CHAT_TEMPLATE)
    # What transformers' own loader gives mlx-vlm's fallback without torch (module doc): the same settings
    # as the processor mlx-vlm builds in code.
    preprocessor = {
        "image_processor_type": "Siglip2ImageProcessor",
        "patch_size": vision["patch_size"],
        "max_num_patches": PHI4_SIGLIP_PATCHES["max_num_patches"],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": HALF,
        "image_std": HALF,
    }
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Siglip2Processor"})
    return out_dir

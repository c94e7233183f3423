"""A tiny random-weight Moondream 2 model and the warm Hugging Face hub cache its processor needs.

Built as tests/tiny_vlm.py builds its families (its helpers, weights scaled x4 so greedy logits are
far from ties):

* :func:`build_tiny_moondream2`: Moondream 2 (a SigLIP-style tower on 378 px crops, the global view's
  features beside the local crops' pooled back to its 27x27 grid, projected: 729 tokens an image; the
  processor gives the crop counts and layouts as Python lists, which the model reads as such; a Phi
  text model: partial rotary positions, one LayerNorm feeding attention and MLP in parallel). mlx-vlm's
  ``Moondream2Processor`` is Moondream 3's (the BOS, the image's 729 tokens, then the question in a
  template of its own: it places the image itself) with its tokenizer always loaded from the hub
  repo ``moondream/starmie-v1``, whatever the checkpoint holds (a real one bundles a stale GPT-2
  tokenizer; this one a character-level decoy without Moondream's special tokens, which nothing may
  read). So the builder writes the tokenizer as that repo's snapshot in a hub cache beside the model
  (:func:`hub_cache_of`), and :func:`warm_hub_cache` points the hub at it, offline, while the model is
  loaded and run: the engine and the mlx-vlm oracle read "the hub's" tokenizer from it, as on a
  machine whose cache holds the repo.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tiny_vlm import (
    _char_level_tokenizer,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)
from tiny_vlm_phi_idefics import MOONDREAM_SPECIAL_TOKENS, PHI4_CHAT_TEMPLATE

__all__ = ["build_tiny_moondream2", "hub_cache_of", "warm_hub_cache"]

SNAPSHOT_COMMIT = "0" * 40
"""The commit the cached snapshot claims (``refs/main`` points at it; the hub never sees it offline)."""

# The processor writes 729 image tokens (a 27x27 grid of 14 px patches on a 378 px crop) whatever the
# tower's size, so the crop stays 378 px; its crops are its defaults' whatever the config (up to 12: a
# small image is the global view and one local crop, pooled back to the grid). A tower 32 wide, 1 layer.
MOONDREAM2_VISION_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "patch_size": 14, "crop_size": 378, "proj_inner_dim": 64, "proj_out_dim": 32,
}  # fmt: skip
MOONDREAM2_TEXT_CONFIG = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2,
}  # fmt: skip


def tokenizer_repo() -> str:
    """The hub repo mlx-vlm's Moondream 2 processor loads its tokenizer from (its own constant)."""
    from mlx_vlm.models.moondream2.processing_moondream2 import TOKENIZER_REPO

    return TOKENIZER_REPO


def hub_cache_of(model_dir: Path) -> Path:
    """The hub cache :func:`build_tiny_moondream2` writes beside ``model_dir``."""
    model_dir = Path(model_dir)
    return model_dir.with_name(f"{model_dir.name}-hf-hub")


def build_tiny_moondream2(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Moondream 2 directory (module doc): text hidden 32 and 2 layers, a 1-layer
    tower of width 32 on 378 px crops; its tokenizer in the hub cache :func:`hub_cache_of` names."""
    from mlx_vlm.models import moondream2

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(None, MOONDREAM_SPECIAL_TOKENS)
    eos = tok.token_to_id("<|endoftext|>")
    config = {
        "model_type": "moondream2",
        "architectures": ["HfMoondream"],
        "text_config": {**MOONDREAM2_TEXT_CONFIG, "vocab_size": tok.get_vocab_size(with_added_tokens=True)},
        "vision_config": dict(MOONDREAM2_VISION_CONFIG),
        "eos_token_id": eos,
        "bos_token_id": eos,
    }
    _save_model(out_dir, _instantiate(moondream2, config, seed), config)
    # What the checkpoint bundles, which the processor never reads: a tokenizer without Moondream's tokens.
    _save_tokenizer(out_dir, _char_level_tokenizer([]), "<unk>", "<unk>", 4096, PHI4_CHAT_TEMPLATE)
    _write_hub_snapshot(hub_cache_of(out_dir), tok)
    return out_dir


def _write_hub_snapshot(hub_cache: Path, tok) -> None:
    """``tok`` as the tokenizer repo's snapshot in ``hub_cache``, laid out as the hub's downloads leave it
    (``models--<org>--<name>/refs/main`` naming the snapshot's commit)."""
    from huggingface_hub.file_download import repo_folder_name

    repo = hub_cache / repo_folder_name(repo_id=tokenizer_repo(), repo_type="model")
    snapshot = repo / "snapshots" / SNAPSHOT_COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT_COMMIT)
    _save_tokenizer(snapshot, tok, "<|endoftext|>", "<|endoftext|>", 4096, PHI4_CHAT_TEMPLATE)
    _write_json(snapshot / "config.json", {"model_type": "moondream3"})


@contextmanager
def warm_hub_cache(hub_cache: Path) -> Iterator[None]:
    """The hub's cache at ``hub_cache``, offline, for this process and any it starts: the environment
    (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``), and ``huggingface_hub.constants``, which read it at import
    (transformers and huggingface_hub look the cache and offline mode up there at every call)."""
    from huggingface_hub import constants

    settings = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": True}
    saved_env = {name: os.environ.get(name) for name in settings}
    saved_constants = {name: getattr(constants, name) for name in settings}
    try:
        for name, value in settings.items():
            os.environ[name] = "1" if value is True else value
            setattr(constants, name, value)
        yield
    finally:
        for name, value in saved_constants.items():
            setattr(constants, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

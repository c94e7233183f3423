"""A tiny random-weight llama, saved as an MLX model directory that mlx-lm loads.

It borrows the default model's tokenizer (so prompts and text are real) and has random weights
(hidden size 64, 2 layers): fast enough for many engine tests on the CPU. Outputs are gibberish,
but deterministic, which is all the oracle tests (batched == solo, engine == mlx-lm) need.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}


def build_tiny_llama(out_dir: Path, tokenizer_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny model of ``model_type`` (default llama; any mlx-lm architecture whose args accept
    the llama-style config, e.g. qwen2, mistral)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = {**TINY_CONFIG, **overrides}
    config["vocab_size"] = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger-than-init weights so logits are peaked: greedy choices are far from ties.
    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir

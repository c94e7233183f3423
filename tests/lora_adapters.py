"""LoRA adapters for the tests: random factors written as mlx-lm and PEFT save them."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def write_mlx_lm_adapter(model_dir: Path, out: Path, rank: int, scale: float, seed: int, keys=KEYS,
                         fine_tune_type: str = "lora") -> Path:  # fmt: skip
    """An mlx-lm adapter for ``model_dir`` as ``mlx_lm.lora`` saves one, with random factors
    (mlx-lm starts ``lora_b`` at zero: random here, so that the adapter changes the output).
    DoRA (``fine_tune_type="dora"``): its magnitudes ``m`` start at the base rows' norms, as
    mlx-lm's do, then move by up to 30% so that they matter."""
    import mlx_lm
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_dir))
    num_layers = len(model.layers)
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}
    linear_to_lora_layers(model, num_layers, parameters, use_dora=fine_tune_type == "dora")
    mx.random.seed(seed)
    factors = {}
    for key, value in tree_flatten(model.parameters()):
        if key.endswith(("lora_a", "lora_b")):
            factors[key] = mx.random.normal(value.shape) * 0.05
        elif key.endswith(".m"):
            factors[key] = value * mx.random.uniform(0.7, 1.3, value.shape)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), factors)
    config = {"fine_tune_type": fine_tune_type, "num_layers": num_layers, "model": str(model_dir),
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def as_peft(mlx_adapter: Path, out: Path, alpha: float, base: str = "HuggingFaceTB/tiny") -> Path:
    """The same factors in PEFT's layout, ``lora_alpha`` chosen so that its scale is mlx-lm's."""
    config = json.loads((mlx_adapter / "adapter_config.json").read_text())
    rank = config["lora_parameters"]["rank"]
    weights = mx.load(str(mlx_adapter / "adapters.safetensors"))
    peft = {}
    for key, value in weights.items():
        module, leaf = key.rsplit(".", 1)
        if leaf == "m":  # DoRA's magnitude, as PEFT names it
            peft[f"base_model.model.{module}.lora_magnitude_vector"] = value
        else:
            peft[f"base_model.model.{module}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"] = value.T
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft)
    peft_config = {"r": rank, "lora_alpha": alpha, "bias": "none", "base_model_name_or_path": base,
                   "target_modules": ["q_proj", "v_proj", "down_proj"], "peft_type": "LORA",
                   "use_dora": config["fine_tune_type"] == "dora"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(peft_config))
    return out

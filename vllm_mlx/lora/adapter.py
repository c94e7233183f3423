"""Adapter files read into plain low-rank factors, checked against the base model.

Two formats, told apart by their weights file:

- **mlx-lm** (``mlx_lm.lora`` writes it): ``adapters.safetensors`` with ``<module>.lora_a``
  ``[in, r]`` and ``<module>.lora_b`` ``[r, out]`` (DoRA: also ``<module>.m`` ``[out]``);
  ``adapter_config.json`` with ``fine_tune_type`` (``"lora"`` or ``"dora"``),
  ``lora_parameters`` (``rank``, ``scale``) and ``model`` (the base it was trained on). The
  update is ``scale * (x @ lora_a) @ lora_b``, as mlx-lm's ``LoRALinear`` computes it.
- **PEFT**: ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight``
  ``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` (DoRA, ``use_dora``: also
  ``.lora_magnitude_vector`` ``[out]``); ``adapter_config.json`` with ``r``, ``lora_alpha``
  (scale ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``) and
  ``base_model_name_or_path``. Stored transposed to mlx-lm's layout.

DoRA (both formats) adds a learned magnitude ``m`` per output feature: the layer's output with
the low-rank update, less its bias, is scaled by ``m / ||W + scale * (a @ b)^T||`` (the norm of
each output row of the adapted weight), then the bias is added back: mlx-lm's ``DoRALinear``
and PEFT's ``DoraLinearLayer`` compute the same thing.

Every module an adapter names must be a linear layer of the base model with the adapter's input
and output sizes, and a recorded base model whose name differs from the engine's is refused:
an ``AdapterError`` says which. Not read (refused by name): full fine-tunes, PEFT's per-module
ranks (``rank_pattern``), trained biases and ``modules_to_save``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_PEFT_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\."
    r"(?:lora_(?P<which>[AB])(?:\.default)?\.weight|(?P<magnitude>lora_magnitude_vector)(?:\.default)?(?:\.weight)?)$"
)


class AdapterError(ValueError):
    """An adapter that cannot be used with this base model (unreadable, another model, a kind
    of fine-tune we do not run)."""


@dataclass
class LoRAWeights:
    """One module's low-rank update: ``scale * (x @ a) @ b`` (DoRA: then rescaled, see the module
    docstring)."""

    a: mx.array
    """``[in, r]``"""
    b: mx.array
    """``[r, out]``"""
    scale: float
    magnitude: mx.array | None = None
    """DoRA's learned magnitude ``m`` ``[out]``; None for plain LoRA."""

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass
class Adapter:
    """An adapter's factors by module path (``model.layers.3.self_attn.q_proj``)."""

    path: Path
    format: str
    """``"mlx-lm"`` or ``"peft"``."""
    modules: dict[str, LoRAWeights]
    base_model: str | None = None
    """The base model the adapter records it was trained on, if it does."""
    digest: str = ""
    """SHA-256 of its config and weights files: what the KV it computes depends on (its blocks'
    hashes carry this, not the caller's id, so a later process's id 1 is not this one's)."""

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


def load_adapter(path: str | Path, model: nn.Module, base_model: str | None = None) -> Adapter:
    """Read the adapter in the folder ``path`` and check it against ``model`` (and, when both
    are known, its recorded base model's name against ``base_model``).

    Raises:
        AdapterError: No adapter there, a damaged one, one for another model, or a kind of
            fine-tune that is neither LoRA nor DoRA.
    """
    folder = Path(path).expanduser()
    config = _read_config(folder)
    if (folder / MLX_LM_WEIGHTS).is_file():
        adapter = _mlx_lm_adapter(folder, config)
    elif (folder / PEFT_WEIGHTS).is_file():
        adapter = _peft_adapter(folder, config)
    else:
        raise AdapterError(f"no adapter in {folder}: neither {MLX_LM_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT)")
    if not adapter.modules:
        raise AdapterError(f"the adapter in {folder} holds no LoRA weights")
    adapter.digest = _digest(folder / CONFIG, folder / (MLX_LM_WEIGHTS if adapter.format == "mlx-lm" else PEFT_WEIGHTS))
    _check_base_name(adapter, base_model)
    _check_modules(adapter, model)
    return adapter


def _digest(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"no {CONFIG} in {folder}: not an adapter folder") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / CONFIG} is unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{folder / CONFIG} is not a JSON object")
    return config


def _load_weights(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except Exception as exc:  # truncated or not safetensors
        raise AdapterError(f"{path} is unreadable: {exc}") from None


def _mlx_lm_adapter(folder: Path, config: dict) -> Adapter:
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{folder}: fine_tune_type {kind!r}; only LoRA and DoRA adapters are served (not full)")
    parameters = config.get("lora_parameters") or {}
    scale = parameters.get("scale")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise AdapterError(f"{folder / CONFIG}: lora_parameters.scale is missing or not a number")
    leaves = ("lora_a", "lora_b", "m") if kind == "dora" else ("lora_a", "lora_b")
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in _load_weights(folder / MLX_LM_WEIGHTS).items():
        module, _, leaf = key.rpartition(".")
        if leaf not in leaves:
            raise AdapterError(f"{folder / MLX_LM_WEIGHTS}: {key!r} is not a {kind.upper()} weight (a full layer?)")
        factors.setdefault(module, {})[leaf] = value
    modules = {
        m: _weights(folder, m, f.get("lora_a"), f.get("lora_b"), float(scale), f.get("m"), dora=kind == "dora")
        for m, f in factors.items()
    }
    return Adapter(folder, "mlx-lm", modules, config.get("model"))


def _peft_adapter(folder: Path, config: dict) -> Adapter:
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise AdapterError(f"{folder / CONFIG}: {key} is not supported (plain LoRA adapters only)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder / CONFIG}: trained biases are not supported (LoRA and DoRA adapters only)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"{folder / CONFIG}: r and lora_alpha are required")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in _load_weights(folder / PEFT_WEIGHTS).items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise AdapterError(f"{folder / PEFT_WEIGHTS}: {key!r} is not a LoRA factor")
        if match["magnitude"]:
            factors.setdefault(match["module"], {})["m"] = value
        else:
            factors.setdefault(match["module"], {})[match["which"]] = value.T  # to mlx-lm's layout
    dora = bool(config.get("use_dora"))
    modules = {
        m: _weights(folder, m, f.get("A"), f.get("B"), float(scale), f.get("m"), dora) for m, f in factors.items()
    }
    return Adapter(folder, "peft", modules, config.get("base_model_name_or_path"))


def _weights(
    folder: Path, module: str, a: mx.array | None, b: mx.array | None, scale: float,
    magnitude: mx.array | None = None, dora: bool = False,
) -> LoRAWeights:  # fmt: skip
    if a is None or b is None:
        raise AdapterError(f"{folder}: module {module!r} has only one of its two LoRA factors")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise AdapterError(f"{folder}: module {module!r} has factors {a.shape} and {b.shape}, which do not chain")
    if dora != (magnitude is not None):
        what = "has no DoRA magnitude" if dora else "has a DoRA magnitude, but the adapter is not DoRA"
        raise AdapterError(f"{folder}: module {module!r} {what}")
    if magnitude is not None and magnitude.shape != (b.shape[1],):
        raise AdapterError(f"{folder}: module {module!r} has a magnitude of shape {magnitude.shape}, not ({b.shape[1]},)")
    return LoRAWeights(a, b, scale, magnitude)


def _check_base_name(adapter: Adapter, base_model: str | None) -> None:
    """Refuse an adapter that records another base model (names compared by their last part,
    without case: ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the folder ``smollm2-135m-instruct``)."""
    if adapter.base_model is None or base_model is None:
        return
    theirs, ours = (Path(str(name).rstrip("/")).name.lower() for name in (adapter.base_model, base_model))
    if theirs != ours:
        raise AdapterError(
            f"the adapter in {adapter.path} was trained on {adapter.base_model!r}, not on this model ({base_model!r})"
        )


def _check_modules(adapter: Adapter, model: nn.Module) -> None:
    layers = dict(model.named_modules())
    for name, weights in adapter.modules.items():
        layer = layers.get(name)
        layer = getattr(layer, "base", layer)  # a layer already wrapped for adapters (``batched.py``)
        if layer is None:
            raise AdapterError(f"the adapter in {adapter.path} names {name!r}, which this model does not have")
        dims = linear_dims(layer)
        if dims is None:
            raise AdapterError(f"the adapter in {adapter.path} names {name!r}, which is not a linear layer")
        if dims != (weights.a.shape[0], weights.b.shape[1]):
            raise AdapterError(
                f"the adapter in {adapter.path} is for another model: {name!r} maps {weights.a.shape[0]} -> "
                f"{weights.b.shape[1]} features, this model's {dims[0]} -> {dims[1]}"
            )


def linear_dims(layer: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a linear layer (plain or quantized), else None."""
    if isinstance(layer, nn.QuantizedLinear):
        out_features, packed = layer.weight.shape
        return packed * 32 // layer.bits, out_features
    if isinstance(layer, nn.Linear):
        out_features, in_features = layer.weight.shape
        return in_features, out_features
    return None

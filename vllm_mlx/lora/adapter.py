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
and output sizes, its factors and scale finite, and a recorded base model whose name differs from
the engine's is refused: an ``AdapterError`` says which. Not read (refused by name): full
fine-tunes, PEFT's per-module ranks (``rank_pattern``), trained biases and ``modules_to_save``.

Reading is two steps (``platform/outside_files.py``): ``read_adapter_files`` takes the folder's
two files whole into memory (regular files only, sizes bounded, no MLX: any thread, the engine's
callers do it off the engine thread), and ``load_adapter`` parses those bytes into evaluated
arrays. The digest is of the bytes parsed, and nothing keeps a file open or reads it again: an
adapter re-saved in place later (mlx-lm's trainer does, at each checkpoint) changes nothing
served under the digest already taken.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from vllm_mlx.platform.outside_files import OutsideFileError, read_regular_file, safetensors_header

MLX_LM_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30
"""Without a model to size it by (``LoRASlots.max_adapter_bytes`` does): a generous cap."""
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


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder's two files, read whole: what ``load_adapter`` parses and digests."""

    folder: Path
    config: bytes
    weights_name: str
    """``MLX_LM_WEIGHTS`` or ``PEFT_WEIGHTS``: which format the folder holds."""
    weights: bytes

    @property
    def digest(self) -> str:
        """SHA-256 of the config and the weights, as read."""
        digest = hashlib.sha256(self.config)
        digest.update(self.weights)  # not ``config + weights``: that would copy the weights
        return digest.hexdigest()


def read_adapter_files(
    path: str | Path, max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES, within: Path | None = None
) -> AdapterFiles:
    """Read the adapter folder ``path``'s config and weights whole (no MLX: any thread).

    ``within``: a folder every file must resolve inside (links included), for folders a client
    names; None trusts the caller's path (the operator's, a Python caller's).

    Raises:
        AdapterError: No adapter there, a file that is not a regular file, too large or outside
            ``within``, or a weights file whose header disagrees with its size.
    """
    folder = Path(path).expanduser()
    try:
        config = _read_inside(folder / CONFIG, MAX_CONFIG_BYTES, within)
        weights_name = next((n for n in (MLX_LM_WEIGHTS, PEFT_WEIGHTS) if (folder / n).exists()), None)
        weights = _read_inside(folder / weights_name, max_weights_bytes, within) if weights_name else b""
    except FileNotFoundError as exc:
        raise AdapterError(f"no {Path(exc.filename or CONFIG).name} in {folder}: not an adapter folder") from None
    except (OutsideFileError, OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise AdapterError(f"the adapter in {folder} is unreadable: {exc}") from None
    if weights_name is None:
        raise AdapterError(f"no adapter in {folder}: neither {MLX_LM_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT)")
    return AdapterFiles(folder, config, weights_name, weights)


def _read_inside(path: Path, max_bytes: int, within: Path | None) -> bytes:
    if within is not None and not path.resolve().is_relative_to(within):
        raise OutsideFileError(f"{path.name} links outside the folder adapters are loaded from")
    return read_regular_file(path, max_bytes)


def load_adapter(source: AdapterFiles | str | Path, model: nn.Module, base_model: str | None = None) -> Adapter:
    """Parse an adapter (its files as ``read_adapter_files`` read them, or a folder to read now)
    and check it against ``model`` (and, when both are known, its recorded base model's name
    against ``base_model``). MLX work: on the thread that owns ``model``.

    Raises:
        AdapterError: No adapter there, a damaged one, one for another model, non-finite
            weights, or a kind of fine-tune that is neither LoRA nor DoRA.
    """
    files = source if isinstance(source, AdapterFiles) else read_adapter_files(source)
    config = _parse_config(files)
    if files.weights_name == MLX_LM_WEIGHTS:
        adapter = _mlx_lm_adapter(files, config)
    else:
        adapter = _peft_adapter(files, config)
    if not adapter.modules:
        raise AdapterError(f"the adapter in {files.folder} holds no LoRA weights")
    adapter.digest = files.digest
    _check_finite(adapter)
    _check_base_name(adapter, base_model)
    _check_modules(adapter, model)
    return adapter


def _parse_config(files: AdapterFiles) -> dict:
    where = files.folder / CONFIG
    try:
        config = json.loads(files.config)
    except (ValueError, RecursionError) as exc:
        raise AdapterError(f"{where} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where} is not a JSON object")
    return config


def _load_weights(files: AdapterFiles) -> dict[str, mx.array]:
    """The weights, evaluated now from the bytes read (``mx.load`` is lazy: left so, the data
    would be read at first use, inside a step)."""
    where = files.folder / files.weights_name
    try:
        safetensors_header(files.weights, str(where))
        weights = mx.load(io.BytesIO(files.weights), format="safetensors")
        mx.eval(weights)
    except OutsideFileError as exc:
        raise AdapterError(str(exc)) from None
    except Exception as exc:  # not safetensors after all
        raise AdapterError(f"{where} is unreadable: {exc}") from None
    return weights


def _scale(value, where: str) -> float:
    """A finite float from a config number (a bool, a string, an int too large for a float, an
    infinity: refused)."""
    try:
        scale = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:
        scale = math.inf
    if not math.isfinite(scale):
        raise AdapterError(f"{where} is missing or not a finite number: {str(value)[:40]}")
    return scale


def _mlx_lm_adapter(files: AdapterFiles, config: dict) -> Adapter:
    folder = files.folder
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{folder}: fine_tune_type {kind!r}; only LoRA and DoRA adapters are served (not full)")
    parameters = config.get("lora_parameters") or {}
    if not isinstance(parameters, dict):
        raise AdapterError(f"{folder / CONFIG}: lora_parameters is not an object")
    scale = _scale(parameters.get("scale"), f"{folder / CONFIG}: lora_parameters.scale")
    leaves = ("lora_a", "lora_b", "m") if kind == "dora" else ("lora_a", "lora_b")
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in _load_weights(files).items():
        module, _, leaf = key.rpartition(".")
        if leaf not in leaves:
            raise AdapterError(f"{folder / MLX_LM_WEIGHTS}: {key!r} is not a {kind.upper()} weight (a full layer?)")
        factors.setdefault(module, {})[leaf] = value
    modules = {
        m: _weights(folder, m, f.get("lora_a"), f.get("lora_b"), scale, f.get("m"), dora=kind == "dora")
        for m, f in factors.items()
    }
    return Adapter(folder, "mlx-lm", modules, config.get("model"))


def _peft_adapter(files: AdapterFiles, config: dict) -> Adapter:
    folder = files.folder
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise AdapterError(f"{folder / CONFIG}: {key} is not supported (plain LoRA adapters only)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder / CONFIG}: trained biases are not supported (LoRA and DoRA adapters only)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 1 << 16:
        raise AdapterError(f"{folder / CONFIG}: r is required (an int from 1)")
    alpha = _scale(config.get("lora_alpha"), f"{folder / CONFIG}: lora_alpha")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in _load_weights(files).items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise AdapterError(f"{folder / PEFT_WEIGHTS}: {key!r} is not a LoRA factor")
        if match["magnitude"]:
            factors.setdefault(match["module"], {})["m"] = value
        else:
            factors.setdefault(match["module"], {})[match["which"]] = value.T  # to mlx-lm's layout
    dora = bool(config.get("use_dora"))
    modules = {
        m: _weights(folder, m, f.get("A"), f.get("B"), scale, f.get("m"), dora) for m, f in factors.items()
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


def _check_finite(adapter: Adapter) -> None:
    """Refuse NaN or infinite factors: they would reach every logit of the adapter's rows."""
    for name, weights in adapter.modules.items():
        arrays = [weights.a, weights.b] + ([weights.magnitude] if weights.magnitude is not None else [])
        if not all(mx.all(mx.isfinite(array)).item() for array in arrays):
            raise AdapterError(f"the adapter in {adapter.path} has non-finite weights in {name!r}")


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

"""How much memory a checkpoint's weights take in each weight format, read before loading them.

Only the safetensors headers are read (8 bytes of little-endian header length, then a JSON
object: ``dtype`` and ``shape`` per tensor) and ``config.json``'s ``quantization`` (``bits``,
``group_size``, per-layer overrides). The arithmetic follows what ``prepare_model_weights``
(``platform/cpu_backend.py``) does to the weights:

* ``"quantized"``: the checkpoint as it is, every tensor at its stored size.
* ``"float32"`` / ``"bfloat16"``: a quantized weight (packed ``uint32`` of shape ``(..., o, p)``,
  with ``<name>.scales`` beside it) holds ``o * p * 32 / bits`` logical values, dequantized to 4
  or 2 bytes each; its ``scales`` and ``biases`` disappear; every other floating-point tensor is
  cast to that dtype; integer tensors stay as they are.
* A checkpoint without quantized weights is never changed (``prepare_model_weights`` leaves a
  float model alone), so it takes its stored size in every format.

Plain Python: no MLX, no numpy. Sizes from the files are an upper bound of what the loaded
model holds (a loader may drop a tensor, e.g. a tied output head or rotary tables).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TensorInfo", "WeightSizes", "read_safetensors_header", "weight_sizes"]

# Bytes per element of the safetensors dtypes (the header's "dtype" strings).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
FORMAT_BYTES = {"float32": 4, "bfloat16": 2}
# MLX's dtype names of the safetensors float codes, and back.
_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_DTYPE_CODES = {name: code for code, name in _DTYPE_NAMES.items()}
# A header longer than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class WeightSizes:
    """Bytes of a checkpoint's weights in each weight format (see the module).

    ``float_dtype``: the dtype of the checkpoint's floating-point tensors (the largest group:
    "float32", "float16", "bfloat16", ...), which its activations, and so its KV cache, take when
    run as is."""

    quantized: int
    float32: int
    bfloat16: int
    is_quantized: bool
    float_dtype: str = "bfloat16"

    def bytes_of(self, weight_format: str) -> int:
        """The weights' bytes in ``weight_format`` ("quantized", "float32" or "bfloat16")."""
        return {"quantized": self.quantized, "float32": self.float32, "bfloat16": self.bfloat16}[weight_format]

    def activation_bytes(self, weight_format: str) -> int:
        """Bytes per element of the activations (and KV) when running in ``weight_format``."""
        stored = DTYPE_BYTES[_DTYPE_CODES.get(self.float_dtype, "F32")]
        if not self.is_quantized:
            return stored
        return FORMAT_BYTES.get(weight_format, stored)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a ``.safetensors`` file holds, from its header only (the data is not read).

    Raises:
        ValueError: The file does not start with a safetensors header.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc})") from None
    return {
        name: TensorInfo(entry["dtype"], tuple(entry["shape"]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _quantization(config: dict) -> dict:
    """The config's quantization settings (mlx-lm writes ``quantization``; some copies say
    ``quantization_config``); {} when unquantized."""
    for source in (config, config.get("text_config") or {}):
        for key in ("quantization", "quantization_config"):
            value = source.get(key)
            if isinstance(value, dict):
                return value
    return {}


def _bits(quantization: dict, module: str) -> int:
    """The bits of ``module``'s weight: its per-layer override, else the global setting.

    Overrides are keyed by the module path; a vision-language checkpoint may name it with or
    without a leading ``language_model.`` (mlx-vlm's sanitize adds it), so both are tried."""
    candidates = (module, module.removeprefix("language_model."), module.removeprefix("model."))
    for key in candidates:
        override = quantization.get(key)
        if isinstance(override, dict) and "bits" in override:
            return int(override["bits"])
    return int(quantization.get("bits", 4))


def _tensor_sizes(tensors: dict[str, TensorInfo], quantization: dict) -> tuple[int, int, int, bool]:
    """(stored bytes, float32 bytes, bfloat16 bytes, any quantized weight) of ``tensors``."""
    stored = f32 = bf16 = 0
    quantized_any = False
    companions = {name for name in tensors if name.endswith((".scales", ".biases"))}
    for name, info in tensors.items():
        stored += info.nbytes
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.scales" in tensors and info.dtype in ("U32", "U8"):
            quantized_any = True
            element_bits = DTYPE_BYTES[info.dtype] * 8
            logical = info.numel * element_bits // _bits(quantization, module)
            f32, bf16 = f32 + 4 * logical, bf16 + 2 * logical
        elif name in companions and f"{name.rsplit('.', 1)[0]}.weight" in tensors:
            continue  # scales/biases of a quantized weight: gone once dequantized
        elif info.dtype in FLOAT_DTYPES:
            f32, bf16 = f32 + 4 * info.numel, bf16 + 2 * info.numel
        else:
            f32, bf16 = f32 + info.nbytes, bf16 + info.nbytes
    return stored, f32, bf16, quantized_any


def _float_dtype(tensors: dict[str, TensorInfo]) -> str:
    """The dtype of the largest group of floating-point tensors (by element count)."""
    counts: dict[str, int] = {}
    for info in tensors.values():
        if info.dtype in _DTYPE_NAMES:
            counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    return _DTYPE_NAMES[max(counts, key=counts.get)] if counts else "float32"


def weight_sizes(model_dir: Path | str, config: dict | None = None) -> WeightSizes:
    """The bytes of ``model_dir``'s weights (``*.safetensors``) in each weight format.
    ``config``: its ``config.json`` when the caller has read it already.

    Raises:
        ValueError: The directory holds no safetensors file, or one is not readable as such.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights to size")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        tensors.update(read_safetensors_header(path))
    if config is None:
        from vllm_mlx.models import read_config

        config = read_config(model_dir) or {}
    stored, f32, bf16, quantized = _tensor_sizes(tensors, _quantization(config))
    if not quantized:  # a float checkpoint is never converted: the same bytes in every format
        f32 = bf16 = stored
    return WeightSizes(stored, f32, bf16, quantized, _float_dtype(tensors))

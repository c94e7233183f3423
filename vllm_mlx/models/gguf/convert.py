"""Convert a GGUF file into an MLX model directory that mlx-lm loads as it is.

The steps (DESIGN.md §5 has the facts learned on the default model):

* ``header.open_gguf`` reads the metadata and tensor table with every length checked, and maps
  the file; tensors are converted one at a time (``tensors.convert_tensor``): exactly for the
  affine types, re-quantized to 8 bits for the others, floating point as it is.
* ``architectures`` gives the mlx-lm config and the parameter name of every tensor, and what
  llama.cpp's converter did that must be undone: llama-family Q/K rows are interleaved for GGML's
  RoPE (we gather them back; input-dim group quantization keeps rows independent, so weight,
  scales and biases rows move together); Gemma's norms carry a ``+1``.
* Quantization bits differ per tensor (a Q8_0 embedding beside Q4_K layers), so the config gets
  per-layer overrides of the most common width; groups are always 32.
* On the CPU backend, float16 quantization scales make the quantized matmul ~40x slower than
  float32 ones, so scales and biases are stored in float32 there.
* Tensors stream into ~2 GiB safetensors shards (``ShardWriter``), so a conversion holds one shard,
  never the model; the directory is renamed into place with a manifest recording the source
  file's SHA-256 and architecture only when complete (``store.atomic_directory``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_mlx.models.gguf.architectures import (
    CONFIG_TENSORS,
    Architecture,
    architecture_of,
    base_config,
    rope_config,
)
from vllm_mlx.models.gguf.header import GGUFFile, open_gguf
from vllm_mlx.models.gguf.tensors import GROUP_SIZE, check_supported, convert_tensor, dequantize, quantized_bits
from vllm_mlx.models.gguf.tokenizer import eog_token_ids, write_tokenizer_files
from vllm_mlx.models.store import MANIFEST, atomic_directory, models_dir, write_manifest
from vllm_mlx.platform.errors import ModelSourceError

# Converted weights are written in shards of about this size: the most a conversion holds.
SHARD_BYTES = 2 << 30


def file_sha256(path: Path, chunk_size: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                digest.update(chunk)
    except OSError as exc:
        raise ModelSourceError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def default_scale_dtype() -> str:
    """float16 scales on Metal, float32 on the CPU backend (where float16 ones are ~40x slower)."""
    import mlx.core as mx

    return "float16" if mx.metal.is_available() else "float32"


def unpermute_rope_rows(array, n_heads: int):
    """Undo llama.cpp's per-head interleaving of the rotary halves of Q/K projection rows.

    llama.cpp stores row ``head*d + 2*i + half`` what Hugging Face stores at
    ``head*d + half*d/2 + i``; gather the rows back into that order.
    """
    import mlx.core as mx

    rows = array.shape[0]
    head_dim = rows // n_heads
    half = head_dim // 2
    order = [h * head_dim + 2 * i + j for h in range(n_heads) for j in range(2) for i in range(half)]
    return mx.take(array, mx.array(order), axis=0)


def read_header(path: Path) -> tuple[GGUFFile, Architecture]:
    """The file's header and architecture; every tensor's type and name checked before any is
    converted."""
    gguf = open_gguf(path)
    arch = architecture_of(gguf.metadata)
    for info in gguf.tensors.values():
        check_supported(info.name, info.type_id)
        if info.name not in CONFIG_TENSORS:
            arch.hf_name(info.name)  # a tensor the mlx-lm model has no place for: refused up front
    return gguf, arch


def model_config(gguf: GGUFFile, arch: Architecture) -> dict:
    """The mlx-lm ``config.json`` (without quantization), RoPE scaling tensors folded in."""
    config = base_config(arch, gguf.metadata, gguf.tensors)
    config_tensors = {
        name: dequantize(gguf.tensor_bytes(info), info.type_id, info.shape)
        for name, info in gguf.tensors.items()
        if name in CONFIG_TENSORS
    }
    config.update(rope_config(arch, config, config_tensors))
    # Stop where llama.cpp stops: EOS and the end-of-turn tokens (Gemma's <end_of_turn>, ...).
    stops = eog_token_ids(gguf.metadata)
    if len(stops) > 1:
        config["eos_token_id"] = stops
    return config


def converted_tensors(gguf: GGUFFile, arch: Architecture, config: dict, scale_dtype: str) -> Iterator[tuple[str, dict]]:
    """Every weight tensor as ``(mlx-lm module name, {"weight"|"bias"|"scales"|"biases": array})``,
    one at a time, with llama.cpp's RoPE row order, norm offset, squeezed rows, stacked per-head
    norms and fused q/k/v undone."""
    import mlx.core as mx

    from tqdm.auto import tqdm

    names = [name for name in gguf.tensors if name not in CONFIG_TENSORS]
    for name in tqdm(names, desc="converting", unit="tensor", leave=False):
        info = gguf.tensors[name]
        target = arch.hf_name(name)
        module, part = target.rsplit(".", 1)
        arrays = convert_tensor(name, gguf.tensor_bytes(info), info.type_id, info.shape, scale_dtype)
        if arch.rope_permuted and target.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = config["num_attention_heads" if ".q_proj." in target else "num_key_value_heads"]
            arrays = {key: unpermute_rope_rows(array, heads) for key, array in arrays.items()}
        if arch.norm_offset and arch.is_norm(name):
            arrays["weight"] = arrays["weight"] - arch.norm_offset
        if arch.is_row_vector(name) and arrays["weight"].ndim == 1:  # squeezed by an older converter
            arrays["weight"] = arrays["weight"].reshape(1, -1)
        arrays[part] = arrays.pop("weight")  # a ".bias" tensor is the module's bias
        mx.eval(list(arrays.values()))  # do the work here, so the progress bar measures it
        yield from _modules(arch, name, module, arrays, config)


def _modules(arch: Architecture, name: str, module: str, arrays: dict, config: dict) -> Iterator[tuple[str, dict]]:
    """The mlx-lm modules one converted GGUF tensor fills: one, except a stacked per-head norm (one
    module per head) and a fused q/k/v projection (three; rows are independent under input-dim
    group quantization, so weight, scales and biases split alike)."""
    if arch.is_per_head(name):  # llama.cpp stacked one norm per head; mlx-lm keeps them apart
        for head in range(next(iter(arrays.values())).shape[0]):
            yield f"{module}.norms.{head}", {key: array[head] for key, array in arrays.items()}
    elif arch.is_fused_qkv(name):
        q_rows = config["num_attention_heads"] * config["head_dim"]
        kv_rows = config["num_key_value_heads"] * config["head_dim"]
        attention = module.rsplit(".", 1)[0]
        for proj, start, stop in (("q_proj", 0, q_rows), ("k_proj", q_rows, q_rows + kv_rows),
                                  ("v_proj", q_rows + kv_rows, q_rows + 2 * kv_rows)):  # fmt: skip
            yield f"{attention}.{proj}", {key: array[start:stop] for key, array in arrays.items()}
    else:
        yield module, arrays


class ShardWriter:
    """Writes converted tensors into safetensors shards of about ``shard_bytes``, so that a
    conversion holds one shard in memory, never the whole model. One shard is
    ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` with the index
    Hugging Face and mlx-lm read."""

    def __init__(self, directory: Path, shard_bytes: int | None = None) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes or SHARD_BYTES
        self.pending: dict = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # the tensor names of each written shard

    def add(self, name: str, array) -> None:
        self.pending[name] = array
        self.pending_bytes += array.nbytes
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        import mlx.core as mx

        if not self.pending:
            return
        path = self.directory / f"shard-{len(self.shards):05d}.safetensors"
        try:
            mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        except RuntimeError as exc:  # MLX reports failed writes (EFBIG, ENOSPC) as RuntimeError
            raise OSError(f"cannot write the weights: {exc}") from exc
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        count = len(self.shards)
        names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            (self.directory / f"shard-{i:05d}.safetensors").rename(self.directory / name)
        if count > 1:
            weight_map = {tensor: name for name, tensors in zip(names, self.shards) for tensor in tensors}
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def quantization_config(bits: dict[str, int]) -> dict | None:
    """Groups of 32 everywhere; the most common bit width (``bits``: per quantized module) as
    default, per-layer overrides."""
    if not bits:
        return None
    default_bits = Counter(bits.values()).most_common(1)[0][0]
    config: dict = {"group_size": GROUP_SIZE, "bits": default_bits}
    for module, b in sorted(bits.items()):
        if b != default_bits:
            config[module] = {"group_size": GROUP_SIZE, "bits": b}
    return config


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, scale_dtype: str | None = None, source: str | None = None, digest: str | None = None
) -> Path:
    """Convert ``gguf_path`` into ``out_dir`` atomically; return ``out_dir``. ``digest``: the
    file's SHA-256 when the caller has it already (the manifest records it)."""
    scale_dtype = scale_dtype or default_scale_dtype()
    with _metadata_faults(gguf_path):
        gguf, arch = read_header(gguf_path)
        config = model_config(gguf, arch)
    digest = digest or file_sha256(gguf_path)
    with atomic_directory(out_dir) as tmp:
        with _metadata_faults(gguf_path):  # before the tensors: a bad vocabulary fails in a second, not a minute
            write_tokenizer_files(gguf.metadata, tmp)
        writer, bits = ShardWriter(tmp), {}
        for module, arrays in converted_tensors(gguf, arch, config, scale_dtype):
            if "scales" in arrays:
                bits[module] = quantized_bits(arrays)
            for key, array in arrays.items():
                writer.add(f"{module}.{key}", array)
        writer.finish()
        if quantization := quantization_config(bits):
            config["quantization"] = quantization
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_manifest(tmp, source=source or str(gguf_path), format="gguf", scale_dtype=scale_dtype,
                       source_sha256=digest, architecture=arch.name)  # fmt: skip
    return out_dir


@contextmanager
def _metadata_faults(path: Path) -> Iterator[None]:
    """Metadata of a shape no check foresaw (a string where a number belongs deep in an
    architecture's fields, a vocabulary the tokenizer library rejects) is a one-line
    ``ModelSourceError`` naming the file, never a traceback."""
    try:
        yield
    except ModelSourceError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        raise ModelSourceError(f"{path.name}: malformed GGUF metadata ({type(exc).__name__}: {str(exc)[:200]})") from None
    except Exception as exc:  # the tokenizers library raises plain Exception
        if type(exc).__module__.startswith("tokenizers") or type(exc) is Exception:
            raise ModelSourceError(f"{path.name}: its tokenizer cannot be built ({str(exc)[:200]})") from None
        raise


def resolve_gguf(path: Path) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use (keyed by content)."""
    scale_dtype = default_scale_dtype()
    digest = file_sha256(path)
    out_dir = models_dir() / f"gguf-{path.stem.lower()}-{digest[:12]}-{scale_dtype}"
    if (out_dir / MANIFEST).exists():
        return out_dir
    return convert_gguf(path, out_dir, scale_dtype=scale_dtype, source=str(path.resolve()), digest=digest)

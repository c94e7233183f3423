"""Convert a llama-family GGUF file into an MLX model directory that mlx-lm loads as it is.

What the conversion has to know (see DESIGN.md §5):

* ``mx.load`` reads GGUF natively. Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized
  triples (``weight`` packed uint32, ``scales``, ``biases``; group size 32), which mlx-lm's
  quantized layers take unchanged. Bits differ per tensor (the embedding is often Q8_0 beside
  Q4_1 layers), so the config gets per-layer overrides.
* llama.cpp's converter interleaves the two rotary halves of every Q and K head
  (GGML's RoPE layout). We undo that row permutation so the weights are in the Hugging Face
  layout that mlx-lm's llama (non-traditional RoPE) expects. Input-dim group quantization keeps
  rows independent, so weight, scales and biases rows are permuted together.
* On the CPU backend, float16 quantization scales make the quantized matmul ~40x slower than
  float32 ones, so scales and biases are stored in float32 there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

from vllm_mlx.models.gguf.header import check_gguf_header
from vllm_mlx.models.gguf.tokenizer import write_tokenizer_files
from vllm_mlx.models.store import MANIFEST, atomic_directory, models_dir, write_manifest
from vllm_mlx.platform.errors import ModelSourceError

SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_GROUP_SIZE = 32

# GGUF tensor name -> Hugging Face / mlx-lm llama parameter name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|scales|biases)$")


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


def read_gguf(path: Path) -> tuple[dict, dict]:
    """Load a GGUF file's tensors and metadata, turning every failure into a one-line error."""
    import mlx.core as mx

    check_gguf_header(path)
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelSourceError(f"cannot read GGUF file {path}: {exc}") from exc
    return tensors, {key: _plain(value) for key, value in metadata.items()}


def _plain(value):
    """MLX returns numeric metadata as arrays; everything downstream wants plain Python."""
    return value.tolist() if hasattr(value, "tolist") else value


def hf_config_from_metadata(metadata: dict) -> dict:
    """The mlx-lm/HF ``config.json`` fields of a llama GGUF (without quantization)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelSourceError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def field(name: str, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelSourceError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelSourceError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "num_hidden_layers": int(field("block_count")),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        # GGUF stores float32; round to the decimal it was written from (9.9999997e-06 -> 1e-05).
        "rms_norm_eps": float(f'{field("attention.layer_norm_rms_epsilon", 1e-5):.7g}'),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 2048)),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "rope_traditional": False,
    }


def hf_name(gguf_name: str) -> str:
    match = _TENSOR_RE.match(gguf_name)
    if match is None:
        raise ModelSourceError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    layer, base, part = match.groups()
    table = _LAYER_NAMES if layer is not None else _GLOBAL_NAMES
    if base not in table:
        raise ModelSourceError(f"unsupported tensor {gguf_name!r} (e.g. RoPE frequency scaling)")
    prefix = f"model.layers.{layer}." if layer is not None else ""
    return f"{prefix}{table[base]}.{part}"


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


def convert_tensors(tensors: dict, config: dict, scale_dtype: str) -> tuple[dict, dict | None]:
    """GGUF tensors -> (mlx-lm weights, quantization config or None)."""
    import mlx.core as mx

    from tqdm.auto import tqdm

    weights = {}
    for name, array in tqdm(tensors.items(), desc="converting", unit="tensor", leave=False):
        target = hf_name(name)
        if ".self_attn.q_proj." in target:
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif ".self_attn.k_proj." in target:
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        if target.endswith((".scales", ".biases")):
            array = array.astype(getattr(mx, scale_dtype))
        mx.eval(array)  # do the work here, so the progress bar measures it
        weights[target] = array
    if "lm_head.weight" not in weights:
        config["tie_word_embeddings"] = True
    return weights, quantization_config(weights)


def quantization_config(weights: dict) -> dict | None:
    """Group size 32 everywhere; the most common bit width as default, per-layer overrides."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name.removesuffix(".scales")
            packed = weights[f"{module}.weight"]
            bits[module] = packed.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32
    if not bits:
        return None
    default_bits = Counter(bits.values()).most_common(1)[0][0]
    config: dict = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module, b in sorted(bits.items()):
        if b != default_bits:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": b}
    return config


def convert_gguf(gguf_path: Path, out_dir: Path, *, scale_dtype: str | None = None, source: str | None = None) -> Path:
    """Convert ``gguf_path`` into ``out_dir`` atomically; return ``out_dir``."""
    import mlx.core as mx

    scale_dtype = scale_dtype or default_scale_dtype()
    tensors, metadata = read_gguf(gguf_path)
    config = hf_config_from_metadata(metadata)
    weights, quantization = convert_tensors(tensors, config, scale_dtype)
    if quantization:
        config["quantization"] = quantization
    with atomic_directory(out_dir) as tmp:
        try:
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        except RuntimeError as exc:  # MLX reports failed writes (EFBIG, ENOSPC) as RuntimeError
            raise OSError(f"cannot write model.safetensors: {exc}") from exc
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer_files(metadata, tmp)
        write_manifest(tmp, source=source or str(gguf_path), format="gguf", scale_dtype=scale_dtype)
    return out_dir


def resolve_gguf(path: Path) -> Path:
    """The cached MLX directory for a GGUF file, converting it on first use (keyed by content)."""
    scale_dtype = default_scale_dtype()
    digest = file_sha256(path)
    out_dir = models_dir() / f"gguf-{path.stem.lower()}-{digest[:12]}-{scale_dtype}"
    if (out_dir / MANIFEST).exists():
        return out_dir
    return convert_gguf(path, out_dir, scale_dtype=scale_dtype, source=str(path.resolve()))

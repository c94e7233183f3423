"""An independent numpy llama forward pass over a GGUF file, as llama.cpp runs it.

The oracle for the GGUF conversion tests. It shares nothing with ``vllm_mlx``: the file is read
with gguf-py's ``GGUFReader``, every tensor is dequantized with ``gguf.quants.dequantize``, and
the weights are used exactly as stored. llama.cpp's llama graph applies "normal" RoPE (GGML's
``LLAMA_ROPE_TYPE_NORM``) to the stored Q/K rows, i.e. it rotates *consecutive* pairs
``(x[2i], x[2i+1])`` by ``pos * base**(-2i/d)``. A converter that reorders Q/K rows for the
half-split RoPE of Hugging Face/mlx-lm must reproduce these logits.

Computation is in float64; RMSNorm, grouped-query causal attention, SwiGLU MLP, and the token
embedding as output matrix when the file has no ``output.weight``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


@functools.lru_cache(maxsize=4)
def _load(path: str, _mtime_ns: int, _size: int) -> tuple[dict, dict]:
    reader = GGUFReader(path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    weights = {}
    for tensor in reader.tensors:
        dims = [int(d) for d in tensor.shape]  # GGML order: ne[0] (columns, contiguous) first
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64)
        weights[tensor.name] = array.reshape(tuple(reversed(dims)))  # numpy order: (rows, cols)
    return metadata, weights


def load_gguf(path: str | Path) -> tuple[dict, dict]:
    """(metadata, {tensor name: float64 array in numpy (rows, cols) order}), cached per file."""
    path = os.fspath(path)
    stat = os.stat(path)
    return _load(path, stat.st_mtime_ns, stat.st_size)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_interleaved(x: np.ndarray, base: float, n_rot: int) -> np.ndarray:
    """GGML normal RoPE on ``x`` [T, heads, head_dim]: rotate pairs (2i, 2i+1) of the first n_rot dims."""
    T = x.shape[0]
    i = np.arange(n_rot // 2)
    theta = base ** (-2.0 * i / n_rot)
    angle = np.arange(T)[:, None] * theta[None, :]  # [T, n_rot/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.copy()
    even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = even * cos - odd * sin
    out[..., 1:n_rot:2] = even * sin + odd * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_logits(gguf_path: str | Path, token_ids) -> np.ndarray:
    """Logits [T, vocab] (float64) of a llama GGUF for ``token_ids`` at positions 0..T-1."""
    metadata, w = load_gguf(gguf_path)
    arch = metadata["general.architecture"]
    if arch != "llama":
        raise ValueError(f"reference supports llama only, not {arch!r}")
    hidden = int(metadata[f"{arch}.embedding_length"])
    n_layers = int(metadata[f"{arch}.block_count"])
    n_head = int(metadata[f"{arch}.attention.head_count"])
    n_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_head))
    eps = float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"])
    base = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    head_dim = hidden // n_head
    n_rot = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    vocab = len(metadata["tokenizer.ggml.tokens"])

    embed = w["token_embd.weight"]
    assert embed.shape == (vocab, hidden), embed.shape
    assert w["blk.0.attn_q.weight"].shape == (n_head * head_dim, hidden)
    assert w["blk.0.attn_k.weight"].shape == (n_kv * head_dim, hidden)

    ids = np.asarray(token_ids, dtype=np.int64)
    T = len(ids)
    x = embed[ids]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    group = n_head // n_kv
    for layer in range(n_layers):
        p = f"blk.{layer}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q = (h @ w[p + "attn_q.weight"].T).reshape(T, n_head, head_dim)
        k = (h @ w[p + "attn_k.weight"].T).reshape(T, n_kv, head_dim)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, n_kv, head_dim)
        q, k = rope_interleaved(q, base, n_rot), rope_interleaved(k, base, n_rot)
        k = np.repeat(k, group, axis=1)  # query head j uses kv head j // group, as ggml broadcasts
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, n_head * head_dim)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
        gate = h @ w[p + "ffn_gate.weight"].T
        up = h @ w[p + "ffn_up.weight"].T
        x = x + (silu(gate) * up) @ w[p + "ffn_down.weight"].T
    x = rms_norm(x, w["output_norm.weight"], eps)
    output = w.get("output.weight", embed)
    return x @ output.T

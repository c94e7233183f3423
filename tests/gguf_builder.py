"""Write a tiny random-weight llama GGUF the way llama.cpp's converter lays one out.

Independent of ``vllm_mlx``: only numpy and gguf-py (llama.cpp's own Python writer and
quantizers). Weights are drawn in the Hugging Face layout and then stored as llama.cpp stores
them: Q and K rows permuted for GGML's interleaved RoPE, layer matrices quantized (Q4_1 by
default), the token embedding Q8_0, norms float32. Tests must take their oracle from the file
(``tests/gguf_reference.py``), never from the arrays drawn here.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
# Types gguf-py cannot quantize: their layer matrices are random blocks of the type's layout.
RANDOM_BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL")
# Largest float16 block scale per type: random weights of spread ~0.05, a gain below 1 per layer
# at hidden size 256, so the tiny model does not amplify a lossy type's rounding into its logits.
RANDOM_BLOCK_SCALE = {"Q4_K": 3e-4, "Q5_K": 1.75e-4, "Q6_K": 6e-5, "Q3_K": 1.75e-3, "Q2_K": 6e-3,
                      "IQ4_XS": 7.5e-5, "IQ4_NL": 1.5e-3}  # fmt: skip


# Byte offsets of each block's float16 scale fields (llama.cpp ggml-common.h).
F16_FIELDS = {
    "Q4_K": (0, 2), "Q5_K": (0, 2),  # d, dmin, scales[12], (qh[32],) qs[128]
    "Q2_K": (80, 82),  # scales[16], qs[64], d, dmin
    "Q3_K": (108,),  # hmask[32], qs[64], scales[12], d
    "Q6_K": (208,),  # ql[128], qh[64], scales[16] (int8), d
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),  # d first
    "TQ1_0": (52,),  # qs[48], qh[4], d
    "TQ2_0": (64,),  # qs[64], d
}  # fmt: skip


def sane_f16(rng: np.random.Generator, n: int, high: float = 2e-2) -> np.ndarray:
    return rng.uniform(high / 20, high, n).astype(np.float16)


def random_blocks(kind: str, n_blocks: int, rng: np.random.Generator, d_high: float = 2e-2) -> np.ndarray:
    """``n_blocks`` random blocks of ``kind`` with sane scale fields (float16 scales up to
    ``d_high``): (n_blocks, type_size) bytes, the layouts of llama.cpp's ggml-common.h."""
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(kind, ()):
        blocks[:, offset : offset + 2] = sane_f16(rng, n_blocks, d_high).view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":  # qs[32], qh[16], scales[8]: d's 16 bits are the top nibbles of 4 uint16
        scales = blocks[:, 48:].copy().view(np.uint16)
        d = sane_f16(rng, n_blocks, d_high).view(np.uint16)[:, None]
        nibbles = (d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        blocks[:, 48:] = ((scales & 0x0FFF) | (nibbles << 12)).view(np.uint8)
    if kind == "MXFP4":  # e (E8M0 exponent), qs[16]
        blocks[:, 0] = rng.integers(118, 127, n_blocks)
    if kind == "NVFP4":  # d[4] (UE4M3, one per 16 values), qs[32]
        blocks[:, :4] = rng.integers(0x08, 0x30, (n_blocks, 4))
    return blocks


def bytes_to_unicode() -> list[str]:
    """GPT-2's 256 byte-level symbols, in its canonical order (byte value of the symbol's source)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + n)
            n += 1
    return [chr(c) for c in codes]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = CONTROL_TOKENS + bytes_to_unicode() + [m.replace(" ", "") for m in MERGES]
    n_control = len(CONTROL_TOKENS)
    types = [int(TokenType.CONTROL)] * n_control + [int(TokenType.NORMAL)] * (len(tokens) - n_control)
    assert len(set(tokens)) == len(tokens)
    return tokens, types


def add_tiny_tokenizer(writer: GGUFWriter) -> None:
    """The tiny byte-level BPE vocabulary (SmolLM's pre-tokenizer), its ids and a ChatML template."""
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF rotary-half rows -> GGML interleaved rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _add(writer: GGUFWriter, name: str, array: np.ndarray, qtype: GGMLQuantizationType) -> None:
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype.name in RANDOM_BLOCK_TYPES:  # the drawn values only give the shape: random blocks
        block_size, _ = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        blocks = random_blocks(qtype.name, array.size // block_size, rng, RANDOM_BLOCK_SCALE[qtype.name])
        writer.add_tensor(name, blocks.reshape(array.shape[0], -1), raw_dtype=qtype)
    elif qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        writer.add_tensor(name, quantize(array, qtype))
    else:
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)


def write_tiny_llama_gguf(
    path: str | Path,
    *,
    arch: str = "llama",
    quant: str = "Q4_1",
    seed: int = 0,
    n_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    tied: bool = True,
    qk_std: float = 0.15,
    metadata: dict | None = None,
) -> dict:
    """Write the GGUF at ``path``; return its config numbers.

    ``quant`` is the type of the layer matrices; the embedding (and untied output) is Q8_0 when
    ``quant`` is a quantized type and ``quant`` itself otherwise. Weights are larger than a
    trained model's 0.02 (embedding 0.5, projections 0.2, Q/K ``qk_std``) so that with hidden
    size 64 attention is far from uniform, logits span ~±15 with clear argmax gaps, and a wrong
    RoPE layout moves the logits by about as much as their scale.

    ``metadata``: fields to write instead of the ones made here, by full key (``llama.block_count``);
    None leaves a field out. For files that lie about themselves.
    """
    if quant not in QUANT_TYPES + RANDOM_BLOCK_TYPES:
        raise ValueError(f"quant must be one of {QUANT_TYPES + RANDOM_BLOCK_TYPES}")
    layer_type = GGMLQuantizationType[quant]
    embd_type = layer_type if quant in ("F16", "F32") else GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    tokens, types = tiny_vocab()
    vocab = len(tokens)

    def proj(rows: int, cols: int, std: float = 0.02) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size=n)).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama-test")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(n_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)

    add_tiny_tokenizer(writer)
    writer.add_pad_token_id(2)

    _add(writer, "token_embd.weight", proj(vocab, hidden, 0.5), embd_type)
    for i in range(n_layers):
        p = f"blk.{i}."
        _add(writer, p + "attn_norm.weight", norm(hidden), GGMLQuantizationType.F32)
        q = proj(heads * head_dim, hidden, qk_std)  # Hugging Face row order ...
        k = proj(kv_heads * head_dim, hidden, qk_std)
        _add(writer, p + "attn_q.weight", llama_cpp_permute(q, heads), layer_type)  # ... stored as llama.cpp does
        _add(writer, p + "attn_k.weight", llama_cpp_permute(k, kv_heads), layer_type)
        _add(writer, p + "attn_v.weight", proj(kv_heads * head_dim, hidden, 0.2), layer_type)
        _add(writer, p + "attn_output.weight", proj(hidden, heads * head_dim, 0.2), layer_type)
        _add(writer, p + "ffn_norm.weight", norm(hidden), GGMLQuantizationType.F32)
        _add(writer, p + "ffn_gate.weight", proj(ffn, hidden, 0.2), layer_type)
        _add(writer, p + "ffn_up.weight", proj(ffn, hidden, 0.2), layer_type)
        _add(writer, p + "ffn_down.weight", proj(hidden, ffn, 0.2), layer_type)
    _add(writer, "output_norm.weight", norm(hidden), GGMLQuantizationType.F32)
    if not tied:
        _add(writer, "output.weight", proj(vocab, hidden, 0.5), embd_type)

    for key, value in (metadata or {}).items():
        _override(writer, key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "arch": arch,
        "quant": quant,
        "n_layers": n_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn": ffn,
        "vocab": vocab,
        "tied": tied,
    }


def _override(writer: GGUFWriter, key: str, value) -> None:
    """Replace (or, for None, drop) one metadata field of a file being written."""
    from gguf import GGUFValueType

    writer.kv_data[0].pop(key, None)
    if value is None:
        return
    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_key_value(key, value, GGUFValueType.UINT64 if value >= 1 << 32 else GGUFValueType.UINT32)

"""Tiny random-weight models (llama, and other mlx-lm architectures), saved as MLX model
directories that mlx-lm loads.

They borrow the default model's tokenizer (so prompts and text are real) and has random weights
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


# Sliding-window architectures: window 8 (shorter than most test prompts), both sliding and full
# layers present.
TINY_GEMMA3 = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 2,  # layers 0, 2 sliding; 1, 3 full
}
TINY_GPT_OSS = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "sliding_window": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
# A recurrent hybrid (short convolutions + attention): ArraysCache layers.
TINY_LFM2 = {
    "model_type": "lfm2",
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_ff_dim": 128,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "full_attn_idxs": [1],
}
# Gated delta-net linear attention + full attention (layers 1, 3 full): ArraysCache(size=2).
TINY_QWEN3_5 = {
    "model_type": "qwen3_5",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.5,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "moe_intermediate_size": 64,
    "mlp_only_layers": [],
}
# Mamba-2 + attention hybrids: ArraysCache(size=2) (conv state, SSM state).
_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1}
TINY_GRANITE_HYBRID = {
    "model_type": "granitemoehybrid",
    "num_hidden_layers": 4,
    "attention_bias": False,
    "embedding_multiplier": 1.0,
    "attention_multiplier": 0.25,
    "logits_scaling": 1.0,
    "residual_multiplier": 1.0,
    "layer_types": ["mamba", "attention", "mamba", "attention"],
    "mamba_proj_bias": False,
    "mamba_conv_bias": True,
    "shared_intermediate_size": 128,
    "position_embedding_type": "rope",
    **_MAMBA2,
}
TINY_NEMOTRON_H = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "attention_bias": False,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "n_groups": 1,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hybrid_override_pattern": ["M", "*", "M", "-"],
}


def build_tiny_llama(
    out_dir: Path, tokenizer_dir: Path, *, seed: int = 0, likely_tokens: range | None = None, **overrides
) -> Path:
    """A tiny model of ``model_type`` (default llama; any mlx-lm architecture whose args accept
    the llama-style config plus ``overrides``, e.g. qwen2, mistral, ``**TINY_GEMMA3``).

    Attention sinks (gpt-oss), zero at init, get random values so that they matter.
    ``likely_tokens``: only these token ids keep full-size embedding and output rows (the others
    are scaled down 100 times), so the model's text draws from a few tokens and repeats itself,
    as speculative decoding's n-gram tests need."""
    import importlib

    import mlx.core as mx

    config = {**TINY_CONFIG, **overrides}
    config["vocab_size"] = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = peaked_weights(model)
    if likely_tokens is not None:
        ids = mx.arange(config["vocab_size"])
        rows = ((ids >= likely_tokens.start) & (ids < likely_tokens.stop))[:, None]
        weights |= {
            k: mx.where(rows, v, v * 0.01) for k, v in weights.items()
            if k.endswith(("embed_tokens.weight", "lm_head.weight", "embeddings.weight"))
        }  # fmt: skip
    save_model_dir(out_dir, config, weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def peaked_weights(model) -> dict:
    """``model``'s parameters with matrices scaled 4x, so logits are peaked and greedy choices
    far from ties; attention sinks (gpt-oss), zero at init, get random values so they matter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    return weights | {k: mx.random.normal(v.shape) for k, v in weights.items() if k.endswith(".sinks")}


def save_model_dir(out_dir: Path, config: dict, weights: dict) -> None:
    """The weights and ``config.json`` of a model directory mlx-lm loads (its tokenizer is the
    caller's to write)."""
    import mlx.core as mx

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def build_tiny_architecture(out_dir: Path, name: str, seed: int = 0) -> Path:
    """A tiny random model of mlx-lm's ``name`` module, from the config the support probe builds
    out of the module's own ``ModelArgs`` (``vllm_mlx.models.probe.build_tiny_model``: no
    hand-written config). Its vocabulary is 128 tokens, a character-level tokenizer's (end of
    turn ``<|im_end|>``, id 98, the EOS; every other id decodes too): prompts are token ids below
    128. A tokenizer this small loads in milliseconds, where the default model's takes 0.4 s."""
    import importlib

    import mlx.core as mx
    from tiny_vlm import _char_level_tokenizer, _save_tokenizer

    from vllm_mlx.models.probe import PROBE_CONFIG, build_tiny_model, stand_in_for_import_gate

    mx.random.seed(seed)
    with stand_in_for_import_gate(name):  # OLMo's module, once imported, stays so for mlx-lm's load
        module = importlib.import_module(f"mlx_lm.models.{name}")
    tiny = build_tiny_model(module, name)
    weights = peaked_weights(tiny.model)
    # Packed weights, zeros at init: BitNet's ternary bytes get random values -1, 0, 1; a 2-bit
    # quantized layer's words (PRISM's Hadamard pack) random bits.
    packed = {k: v.shape for k, v in weights.items() if v.dtype in (mx.uint8, mx.uint32)}
    words = {k: mx.random.randint(0, 2**31, shape).astype(mx.uint32) for k, shape in packed.items()}
    weights |= {k: random_ternary_bytes(v) if weights[k].dtype == mx.uint8 else words[k] for k, v in packed.items()}
    # A matrix initialised to zeros (Talkie's output head) would make every prompt's answer the same.
    zeros = [k for k, v in weights.items() if v.ndim == 2 and k not in packed and not mx.any(v).item()]
    weights |= {k: mx.random.normal(weights[k].shape) * 4 / weights[k].shape[-1] ** 0.5 for k in zeros}
    save_model_dir(out_dir, tiny.config, weights)
    tok = _char_level_tokenizer(["<|im_end|>"])
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(PROBE_CONFIG["vocab_size"] - tok.get_vocab_size())])
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<unk>", 256, TINY_CHAT_TEMPLATE)
    return out_dir


def random_ternary_bytes(shape: tuple[int, ...]):
    """Packed ternary weights as BitNet stores them: four 2-bit codes a byte, each 0, 1 or 2
    (the values -1, 0, 1 plus one)."""
    import mlx.core as mx

    codes = mx.random.randint(0, 3, (4, *shape)).astype(mx.uint8)
    return sum((codes[i] << (2 * i) for i in range(1, 4)), codes[0]).astype(mx.uint8)


TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}<|im_end|>{% endfor %}"


def build_tiny_quantized(
    out_dir: Path, tokenizer_dir: Path, *, bits: int = 4, group_size: int = 32, layer_bits: dict | None = None,
    seed: int = 0, **overrides,
) -> Path:
    """The tiny model of ``build_tiny_llama``, stored as mlx-lm stores a quantized checkpoint: a
    bfloat16 model (as most published ones are) whose linear layers and embedding are quantized
    (packed uint32 weights with ``.scales``/``.biases``; ``config.json``'s ``quantization``).
    ``layer_bits``: per-layer overrides (module path -> bits), written as mlx-lm writes them."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten

    float_dir = build_tiny_llama(out_dir.parent / f"{out_dir.name}-float", tokenizer_dir, seed=seed, **overrides)
    model, _ = mlx_lm.load(str(float_dir))
    model.set_dtype(mx.bfloat16)
    layer_bits = layer_bits or {}

    def settings(path: str, module) -> dict | bool:
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": group_size, "bits": layer_bits.get(path, bits)}

    nn.quantize(model, class_predicate=settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((float_dir / "config.json").read_text())
    quantization = {"group_size": group_size, "bits": bits}
    quantization |= {path: {"group_size": group_size, "bits": b} for path, b in layer_bits.items()}
    config["quantization"] = quantization
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir

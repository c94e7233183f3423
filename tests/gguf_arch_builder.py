"""Write a tiny mlx-lm model of any supported architecture as llama.cpp's converter would.

Independent of ``vllm_mlx``: the GGUF tensor names come from gguf-py's ``TensorNameMap`` (the
table llama.cpp's converter itself uses), the metadata from gguf-py's ``GGUFWriter``, and the
transformations the converter applies are written out here from its source: llama-family Q/K
rows interleaved for GGML's RoPE (llama, granite, granitemoe, smollm3: ``LLAMA_ROPE_TYPE_NORM``),
Gemma norms stored as ``w + 1``, granitemoe's fused expert gate+up split into two tensors,
StableLM's per-head norms stacked, 2023's fused Phi-2 ``Wqkv``, and the squeeze every tensor went
through in converters before mid-2024. The model the file was written from is the oracle: a
correct conversion loads back into mlx-lm with the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from gguf.tensor_mapping import get_tensor_name_map
from gguf_builder import add_tiny_tokenizer, llama_cpp_permute, tiny_vocab
from mlx.utils import tree_flatten

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2


@dataclass
class ArchCase:
    """One architecture: its GGUF name, the mlx-lm config of the tiny model, and metadata
    llama.cpp writes for it beyond the common keys."""

    gguf_arch: str
    config: dict
    extra_metadata: dict = field(default_factory=dict)
    rope_permuted: bool = False
    norm_offset: float = 0.0
    rope_base_written: bool = True  # Gemma 1's converter writes no rope.freq_base
    squeezed: bool = False  # converters before mid-2024: ``data_torch.squeeze()`` on every tensor
    fused_qkv: bool = False  # Phi-2 as published in 2023: one ``mixer.Wqkv`` (q, k, v rows)


def _common(model_type: str, drop: tuple[str, ...] = (), **more) -> dict:
    """The tiny config; ``drop``: keys the Hugging Face config of the architecture does not have
    (so the converter writes no metadata for them: no ``head_dim``, no ``key_length``)."""
    vocab = len(tiny_vocab()[0])
    config = {
        "model_type": model_type, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": True, **more,
    }  # fmt: skip
    return {k: v for k, v in config.items() if k not in drop}


_QWEN2MOE = _common("qwen2_moe", drop=("head_dim",), tie_word_embeddings=False, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)


def _stablelm(**more) -> dict:
    return _common("stablelm", drop=("head_dim", "rms_norm_eps"), tie_word_embeddings=False,
                   partial_rotary_factor=0.25, layer_norm_eps=1e-5, **more)  # fmt: skip


_GRANITE_SCALES = {"logit_scale": 4.0, "attention.scale": 0.2, "embedding_scale": 6.0, "residual_scale": 0.5}


CASES = {
    "llama": ArchCase("llama", _common("llama"), rope_permuted=True),
    "llama-untied": ArchCase("llama", _common("llama", tie_word_embeddings=False), rope_permuted=True),
    "qwen2": ArchCase("qwen2", _common("qwen2")),
    "qwen3": ArchCase("qwen3", _common("qwen3", tie_word_embeddings=False)),
    "qwen3moe": ArchCase(
        "qwen3moe",
        _common("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32},
    ),
    "gemma2": ArchCase(
        "gemma2",
        _common("gemma2", query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
        {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0, "attention.sliding_window": 4096},
        norm_offset=1.0,
    ),
    "gemma3": ArchCase(
        "gemma3",
        _common("gemma3_text", num_hidden_layers=6, query_pre_attn_scalar=HEAD_DIM, sliding_window=4,
                sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0),
        {"attention.sliding_window": 4},
        norm_offset=1.0,
    ),
    "phi3": ArchCase("phi3", _common("phi3", tie_word_embeddings=False)),
    # Phi-2: no GQA, feed_forward_length = 4 * hidden, no rope.freq_base, partial RoPE.
    "phi2": ArchCase(
        "phi2",
        _common("phi", drop=("head_dim", "rms_norm_eps"), num_key_value_heads=HEADS, intermediate_size=4 * HIDDEN,
                partial_rotary_factor=0.5, layer_norm_eps=1e-5),
        {"rope.dimension_count": 8}, rope_base_written=False,
    ),
    "phi2-2023": ArchCase(
        "phi2",
        _common("phi", drop=("head_dim", "rms_norm_eps"), num_key_value_heads=HEADS, intermediate_size=4 * HIDDEN,
                partial_rotary_factor=0.5, layer_norm_eps=1e-5),
        {"rope.dimension_count": 8}, rope_base_written=False, squeezed=True, fused_qkv=True,
    ),
    "gemma": ArchCase("gemma", _common("gemma"), norm_offset=1.0, rope_base_written=False),
    "qwen2moe": ArchCase(
        "qwen2moe", _QWEN2MOE,
        {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
         "expert_shared_feed_forward_length": 64},
    ),
    # A 2024 file: no expert sizes in the metadata, the shared-expert gate squeezed to 1-D.
    "qwen2moe-2024": ArchCase("qwen2moe", _QWEN2MOE, {"expert_count": 4, "expert_used_count": 2}, squeezed=True),
    "olmo2": ArchCase("olmo2", _common("olmo2", drop=("head_dim",), tie_word_embeddings=False)),
    # The converter overwrites the RMS epsilon with 1e-5 and writes no expert width beyond
    # feed_forward_length (the experts' width in OLMoE).
    "olmoe": ArchCase(
        "olmoe",
        _common("olmoe", drop=("head_dim",), intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=False, tie_word_embeddings=False),
        {"expert_count": 4, "expert_used_count": 2},
    ),
    "granitemoe": ArchCase(
        "granitemoe",
        _common("granitemoe", drop=("head_dim",), intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                logits_scaling=4.0, attention_multiplier=0.2, embedding_multiplier=6.0, residual_multiplier=0.5,
                attention_bias=False),
        {"expert_count": 4, "expert_used_count": 2, **_GRANITE_SCALES},
        rope_permuted=True,
    ),
    # StableLM 2 1.6B (q/k/v bias, sequential residual) and 12B (per-head q/k LayerNorms, parallel
    # residual); the converter writes no rope.freq_base, and rope.dimension_count for the partial RoPE.
    "stablelm": ArchCase(
        "stablelm", _stablelm(use_qkv_bias=True, use_parallel_residual=False),
        {"rope.dimension_count": 4, "use_parallel_residual": False}, rope_base_written=False,
    ),
    "stablelm-qknorm": ArchCase(
        "stablelm", _stablelm(use_qkv_bias=False, use_parallel_residual=True, qk_layernorm=True),
        {"rope.dimension_count": 4, "use_parallel_residual": True}, rope_base_written=False,
    ),
    # LLAMA_ROPE_TYPE_NORM, yet not permuted: ERNIE's own rotary is interleaved already.
    "ernie4_5": ArchCase("ernie4_5", _common("ernie4_5", use_bias=False)),
    # Four layers, so that one (the fourth) runs without RoPE; Q/K permuted as for llama.
    "smollm3": ArchCase("smollm3", _common("smollm3", num_hidden_layers=4), rope_permuted=True),
    "starcoder2": ArchCase("starcoder2", _common("starcoder2", drop=("head_dim", "rms_norm_eps"), norm_epsilon=1e-5)),
    "granite": ArchCase(
        "granite",
        _common("granite", logits_scaling=4.0, attention_multiplier=0.2, embedding_multiplier=6.0,
                residual_multiplier=0.5, attention_bias=False, mlp_bias=False),
        _GRANITE_SCALES,
        rope_permuted=True,
    ),
}


def build_model(case: ArchCase, seed: int = 0):
    """The tiny mlx-lm model, weights drawn large enough that attention and logits are far from
    uniform (so a wrong name, offset or row order moves the logits by about their scale)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(case.config)
    model = model_class(args_class.from_dict(case.config))
    rng = np.random.default_rng(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight") or ".norms." in name:
            drawn = (0.1 if case.norm_offset else 1.0) + rng.normal(0, 0.1, value.shape)
        else:
            drawn = rng.normal(0, 0.5 if "embed" in name or "lm_head" in name else 0.2, value.shape)
        params.append((name, mx.array(drawn.astype(np.float32))))
    model.load_weights(params)
    return model


def _granitemoe_expert_name(name_map, module: str) -> str:
    """Hugging Face's granitemoe fuses the experts' gate and up into ``input_linear``; the
    converter splits it and names the halves itself (``format_tensor_name``). mlx-lm has the
    halves already, so splitting the concatenation again is the identity."""
    layer, proj = int(module.split(".")[2]), module.rsplit(".", 1)[1]
    if proj == "down_proj":
        return name_map.get_name(f"model.layers.{layer}.block_sparse_moe.output_linear")
    kind = MODEL_TENSOR.FFN_GATE_EXP if proj == "gate_proj" else MODEL_TENSOR.FFN_UP_EXP
    return TENSOR_NAMES[kind].format(bid=layer)


def _gguf_name(name_map, hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if ".block_sparse_moe.switch_mlp." in module:
        return f"{_granitemoe_expert_name(name_map, module)}.{suffix}"
    module = module.replace(".switch_mlp.", ".experts.")
    target = name_map.get_name(module)
    assert target is not None, f"gguf-py has no llama.cpp name for {hf_name}"
    return f"{target}.{suffix}"


def _metadata(writer: GGUFWriter, case: ArchCase) -> None:
    c = case.config
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    if "head_dim" in c:
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if "rms_norm_eps" in c:
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    for key in ("norm_epsilon", "layer_norm_eps"):  # LayerNorm models: the converter's find_hparam
        if key in c:
            writer.add_layer_norm_eps(c[key])
    if case.rope_base_written:
        writer.add_rope_freq_base(c["rope_theta"])
    for key, value in case.extra_metadata.items():
        full = f"{case.gguf_arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, value)
    add_tiny_tokenizer(writer)


def _stacked_per_head(model) -> list[tuple[str, np.ndarray]]:
    """The parameters, with StableLM 2 12B's per-head norms (``X.norms.<head>.weight``) stacked
    into one ``X.weight`` of ``[heads, head_dim]``, as the converter's ``_stack_qk_norm`` does."""
    params, stacks = [], {}
    for name, value in tree_flatten(model.parameters()):
        module, sep, rest = name.partition(".norms.")
        if sep:
            stacks.setdefault(f"{module}.weight", {})[int(rest.split(".")[0])] = np.array(value, dtype=np.float32)
            continue
        params.append((name, np.array(value, dtype=np.float32)))
    params += [(name, np.stack([heads[i] for i in sorted(heads)])) for name, heads in stacks.items()]
    return params


def _fused_qkv(params: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """q/k/v projections as 2023's Phi-2 checkpoint had them: ``transformer.h.N.mixer.Wqkv``, rows
    q then k then v (the layout Hugging Face's later split undid)."""
    fused, parts = [], {}
    for name, array in params:
        module, _, suffix = name.rpartition(".")
        if module.endswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
            layer = int(module.split(".")[2])
            parts.setdefault((layer, suffix), {})[module[-6]] = array
            continue
        fused.append((name, array))
    for (layer, suffix), qkv in sorted(parts.items()):
        fused.append((f"transformer.h.{layer}.mixer.Wqkv.{suffix}", np.concatenate([qkv["q"], qkv["k"], qkv["v"]])))
    return fused


def write_arch_gguf(path: Path, case: ArchCase, model, qtype: str = "F32") -> None:
    """``model``'s weights as llama.cpp's converter lays them out: matrices in ``qtype``, vectors F32."""
    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == case.gguf_arch)
    name_map = get_tensor_name_map(arch_enum, case.config["num_hidden_layers"])
    writer = GGUFWriter(str(path), case.gguf_arch)
    _metadata(writer, case)
    params = _stacked_per_head(model)
    for name, array in _fused_qkv(params) if case.fused_qkv else params:
        if case.rope_permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = case.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = llama_cpp_permute(array, heads)
        if case.norm_offset and name.endswith("norm.weight"):
            array = array + case.norm_offset
        if case.squeezed:
            array = array.squeeze()
        # The converter keeps vectors and every norm (a stacked one is 2-D) in F32.
        quantizable = array.ndim > 1 and not name.endswith("norm.weight")
        kind = GGMLQuantizationType[qtype] if quantizable else GGMLQuantizationType.F32
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name_map, name), array)
        else:
            writer.add_tensor(_gguf_name(name_map, name), quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

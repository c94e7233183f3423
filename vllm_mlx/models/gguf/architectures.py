"""The GGUF architectures we convert: mlx-lm's config and parameter names for each.

What llama.cpp's converter (``convert_hf_to_gguf.py``) does to a Hugging Face checkpoint, and so
what we undo, per ``general.architecture``:

* Names: ``blk.N.attn_q`` for ``model.layers.N.self_attn.q_proj`` and so on (the tables below).
* llama, granite, granitemoe and smollm3 run GGML's "normal" RoPE on interleaved Q/K rows, so
  the converter permutes those rows (``rope_permuted``); qwen, gemma, olmo2, olmoe, phi, stablelm
  and starcoder2 run NEOX RoPE on rows as Hugging Face has them (llama.cpp's
  ``llama_model_rope_type``). ERNIE 4.5 runs the normal RoPE on rows as they are: its checkpoint
  is interleaved already, so the converter leaves it, and mlx-lm's ernie4_5 runs traditional RoPE.
* Gemma's RMSNorm (1, 2 and 3) multiplies by ``1 + w``; the converter stores ``w + 1`` in every
  ``*_norm`` tensor (``norm_offset``), so we subtract it again. Gemma's embedding scale
  (``sqrt(hidden)``) is applied at run time by both llama.cpp and mlx-lm: nothing to convert.
* Mixture-of-experts weights are stored stacked, one ``[experts, out, in]`` tensor per projection,
  as mlx-lm's ``SwitchGLU`` has them (granitemoe's fused gate+up is split by the converter).
* StableLM 2 12B's per-head q/k LayerNorms are stacked into one ``[heads, head_dim]`` tensor
  (``per_head``): we split it again.
* Phi-2 files from 2023 hold q, k and v in one ``attn_qkv`` tensor (``split_qkv``): we split its
  rows into mlx-lm's three projections.
* Converters before mid-2024 squeezed every tensor, so a one-row matrix (Qwen2-MoE's shared-expert
  gate) may be stored 1-D (``row_vectors``): we give it its row back.
* Config values llama.cpp does not store take the values its loader assumes (Gemma's attention
  scale and sliding-window pattern, Llama 3's RoPE smoothing factors, checked against the
  stored frequencies).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_mlx.platform.errors import ModelSourceError

_LLAMA_LAYERS = {
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_GEMMA_LAYERS = {
    **{k: v for k, v in _LLAMA_LAYERS.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYERS = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN2MOE_LAYERS = {
    **_LLAMA_LAYERS,
    **_MOE,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_OLMO2_LAYERS = {  # no norm before attention or MLP; q/k norms over the whole projection
    **{k: v for k, v in _LLAMA_LAYERS.items() if k not in ("attn_norm", "ffn_norm")},
    **_QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_OLMOE_LAYERS = {**_LLAMA_LAYERS, **_QK_NORMS, **_MOE}  # q/k norms over the whole projection
_GRANITEMOE_LAYERS = {
    **{k: v for k, v in _LLAMA_LAYERS.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
}
_STARCODER2_LAYERS = {  # LayerNorms with bias, every projection with bias, a GELU MLP
    **{k: v for k, v in _LLAMA_LAYERS.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_STABLELM_LAYERS = {  # LayerNorms with bias; StableLM 2 12B: per-head q/k LayerNorms, parallel residual
    **_LLAMA_LAYERS,
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
}
_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PHI2_LAYERS = {  # parallel attention and MLP after one LayerNorm; every projection with bias
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.dense",
    "attn_qkv": "self_attn.qkv_proj",  # files from 2023 (Wqkv): split into q/k/v_proj
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_PHI2_GLOBALS = {**_GLOBALS, "output_norm": "model.final_layernorm"}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias)$")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


class Fields:
    """``<arch>.KEY`` metadata reads, with a clear error for a missing required key."""

    def __init__(self, arch: str, metadata: dict) -> None:
        self.arch, self.metadata = arch, metadata

    def get(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelSourceError(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def one_per_model(self, key: str, default=None):
        """A value llama.cpp may store per layer (a list): we need it the same for all."""
        value = self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelSourceError(f"{self.arch}.{key} differs between layers, which mlx-lm models do not support")
            value = value[0]
        return value

    def count(self, key: str, default=None, minimum: int = 1, per_layer: bool = False) -> int:
        """A size field (``block_count``, ``attention.head_count``...): an integer of at least
        ``minimum``; ``per_layer``: llama.cpp may store it per layer (the same for all, here)."""
        value = self.one_per_model(key, default) if per_layer else self.get(key, default)
        if value is None:
            raise ModelSourceError(f"GGUF metadata lacks {self.arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ModelSourceError(f"GGUF metadata {self.arch}.{key} is {str(value)[:40]}, not an integer >= {minimum}")
        return value

    @property
    def hidden_and_heads(self) -> tuple[int, int]:
        return self.count("embedding_length"), self.count("attention.head_count", per_layer=True)

    @property
    def head_dim(self) -> int:
        """``attention.key_length``, or the hidden size over the heads where the file has none."""
        hidden, heads = self.hidden_and_heads
        return int(self.get("attention.key_length", hidden // heads))

    @property
    def partial_rotary_factor(self) -> float:
        """The share of each head's hidden-size-over-heads width that RoPE rotates."""
        hidden, heads = self.hidden_and_heads
        return int(self.get("rope.dimension_count", hidden // heads)) / (hidden // heads)


@dataclass(frozen=True)
class Architecture:
    """How one ``general.architecture`` maps to an mlx-lm model."""

    name: str
    model_type: str
    families: str  # what people call the models of this architecture (docs/models.md lists them)
    layers: dict
    rope_permuted: bool = False
    norm_offset: float = 0.0
    row_vectors: tuple[str, ...] = ()  # GGUF tensors mlx-lm has as [1, n], maybe stored 1-D
    per_head: tuple[str, ...] = ()  # [heads, head_dim] GGUF tensors mlx-lm has as ``.norms.<head>``
    global_names: dict = field(default_factory=lambda: _GLOBALS)  # the tensors outside the layers
    split_qkv: bool = False  # a fused ``attn_qkv`` (q, k, v rows) goes to separate q/k/v_proj
    extra_config: Callable[[Fields, dict], dict] = field(default=lambda fields, tensors: {})

    def hf_name(self, gguf_name: str) -> str:
        match = _TENSOR_RE.match(gguf_name)
        if match is None:
            raise ModelSourceError(f"unexpected tensor {gguf_name!r} in a {self.name} GGUF")
        layer, base, part = match.groups()
        table = self.layers if layer is not None else self.global_names
        if base not in table:
            raise ModelSourceError(f"tensor {gguf_name!r} is not one a {self.name} model has in mlx-lm")
        prefix = f"model.layers.{layer}." if layer is not None else ""
        return f"{prefix}{table[base]}.{part}"

    def is_norm(self, gguf_name: str) -> bool:
        return gguf_name.endswith("norm.weight")

    def is_row_vector(self, gguf_name: str) -> bool:
        return _base_name(gguf_name) in self.row_vectors

    def is_per_head(self, gguf_name: str) -> bool:
        return _base_name(gguf_name) in self.per_head

    def is_fused_qkv(self, gguf_name: str) -> bool:
        return self.split_qkv and _base_name(gguf_name) == "attn_qkv"


def _base_name(gguf_name: str) -> str | None:
    """``attn_q_norm`` for ``blk.3.attn_q_norm.weight``."""
    match = _TENSOR_RE.match(gguf_name)
    return None if match is None else match.group(2)


def _epsilon(fields: Fields, key: str = "attention.layer_norm_rms_epsilon") -> float:
    # GGUF stores float32; round to the decimal it was written from (9.9999997e-06 -> 1e-05).
    return float(f"{fields.get(key, 1e-5):.7g}")


def _rows(tensors: dict, name: str) -> int | None:
    """The output width (rows) of a tensor, from the tensor table (numpy order: rows last-but-one)."""
    info = tensors.get(name)
    return None if info is None else int(info.shape[-2])


def _layer_count(fields: Fields, tensors: dict) -> int:
    """``block_count``, which must name exactly the layers whose ``blk.N.`` tensors the file holds
    (a file declaring 100,000 layers over 2 would convert, then fail to load)."""
    declared = fields.count("block_count")
    present = {int(m.group(1)) for name in tensors if (m := _LAYER_RE.match(name))}
    if present != set(range(declared)):
        held = f"layers 0..{max(present)}" if present else "no layer tensors"
        raise ModelSourceError(f"GGUF metadata {fields.arch}.block_count is {declared}, but the file holds {held}")
    return declared


def base_config(arch: Architecture, metadata: dict, tensors: dict) -> dict:
    """The config fields every architecture has, then its own (``extra_config``)."""
    fields = Fields(arch.name, metadata)
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelSourceError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    hidden, heads = fields.hidden_and_heads
    head_dim = fields.head_dim
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": fields.count("feed_forward_length", 0, minimum=0, per_layer=True),
        "num_attention_heads": heads,
        "num_key_value_heads": fields.count("attention.head_count_kv", heads, per_layer=True),
        "num_hidden_layers": _layer_count(fields, tensors),
        "head_dim": head_dim,
        "rms_norm_eps": _epsilon(fields),
        "rope_theta": float(fields.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.get("context_length", 2048)),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    config.update(arch.extra_config(fields, tensors))
    return config


def _llama_extra(fields: Fields, tensors: dict) -> dict:
    return {
        "rope_traditional": False,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }


def llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """The ``rope_scaling`` whose per-frequency factors llama.cpp stored as ``rope_freqs``.

    Llama 3.1+ smooths between ``low_freq_factor`` and ``high_freq_factor`` over an original
    context; llama.cpp keeps only the resulting factors. ``factor`` is their largest; the other
    three take Meta's values (1, 4, 8192), and the factors they give must equal the stored ones.
    """
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (i / head_dim)
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(scaling["factor"])
        else:
            smooth = (scaling["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    if not np.allclose(factors, expected, rtol=1e-4):
        raise ModelSourceError("rope_freqs holds RoPE factors that are not Llama 3's scaling, which vllm-mlx cannot map")
    return scaling


def _gemma_attention_scalar(fields: Fields, big_layers: int) -> int:
    # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 27B models (told apart by their
    # layer count) and by 1/sqrt(head_dim) otherwise; Hugging Face's query_pre_attn_scalar.
    hidden, heads = fields.hidden_and_heads
    return hidden // heads if int(fields.need("block_count")) == big_layers else fields.head_dim


def _gemma2_extra(fields: Fields, tensors: dict) -> dict:
    return {
        "query_pre_attn_scalar": _gemma_attention_scalar(fields, big_layers=46),
        "attn_logit_softcapping": float(fields.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(fields.get("final_logit_softcapping", 30.0)),
        "sliding_window": int(fields.get("attention.sliding_window", 4096)),
    }


def _gemma3_extra(fields: Fields, tensors: dict) -> dict:
    config = {
        "query_pre_attn_scalar": _gemma_attention_scalar(fields, big_layers=62),
        # Newer llama.cpp writes the sliding layers' base; older files leave its fixed 10000.
        "rope_local_base_freq": float(fields.get("rope.freq_base_swa", 10000.0)),
        "sliding_window": int(fields.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # every sixth layer global: fixed in llama.cpp too
    }
    if fields.get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(fields.need("rope.scaling.factor"))}
    return config


def _qwen3moe_extra(fields: Fields, tensors: dict) -> dict:
    moe_size = int(fields.need("expert_feed_forward_length"))
    return {
        "num_experts": int(fields.need("expert_count")),
        "num_experts_per_tok": int(fields.need("expert_used_count")),
        "moe_intermediate_size": moe_size,
        "intermediate_size": int(fields.get("feed_forward_length", moe_size)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _qwen2moe_extra(fields: Fields, tensors: dict) -> dict:
    # Files from before llama.cpp wrote the expert sizes: take them from the tensors' shapes.
    moe_size = fields.get("expert_feed_forward_length") or _rows(tensors, "blk.0.ffn_up_exps.weight")
    shared_size = fields.get("expert_shared_feed_forward_length") or _rows(tensors, "blk.0.ffn_up_shexp.weight")
    if moe_size is None or shared_size is None:
        raise ModelSourceError("a qwen2moe GGUF without expert or shared-expert tensors is not Qwen2-MoE")
    return {
        "num_experts": int(fields.need("expert_count")),
        "num_experts_per_tok": int(fields.need("expert_used_count")),
        "moe_intermediate_size": int(moe_size),
        "shared_expert_intermediate_size": int(shared_size),
    }


def _olmo2_extra(fields: Fields, tensors: dict) -> dict:
    # OLMo 3 is written as olmo2 with a sliding window (and YaRN): a different mlx-lm model.
    if fields.get("attention.sliding_window") is not None or fields.get("rope.scaling.type") not in (None, "none"):
        raise ModelSourceError("an olmo2 GGUF with a sliding window or RoPE scaling (OLMo 3) is not supported")
    return {"attention_bias": "blk.0.attn_q.bias" in tensors, "mlp_bias": "blk.0.ffn_up.bias" in tensors}


def _olmoe_extra(fields: Fields, tensors: dict) -> dict:
    if fields.get("attention.clamp_kqv") is not None:
        raise ModelSourceError("an olmoe GGUF with clamped q/k/v (clip_qkv) is not supported by mlx-lm's olmoe")
    return {
        "num_experts": int(fields.need("expert_count")),
        "num_experts_per_tok": int(fields.need("expert_used_count")),
        # The experts' width is feed_forward_length; the tensors say it whatever the metadata.
        "intermediate_size": _rows(tensors, "blk.0.ffn_up_exps.weight") or int(fields.need("feed_forward_length")),
        "norm_topk_prob": bool(fields.get("expert_weights_norm", False)),  # llama.cpp: unnormalized
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


def _phi2_extra(fields: Fields, tensors: dict) -> dict:
    return {
        "layer_norm_eps": _epsilon(fields, "attention.layer_norm_epsilon"),
        "partial_rotary_factor": fields.partial_rotary_factor,
        # The converter writes 4 * hidden, which Phi-2 has; the tensors say it for any model.
        "intermediate_size": _rows(tensors, "blk.0.ffn_up.weight") or int(fields.need("feed_forward_length")),
    }


def _phi3_extra(fields: Fields, tensors: dict) -> dict:
    config = {"partial_rotary_factor": fields.partial_rotary_factor}
    original = fields.get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    return config


def _granite_extra(fields: Fields, tensors: dict) -> dict:
    return {
        **_llama_extra(fields, tensors),
        "embedding_multiplier": float(fields.get("embedding_scale", 1.0)),
        "residual_multiplier": float(fields.get("residual_scale", 1.0)),
        "attention_multiplier": float(fields.need("attention.scale")),
        "logits_scaling": float(fields.get("logit_scale", 1.0)),
    }


def _granitemoe_extra(fields: Fields, tensors: dict) -> dict:
    return {
        **_granite_extra(fields, tensors),
        "num_local_experts": int(fields.need("expert_count")),
        "num_experts_per_tok": int(fields.need("expert_used_count")),
    }


def _ernie4_5_extra(fields: Fields, tensors: dict) -> dict:
    return {"use_bias": "blk.0.attn_q.bias" in tensors}


def _smollm3_extra(fields: Fields, tensors: dict) -> dict:
    # Every fourth layer without RoPE: a constant in llama.cpp (n_no_rope_layer_step), no key.
    return {**_llama_extra(fields, tensors), "no_rope_layer_interval": 4}


def _starcoder2_extra(fields: Fields, tensors: dict) -> dict:
    return {"norm_epsilon": _epsilon(fields, "attention.layer_norm_epsilon")}


def _stablelm_extra(fields: Fields, tensors: dict) -> dict:
    return {
        "layer_norm_eps": _epsilon(fields, "attention.layer_norm_epsilon"),
        "partial_rotary_factor": fields.partial_rotary_factor,
        # llama.cpp runs the parallel residual exactly when a layer has no ffn_norm: so do we.
        "use_parallel_residual": "blk.0.ffn_norm.weight" not in tensors,
        "use_qkv_bias": "blk.0.attn_q.bias" in tensors,
        "qk_layernorm": "blk.0.attn_q_norm.weight" in tensors,
    }


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture("llama", "llama", "Llama 2/3, Mistral, SmolLM", _LLAMA_LAYERS, rope_permuted=True,
                     extra_config=_llama_extra),
        Architecture("qwen2", "qwen2", "Qwen2, Qwen2.5", _LLAMA_LAYERS),
        Architecture("qwen3", "qwen3", "Qwen3", {**_LLAMA_LAYERS, **_QK_NORMS}),
        Architecture("qwen2moe", "qwen2_moe", "Qwen1.5-MoE, Qwen2-MoE", _QWEN2MOE_LAYERS,
                     row_vectors=("ffn_gate_inp_shexp",), extra_config=_qwen2moe_extra),
        Architecture("qwen3moe", "qwen3_moe", "Qwen3 MoE", {**_LLAMA_LAYERS, **_QK_NORMS, **_MOE},
                     extra_config=_qwen3moe_extra),
        Architecture("gemma", "gemma", "Gemma, CodeGemma", _LLAMA_LAYERS, norm_offset=1.0),
        Architecture("gemma2", "gemma2", "Gemma 2", _GEMMA_LAYERS, norm_offset=1.0, extra_config=_gemma2_extra),
        Architecture("gemma3", "gemma3_text", "Gemma 3 (text)", {**_GEMMA_LAYERS, **_QK_NORMS}, norm_offset=1.0,
                     extra_config=_gemma3_extra),
        Architecture("phi2", "phi", "Phi-1.5, Phi-2", _PHI2_LAYERS, global_names=_PHI2_GLOBALS, split_qkv=True,
                     extra_config=_phi2_extra),
        Architecture("phi3", "phi3", "Phi-3, Phi-3.5, Phi-4 mini", _PHI3_LAYERS, extra_config=_phi3_extra),
        Architecture("granite", "granite", "Granite 3", _LLAMA_LAYERS, rope_permuted=True,
                     extra_config=_granite_extra),
        Architecture("granitemoe", "granitemoe", "Granite 3 MoE (1B-A400M, 3B-A800M)", _GRANITEMOE_LAYERS,
                     rope_permuted=True, extra_config=_granitemoe_extra),
        Architecture("olmo2", "olmo2", "OLMo 2", _OLMO2_LAYERS, extra_config=_olmo2_extra),
        Architecture("olmoe", "olmoe", "OLMoE", _OLMOE_LAYERS, extra_config=_olmoe_extra),
        Architecture("ernie4_5", "ernie4_5", "ERNIE 4.5 (dense)", _LLAMA_LAYERS, extra_config=_ernie4_5_extra),
        Architecture("smollm3", "smollm3", "SmolLM3", _LLAMA_LAYERS, rope_permuted=True, extra_config=_smollm3_extra),
        Architecture("stablelm", "stablelm", "StableLM 2, StableLM 3B", _STABLELM_LAYERS,
                     per_head=("attn_q_norm", "attn_k_norm"), extra_config=_stablelm_extra),
        Architecture("starcoder2", "starcoder2", "StarCoder2", _STARCODER2_LAYERS, extra_config=_starcoder2_extra),
    )
}  # fmt: skip
# Tensors that become config values, not weights: Llama 3's RoPE factors, Phi-3's long-RoPE ones.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def architecture_of(metadata: dict) -> Architecture:
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ModelSourceError(
            f"GGUF architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[name]


def rope_config(arch: Architecture, config: dict, config_tensors: dict[str, np.ndarray]) -> dict:
    """The RoPE scaling the config tensors describe (none: ``{}``)."""
    if "rope_freqs.weight" in config_tensors:
        if arch.name not in ("llama", "granite"):
            raise ModelSourceError(f"rope_freqs in a {arch.name} GGUF is not supported")
        factors = config_tensors["rope_freqs.weight"]
        return {"rope_scaling": llama3_rope_scaling(factors, config["rope_theta"], config["head_dim"])}
    if "rope_factors_long.weight" in config_tensors:
        return {
            "rope_scaling": {
                "type": "longrope",
                "long_factor": config_tensors["rope_factors_long.weight"].tolist(),
                "short_factor": config_tensors["rope_factors_short.weight"].tolist(),
            }
        }
    return {}

"""Tiny random-weight vision-language models whose text side is a large mixture-of-experts model
(the families are served through the generic path, ``vlm_generic.py``), saved as directories that
mlx-vlm loads offline. Helpers and conventions are tests/tiny_vlm.py's.

* :func:`build_tiny_mistral_large3`: Mistral Large 3: Mistral 3's Pixtral tower, 2x2 patch merger
  and ``[IMG]`` rows, under a DeepSeek-V3 text model (multi-head latent attention, sigmoid-routed
  MoE). mlx-vlm registers its own Mistral 3 processor for ``mistral3`` only, so ``load`` gives
  this one transformers' PixtralProcessor, which needs torch and torchvision (refused without).
* :func:`build_tiny_kimi_k25`: Kimi K2.5: Kimi-VL's MoonViT (2-D rotary, interpolated learned
  positions, 2x2 merge) with a per-image projector, a DeepSeek-V3 text model; mlx-vlm's own
  processor expands ``<|media_pad|>`` after tokenizing (at the id level) and hands the model the
  placeholder's id (``image_token_id``) beside the pixels.
* :func:`build_tiny_mimo_v2`: MiMo-V2: Qwen2.5-VL's patches and processor with a tower of its own
  (grouped-query attention, attention sinks), a MiMo-V2-Flash text model: a global layer and a
  sliding-window layer (window 8, shorter than every prompt) with attention-sink biases, partial
  rotary, values scaled, a sigmoid-routed MoE; plain 1-D positions.
* :func:`build_tiny_kimi_k3`: Kimi K3: MoonViT-3D (RMSNorm blocks, fixed divided positions, 2x2
  merge) and a Kimi-Linear-style hybrid text model: a Kimi delta-attention layer (short
  convolution and recurrent state, in the engine's state pool), an MLA layer, a MoE, and
  attention residuals (each layer mixes the outputs of earlier blocks). mlx-vlm's processor
  renders the chat natively; a ``<|media_pad|>`` in the text is repeated per merged patch.
* :func:`build_tiny_glm5_next`: GLM-5-Next: GLM-4.1V's prompt layout and Qwen2-VL-style patches
  (its own processor, token-count based resizing), a hybrid text model without positions: a
  linear (delta) attention layer, a DeepSeek sparse-attention layer (NoPE MLA with a top-k
  indexer), hyper-connections (the hidden state kept as several streams), a MoE. Its caches are
  the text model's own, held per request (``executor/held_caches.py``). mlx-vlm's ``load`` replaces
  the processor's image processor by the package's, built with its defaults (16 to 8000 tokens an
  image): the token budget its ``processor_config.json`` writes (4 to 16) is ignored, as the engine,
  loading as mlx-vlm does, must ignore it too (a 100x60 picture is 24 tokens, not 12).
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    qwen_vision_ids,
    CHARS,
    DEEPSEEK_V3_TINY_TEXT_CONFIG,
    GLM4V_CHAT_TEMPLATE,
    GLM4V_SPECIAL_TOKENS,
    KIMI_VL_SPECIAL_TOKENS,
    MISTRAL3_CHAT_TEMPLATE,
    MISTRAL3_SPECIAL_TOKENS,
    MISTRAL3_VISION_CONFIG,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_MAX_PIXELS,
    QWEN2_VL_MIN_PIXELS,
    QWEN_SPECIAL_TOKENS,
    _instantiate,
    _make_tokenizer,
    _patch_image_processor,
    _save_model,
    _save_tokenizer,
    _write_json,
)


def build_tiny_mistral_large3(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Mistral Large 3 directory: Mistral 3's vision side (Pixtral at up to
    112 px, 2x2 merger: a 100x60 picture is 3 rows of 4 ``[IMG]``) and a DeepSeek-V3 text model
    (MLA, a dense layer then a MoE layer). ``tokenizer_dir`` as in ``build_tiny_qwen2_vl``."""
    from mlx_vlm.models import mistral_large3

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, MISTRAL3_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MISTRAL3_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    vision = dict(MISTRAL3_VISION_CONFIG)
    config = {
        "model_type": "mistral_large3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {**DEEPSEEK_V3_TINY_TEXT_CONFIG, "model_type": "mistral_large3", "vocab_size": vocab_size},
        "vision_config": vision,
        "vocab_size": vocab_size,
        "image_token_id": ids["[IMG]"],
        "spatial_merge_size": 2,
        "multimodal_projector_bias": False,
        "eos_token_id": [ids["</s>"]],
    }
    model = _instantiate(mistral_large3, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "</s>", "<pad>", 4096, MISTRAL3_CHAT_TEMPLATE)
    _write_pixtral_processor(out_dir, vision, merge=2)
    return out_dir


def _write_pixtral_processor(out_dir: Path, vision: dict, merge: int) -> None:
    """transformers' Pixtral image processor and processor (as ``build_tiny_mistral3`` writes them)."""
    patch = vision["patch_size"]
    preprocessor = {
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": vision["image_size"]},
        "patch_size": {"height": patch, "width": patch}, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    processor = {"processor_class": "PixtralProcessor", "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                 "image_end_token": "[IMG_END]", "patch_size": patch, "spatial_merge_size": merge}  # fmt: skip
    _write_json(out_dir / "processor_config.json", processor)


KIMI_K25_SPECIAL_TOKENS = [*KIMI_VL_SPECIAL_TOKENS, "<|media_begin|>"]

# Kimi K2.5's template shape: Kimi-VL's, an image part rendering as
# <|media_begin|>image<|media_content|><|media_pad|><|media_end|>.
KIMI_K25_IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
KIMI_K25_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_user|>user' if message['role'] == 'user' else '<|im_assistant|>assistant' }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + KIMI_K25_IMAGE +
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# MoonViT at 14 px patches, padded to multiples of 28 px (a 100x60 picture: 4x3 merged = 12 tokens).
MOONVIT_TINY_CONFIG = {
    "model_type": "moonvit", "depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
    "intermediate_size": 64, "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
    "merge_kernel_size": [2, 2],
}  # fmt: skip


def build_tiny_kimi_k25(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Kimi K2.5 directory: MoonViT at the image's own size (padded to
    multiples of 28 px, at most 64 patches), 2x2 merge and projector, a DeepSeek-V3 text model
    (MLA, a dense then a MoE layer). ``tokenizer_dir`` as in ``build_tiny_qwen2_vl``."""
    from mlx_vlm.models import kimi_k25

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, KIMI_K25_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in KIMI_K25_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["[EOS]"], ids["<|im_end|>"]]
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {**DEEPSEEK_V3_TINY_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(MOONVIT_TINY_CONFIG),
        "vocab_size": vocab_size,
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(kimi_k25, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "[PAD]", 4096, KIMI_K25_CHAT_TEMPLATE)
    media = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 64, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", {"media_proc_cfg": media})
    return out_dir


# MiMo-V2-Flash's text model: layer 0 global attention with a dense MLP, layer 1 sliding-window
# attention (window 8) with attention-sink biases and a MoE (4 experts, 2 per token).
MIMO_V2_TEXT_CONFIG = {
    "model_type": "mimo_v2", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "v_head_dim": 16,
    "swa_head_dim": 16, "swa_v_head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "rope_theta": 10000.0, "swa_rope_theta": 10000.0, "partial_rotary_factor": 0.5, "max_position_embeddings": 4096,
    "sliding_window_size": 8, "hybrid_layer_pattern": [0, 1], "moe_layer_freq": [0, 1],
    "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
}  # fmt: skip

# MiMo's tower at 14 px patches, 2x2 merge: Qwen2-VL's image sizes (a 100x60 picture: 8 tokens).
MIMO_V2_VISION_CONFIG = {
    "model_type": "mimovl", "depth": 1, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
    "num_heads": 2, "num_key_value_heads": 1, "qk_channels": 16, "patch_size": 14, "spatial_patch_size": 14,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "fullatt_block_indexes": [], "in_channels": 3,
}  # fmt: skip


def build_tiny_mimo_v2(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight MiMo-V2 directory (``MIMO_V2_TEXT_CONFIG``, ``MIMO_V2_VISION_CONFIG``,
    Qwen2-VL's template and image processor). ``tokenizer_dir`` as in ``build_tiny_qwen2_vl``."""
    from mlx_vlm.models import mimo_v2

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, QWEN_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "mimo_v2",
        "architectures": ["MiMoV2ForCausalLM"],
        "text_config": {**MIMO_V2_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(MIMO_V2_VISION_CONFIG),
        "vocab_size": vocab_size,
        **qwen_vision_ids(ids),
        "eos_token_id": ids["<|im_end|>"],
    }
    model = _instantiate(mimo_v2, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "<|endoftext|>", 4096, QWEN2_VL_CHAT_TEMPLATE)
    pixels = (QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS)
    preprocessor = _patch_image_processor("Qwen2VLImageProcessor", "Qwen2VLProcessor", MIMO_V2_VISION_CONFIG, pixels,
                                          do_resize=True, min_pixels=pixels[0], max_pixels=pixels[1])  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    return out_dir


KIMI_K3_SPECIAL_TOKENS = [*KIMI_K25_SPECIAL_TOKENS]

# Kimi K3's text model: layer 0 Kimi delta attention (KDA: 2 heads of 16, short convolution of
# 4), layer 1 MLA (no rotary: ``mla_use_nope``) with a MoE (4 experts, 2 per token, one shared);
# attention residuals over blocks of one layer.
KIMI_K3_TEXT_CONFIG = {
    "model_type": "kimi_linear", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
    "linear_attn_config": {"kda_layers": [1], "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4},
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
    "first_k_dense_replace": 1, "attn_res_block_size": 1,
}  # fmt: skip

# MoonViT-3D at 14 px patches, padded to multiples of 28 px, 2x2 merge (100x60: 4x3 = 12 tokens).
KIMI_K3_VISION_CONFIG = {
    "model_type": "moonvit3d", "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
    "init_pos_emb_time": 1, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_hidden_size": 32,
    "vt_intermediate_size": 64, "qkv_hidden_size": 32, "merge_kernel_size": [2, 2], "mm_hidden_size": 32,
    "text_hidden_size": 64,
}  # fmt: skip


def build_tiny_kimi_k3(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight Kimi K3 directory (``KIMI_K3_TEXT_CONFIG``, ``KIMI_K3_VISION_CONFIG``;
    at most 64 patches per image). ``tokenizer_dir`` as in ``build_tiny_qwen2_vl``."""
    from mlx_vlm.models import kimi_k3

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, KIMI_K3_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in KIMI_K3_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["[EOS]"], ids["<|im_end|>"]]
    config = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": {**KIMI_K3_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": dict(KIMI_K3_VISION_CONFIG),
        "vocab_size": vocab_size,
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(kimi_k3, config, seed)
    _slow_delta_decay(model)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "<|im_end|>", "[PAD]", 4096, KIMI_K25_CHAT_TEMPLATE)
    media = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 64, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", {"media_proc_cfg": media})
    return out_dir


def _slow_delta_decay(model) -> None:
    """Decay rates of 0.01-0.1 for the delta-attention states (mlx-vlm initializes 1-16: the state
    forgets within a token or two). The MLA layer has no positions (NoPE), so the delta state is
    what carries the prompt's order; a random state that forgets at once would leave two images
    in swapped order indistinguishable."""
    import mlx.core as mx

    for layer in model.language_model.model.layers:
        if layer.is_linear:
            heads = layer.self_attn.num_heads
            layer.self_attn.A_log = mx.log(mx.random.uniform(low=0.01, high=0.1, shape=(heads,)))


# GLM-5-Next's text model: layer 0 linear attention (2 heads of 16) with a dense MLP, layer 1
# DeepSeek sparse attention (NoPE MLA, an indexer keeping the top 16 keys in pools of 4) with a
# MoE (4 experts, 2 per token, one shared); 2 hyper-connection streams.
GLM5_NEXT_TEXT_CONFIG = {
    "model_type": "glm5_next_text", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_nextn_predict_layers": 0, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "max_position_embeddings": 4096, "first_k_dense_replace": 1,
    "layer_types": ["linear_attention", "deepseek_sparse_attention"], "indexer_types": ["full", "full"],
    "index_topk": 16, "index_kpool": 4, "index_head_dim": 16, "index_n_heads": 2,
    "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4}, "hc_mult": 2,
}  # fmt: skip

GLM5_NEXT_VISION_CONFIG = {
    "model_type": "glm5_next_vision", "depth": 1, "hidden_size": 32, "num_heads": 2, "image_size": 56,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
    "intermediate_size": 64, "projection_intermediate_size": 64,
}  # fmt: skip


def build_tiny_glm5_next(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random-weight GLM-5-Next directory (``GLM5_NEXT_TEXT_CONFIG``, a one-block tower of
    width 32). Its processor config asks 4 to 16 tokens per image, which mlx-vlm's ``load`` ignores
    (the package's image processor, at its defaults: 16 tokens or more), so the family tests hold the
    engine to loading the processor as mlx-vlm does. ``tokenizer_dir`` as in ``build_tiny_qwen2_vl``."""
    from mlx_vlm.models import glm5_next

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GLM4V_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in GLM4V_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [ids["<|endoftext|>"], ids["<|user|>"]]
    pad = ids["<|endoftext|>"]
    text = {**GLM5_NEXT_TEXT_CONFIG, "vocab_size": vocab_size, "eos_token_id": eos, "pad_token_id": pad}
    config = {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(GLM5_NEXT_VISION_CONFIG),
        "image_token_id": ids["<|image|>"],
        "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"],
        "video_end_token_id": ids["<|end_of_video|>"],
        "eos_token_id": eos,
    }
    model = _instantiate(glm5_next, config, seed)
    _save_model(out_dir, model, config)
    extra = {"image_token": "<|image|>", "video_token": "<|video|>"}
    _save_tokenizer(out_dir, tok, "<|endoftext|>", "<|endoftext|>", 4096, GLM4V_CHAT_TEMPLATE, extra)
    image = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_image_tokens": 4, "max_image_tokens": 16}
    _write_json(out_dir / "processor_config.json", {"image_processor": image, "video_processor": image})
    return out_dir


def _save_char_sentencepiece(path: Path, special_tokens: list[str]) -> list[str]:
    """A SentencePiece model with one piece per character of ``tiny_vlm.CHARS`` and the special
    tokens as user-defined pieces (whole, never split); its pieces in id order."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["".join(CHARS) * 3]), model_writer=model, model_type="char",
        vocab_size=len(CHARS) + len(special_tokens) + 3, user_defined_symbols=special_tokens,
        character_coverage=1.0, remove_extra_whitespaces=False, add_dummy_prefix=False,
        normalization_rule_name="identity", minloglevel=2,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return [processor.id_to_piece(i) for i in range(processor.vocab_size())]

"""Tiny random-weight vision-language models built as tests/tiny_vlm.py builds its families (its
helpers, char-level tokenizer, random weights scaled), each with mlx-vlm's own processor:

* :func:`build_tiny_gemma4_unified`: Gemma 4 unified: no vision tower at all (an encoder-free
  embedder: 48 px patches flattened, layer-normed, one dense layer, learned 2-D positions), Gemma
  4's text model with its unified defaults: ``use_bidirectional_attention="vision"`` (each image's
  block of soft tokens attends to itself both ways), global layers whose values are their keys
  (``attention_k_eq_v``, one KV head), no per-layer inputs; its own processor (patches padded to
  ``max_soft_tokens``, positions -1 at the padding). ``<|image|>`` expands to
  ``<|image>`` + a soft token per 48 px patch + ``<image|>``: up to 280 (the image processor's
  default, which mlx-vlm's ``load`` always builds).
* :func:`build_tiny_minimax_m3_vl`: MiniMax-M3-VL (a CLIP-style tower with 3-D rotary positions, a
  projector, then 2x2 patches merged by an MLP; ``get_input_embeddings`` gives ``visual_pos_masks``,
  which its text model pops and ignores) under its own processor (``]<]image[>[`` expands to start +
  a token per merged patch + end, 16 to 24 here) and a MiniMax-M3 text model in its config's own layout:
  three dense layers, then a sparse-attention layer (an indexer choosing key blocks) with a MoE. Its
  sparse layers keep the indexer's keys in ``MiniMaxM3KVCache``, mlx-vlm's own cache class: refused at load.
"""

from __future__ import annotations

from pathlib import Path

from tiny_vlm import (
    CLIP_MEAN,
    CLIP_STD,
    GEMMA4_CHAT_TEMPLATE,
    GEMMA4_SPECIAL_TOKENS,
    GEMMA4_TEXT_CONFIG,
    _instantiate,
    _make_tokenizer,
    _save_model,
    _save_tokenizer,
    _write_json,
)

__all__ = ["build_tiny_gemma4_unified", "build_tiny_minimax_m3_vl"]


# -- Gemma 4 unified ------------------------------------------------------------------------------

# Gemma 4's tiny text sizes under the unified text config's own layout: one sliding layer (window
# 8, shorter than every prompt) and one global layer (keys as values, one KV head), no per-layer
# inputs, no KV sharing, image blocks both ways (the config's default, written out).
GEMMA4_UNIFIED_TEXT_CONFIG = {
    **{k: v for k, v in GEMMA4_TEXT_CONFIG.items() if k not in ("use_double_wide_mlp",)},
    "model_type": "gemma4_unified_text",
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "use_bidirectional_attention": "vision",
}

# The encoder-free embedder: 16 px patches pooled 3x3 (a 48 px model patch per soft token). Images
# are up to 280 soft tokens, the image processor's default: mlx-vlm's ``load`` (the oracle's) swaps
# the processor's image processor for a default-built one, whatever processor_config.json says,
# so the tiny model keeps those sizes (a 100x60 picture is 252 soft tokens; positions below 280).
GEMMA4_UNIFIED_VISION_CONFIG = {
    "model_type": "gemma4_unified_vision",
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "model_patch_size": 48,
    "mm_embed_dim": 32,
    "mm_posemb_size": 280,
    "num_soft_tokens": 280,
    "output_proj_dims": 32,
    "rms_norm_eps": 1e-6,
}


def build_tiny_gemma4_unified(
    out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0, weight_scale: float = 4.0
) -> Path:
    """A tiny random-weight Gemma 4 unified directory (see the module docstring). Weights are
    scaled x4 but the (tied) embeddings x0.4 in all: Gemma scales embeddings by sqrt(hidden), and
    larger ones make every step repeat the last token (the residual stream is the token's own
    embedding, its tied logit the largest). So the seven test prompts decode to seven different
    sequences, the top two log-probabilities of mlx-vlm's greedy steps >= 0.009 apart."""
    import mlx.core as mx
    from mlx_vlm.models import gemma4_unified

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, GEMMA4_SPECIAL_TOKENS, newline_runs=True)
    ids = {t: tok.token_to_id(t) for t in GEMMA4_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    text = {**GEMMA4_UNIFIED_TEXT_CONFIG, "vocab_size": vocab_size, "vocab_size_per_layer_input": vocab_size,
            "pad_token_id": ids["<pad>"]}  # fmt: skip
    vision = GEMMA4_UNIFIED_VISION_CONFIG
    config = {
        "model_type": "gemma4_unified",
        "architectures": ["Gemma4UnifiedForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "audio_config": None,
        "vocab_size": vocab_size,
        "hidden_size": text["hidden_size"],
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "audio_token_id": ids["<|audio|>"],
        "boa_token_id": ids["<|audio>"],
        "eoa_token_id": ids["<audio|>"],
        "video_token_id": ids["<|video|>"],
        "vision_soft_tokens_per_image": vision["num_soft_tokens"],
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<turn|>"]],
        "tie_word_embeddings": True,
    }
    model = _instantiate(gemma4_unified, config, seed)
    # The position table starts as zeros (no position at all): random instead.
    embedder = model.vision_embedder
    embedder.pos_embedding = mx.random.normal(embedder.pos_embedding.shape) * 0.5
    # Zero (tied) embedding rows for the media placeholders, as build_tiny_gemma4's: never written;
    # the others x0.1 before the x4 of every weight (the docstring says why).
    embed = model.language_model.model.embed_tokens
    media = mx.array([ids["<|image|>"], ids["<|audio|>"], ids["<|video|>"]])
    embed.weight = embed.weight.at[media].multiply(0.0) * 0.1
    _save_model(out_dir, model, config, weight_scale)
    extra = {
        "extra_special_tokens": {
            "boi_token": "<|image>",
            "eoi_token": "<image|>",
            "image_token": "<|image|>",
            "boa_token": "<|audio>",
            "eoa_token": "<audio|>",
            "audio_token": "<|audio|>",
            "video_token": "<|video|>",
        }
    }
    _save_tokenizer(out_dir, tok, "<turn|>", "<pad>", text["max_position_embeddings"], GEMMA4_CHAT_TEMPLATE, extra)
    image_processor = {
        "image_processor_type": "Gemma4UnifiedImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        **{key: vision[key] for key in ("patch_size", "pooling_kernel_size", "model_patch_size", "mm_posemb_size")},
        "max_soft_tokens": vision["num_soft_tokens"],
    }
    processor_config = {"processor_class": "Gemma4UnifiedProcessor", "image_processor": image_processor}
    _write_json(out_dir / "processor_config.json", processor_config)
    return out_dir


# -- MiniMax-M3-VL ---------------------------------------------------------------------------------

MINIMAX_M3_IMAGE, MINIMAX_M3_VIDEO = "]<]image[>[", "]<]video[>["
MINIMAX_M3_START, MINIMAX_M3_END = "]<]start of image[>[", "]<]end of image[>["
MINIMAX_M3_SPECIAL_TOKENS = [
    "<pad>", "[e~[", "]~!b[", "]~b]", MINIMAX_M3_IMAGE, MINIMAX_M3_VIDEO, MINIMAX_M3_START, MINIMAX_M3_END,
]  # fmt: skip

# MiniMax's turns (``]~b]role\n...[e~[``); an image part renders as the image token, which the
# processor expands to start + a token per 2x2 merged patch + end.
MINIMAX_M3_CHAT_TEMPLATE = (
    "{% for message in messages %}]~b]{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + MINIMAX_M3_IMAGE +
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}[e~[\n{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% endif %}"
)  # fmt: skip

# The text config's own layout at 4 layers: layers 0-2 dense (full attention, a dense MLP), layer 3
# a sparse-attention layer (an indexer picks 2 key blocks of 4 tokens, the local one included, so
# the test prompts drop blocks) with a sigmoid-routed MoE of 4 experts and a shared one.
MINIMAX_M3_TEXT_CONFIG = {
    "model_type": "minimax_m3",
    "hidden_size": 64,
    "intermediate_size": 32,
    "dense_intermediate_size": 128,
    "shared_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    "index_local_blocks": 1,
    "max_position_embeddings": 4096,
}

# A CLIP-style tower with 3-D rotary positions: 14 px patches, two frames deep, merged 2x2 after
# the projector; images resized to 112 px on their short side, at most 112x168: 16 to 24 tokens.
MINIMAX_M3_VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "patch_size": 14,
    "projection_dim": 64,
}
MINIMAX_M3_MAX_PIXELS = 112 * 168


def build_tiny_minimax_m3_vl(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 5) -> Path:
    """A tiny random-weight MiniMax-M3-VL directory (see the module docstring). Seed 5: its greedy
    tokens tell two images' order apart from the first (seed 0's are the same for 8 tokens)."""
    from mlx_vlm.models import minimax_m3_vl

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _make_tokenizer(tokenizer_dir, MINIMAX_M3_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in MINIMAX_M3_SPECIAL_TOKENS}
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    config = {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3VLForConditionalGeneration"],
        "text_config": {**MINIMAX_M3_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": MINIMAX_M3_VISION_CONFIG,
        "vocab_size": vocab_size,
        "image_token_index": ids[MINIMAX_M3_IMAGE],
        "video_token_index": ids[MINIMAX_M3_VIDEO],
        "vision_start_token_id": ids[MINIMAX_M3_START],
        "vision_end_token_id": ids[MINIMAX_M3_END],
        "projector_hidden_size": 64,
        "eos_token_id": ids["[e~["],
    }
    model = _instantiate(minimax_m3_vl, config, seed)
    _save_model(out_dir, model, config)
    _save_tokenizer(out_dir, tok, "[e~[", "<pad>", 4096, MINIMAX_M3_CHAT_TEMPLATE)
    image_processor = {
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 112 * 112,
        "max_pixels": MINIMAX_M3_MAX_PIXELS,
    }
    _write_json(out_dir / "preprocessor_config.json", image_processor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "MiniMaxM3VLProcessor"})
    return out_dir

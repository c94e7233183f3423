"""Tiny random-weight DeepSeek-OCR family models (SAM + CLIP towers, DeepSeek-V2 text), built and loaded
inside their tower's shrink (tests/tiny_vlm_towers.py: :func:`shrunk_tower`); helpers are tests/tiny_vlm.py's
and tests/tiny_vlm_deepseek.py's.

mlx-vlm builds their SAM encoder from ``SAMViTConfig()`` (ViT-B: width 768, 12 layers, 1024 px) whatever the
config says, with a fixed neck (3x3 convolutions 256->256 at the 64x64 patch grid, then 256->512 and
512->1024 at stride 2), and the processor pads every image to a 1024 px global view (``base_size``, a call
default): 273 tokens an image. Measured on the CPU backend (one 1024 px image, SAM already 1 layer of width
32): the neck's 3x3 convolutions ~2 s, the two stride-2 ones ~3 s, the CLIP stage at width 1024 ~1.4 s. The
shrink (:data:`SAM_TINY`) makes SAM 1 layer of width 32 at 256 px (a 16x16 grid, the neck's convolutions
there ~0.15 s), its last convolution 64 wide (the CLIP width), and the processor's global view 256 px:
4x4 features, 21 tokens an image (4 rows of 4 plus a newline each, and the view separator).

* :func:`build_tiny_deepseekocr`: DeepSeek-OCR: SAM's features feed the CLIP tower as its patch embeddings,
  both concatenated per feature, a linear projector; a DeepSeek-V2 text model with plain (not latent)
  attention, a dense layer then a mixture of experts. The processor writes a BOS of id 0 itself and drops
  the prompt's last token (``inference_mode``).
* :func:`build_tiny_unlimited_ocr`: Unlimited-OCR (``unlimited-ocr``, the spelling its processor patch wants):
  DeepSeek-OCR's towers and processor (its own subclass keeps the whole prompt), a text model whose decode
  steps attend to the whole prompt and a ring of the last generated tokens (mlx-vlm's ``RingSlidingKVCache``),
  which the engine refuses at load.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tiny_vlm import CHARS, _instantiate, _save_model, _save_tokenizer, _write_json
from tiny_vlm_deepseek import (
    DEEPSEEK_CHAT_TEMPLATE,
    DEEPSEEK_SPECIAL_TOKENS,
    DEEPSEEK_V2_TINY_TEXT_CONFIG,
)

OCR_GLOBAL_VIEW = 256
"""The processor's global view (its ``base_size``, 1024 in mlx-vlm): SAM's 16 px patches then the neck's
two stride-2 convolutions, 64x down: 4x4 features."""

SAM_WIDTH, SAM_OUT = 32, 64
SAM_TINY = {"image_size": OCR_GLOBAL_VIEW, "width": SAM_WIDTH, "layers": 1, "heads": 2, "window_size": 8,
            "global_attn_indexes": (0,)}  # fmt: skip
"""``SAMViTConfig``'s sizes (the model builds SAM from its defaults): one global-attention layer."""


@contextmanager
def _deepseekocr_shrunk() -> Iterator[None]:
    """SAM small (module doc): ``SAMViTConfig`` and ``SAMEncoder`` as the model module names them, with small
    defaults; the processor's global view ``OCR_GLOBAL_VIEW`` px."""
    from mlx_vlm.models.deepseekocr import deepseekocr, processing_deepseekocr
    from tiny_vlm_towers import _class_attributes

    processor = processing_deepseekocr.DeepseekOCRProcessor
    # Also the whole prompt, as the engine asks for (vlm_families.DeepseekOCRModel): mlx-vlm's generation would
    # drop its last token (the processor's inference_mode, meant for an EOS no prompt of it has).
    call_defaults = {**processor.__call__.__kwdefaults__, "base_size": OCR_GLOBAL_VIEW, "inference_mode": False}
    config = functools.partial(deepseekocr.SAMViTConfig, **SAM_TINY)
    encoder = functools.partial(deepseekocr.SAMEncoder, final_out_chans=SAM_OUT)
    with (
        _class_attributes(deepseekocr, SAMViTConfig=config, SAMEncoder=encoder),
        _class_attributes(processor.__call__, __kwdefaults__=call_defaults),
    ):
        yield


def _ocr_tokenizer(out_dir: Path):
    """tests/tiny_vlm.py's character-level tokenizer with DeepSeek's special tokens, its BOS at id 0 as the
    real one's: the processor writes a BOS of id 0 itself, the engine's tokenizer its own (saved, with a BOS
    in front of every prompt, as tests/tiny_vlm_deepseek.py's)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.processors import TemplateProcessing

    bos, *others = DEEPSEEK_SPECIAL_TOKENS
    vocab = {bos: 0, **{ch: i for i, ch in enumerate(CHARS, start=1)}}
    vocab.update({token: len(vocab) + i for i, token in enumerate(["<unk>", *others])})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(DEEPSEEK_SPECIAL_TOKENS + ["<unk>"])
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 0)])
    extra = {"bos_token": bos, "add_bos_token": True}
    _save_tokenizer(out_dir, tok, "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", 4096, DEEPSEEK_CHAT_TEMPLATE, extra)
    return tok


# DeepSeek-VL2's tiny DeepSeek-V2 text model as DeepSeek-OCR's: plain attention (no latent ranks,
# qk_nope_head_dim 0 selects LlamaAttention), layer 0 dense, layer 1 a mixture of experts.
OCR_TEXT_CONFIG = {
    **DEEPSEEK_V2_TINY_TEXT_CONFIG,
    "kv_lora_rank": None,
    "q_lora_rank": None,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 0,
}


def _ocr_config(tok, model_type: str, architecture: str) -> dict:
    """The DeepSeek-OCR config shape: CLIP (1 layer, width ``SAM_OUT``: SAM's features are its patch
    embeddings) and a linear projector of CLIP's and SAM's features side by side. CLIP's positions are
    those of 224 px (a constant) in patches: 56 px ones give the features' 4x4 grid (mlx-vlm's interpolation
    fails to shrink them), and the width is at least the patch (a narrower kernel, mlx-vlm's sanitize takes
    for PyTorch's layout)."""
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "language_config": {**OCR_TEXT_CONFIG, "vocab_size": vocab_size},
        "vision_config": {"model_type": "vision", "layers": 1, "width": SAM_OUT, "hidden_size": SAM_OUT,
                          "intermediate_size": 64, "num_attention_heads": 2, "image_size": 224,
                          "patch_size": 56, "mlp_ratio": 2.0},
        "projector_config": {"projector_type": "linear", "input_dim": 2 * SAM_OUT,
                             "n_embed": OCR_TEXT_CONFIG["hidden_size"]},
        "tile_tag": "2D",
        "global_view_pos": "head",
        "image_token_index": tok.token_to_id("<image>"),
        "pad_id": tok.token_to_id("<｜▁pad▁｜>"),
        "vocab_size": vocab_size,
        "eos_token_id": [tok.token_to_id("<｜end▁of▁sentence｜>")],
    }  # fmt: skip


def _ocr_processor(processor_class: str) -> dict:
    return {
        "processor_class": processor_class,
        "candidate_resolutions": [[OCR_GLOBAL_VIEW, OCR_GLOBAL_VIEW]],
        "patch_size": 16,
        "downsample_ratio": 4,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_token": "<image>",
        "pad_token": "<｜▁pad▁｜>",
        "sft_format": "deepseek",
    }


def build_tiny_deepseekocr(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight DeepSeek-OCR directory (module doc), built inside its shrink."""
    from mlx_vlm.models import deepseekocr
    from tiny_vlm_towers import shrunk_tower

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _ocr_tokenizer(out_dir)
    config = _ocr_config(tok, "deepseekocr", "DeepseekOCRForCausalLM")
    with shrunk_tower("deepseekocr"):
        model = _instantiate(deepseekocr, {**config, "text_config": config["language_config"]}, seed)
    _save_model(out_dir, model, config)
    _write_json(out_dir / "processor_config.json", _ocr_processor("DeepseekOCRProcessor"))
    return out_dir


UNLIMITED_OCR_WINDOW = 4
"""Its decode ring (``sliding_window``: 128 in the real model)."""


def build_tiny_unlimited_ocr(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random-weight Unlimited-OCR directory: DeepSeek-OCR's towers and processor (module doc), a
    text model whose decode steps attend to the whole prompt and a ring of the last ``UNLIMITED_OCR_WINDOW``
    generated tokens (mlx-vlm's ``RingSlidingKVCache``)."""
    from mlx_vlm.models import unlimited_ocr
    from tiny_vlm_towers import shrunk_tower

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _ocr_tokenizer(out_dir)
    config = _ocr_config(tok, "unlimited-ocr", "UnlimitedOCRForCausalLM")  # the spelling its processor patch wants
    window = {"sliding_window": UNLIMITED_OCR_WINDOW, "sliding_window_size": UNLIMITED_OCR_WINDOW}
    config["language_config"].update(window)
    with shrunk_tower("unlimited_ocr"):
        model = _instantiate(unlimited_ocr, {**config, "text_config": config["language_config"]}, seed)
    _save_model(out_dir, model, config)
    _write_json(out_dir / "processor_config.json", _ocr_processor("UnlimitedOCRProcessor"))
    return out_dir

"""Vision-language families in the paged engine, on tiny random-weight models (tests/tiny_vlm.py and
tests/tiny_vlm_*.py, a module per group of families that share a processor, tower or text model).

Oracle: mlx-vlm's own greedy generation (for ``MODEL_CALL_ORACLE``: the model's own call, greedy
over mlx-vlm's cache). What each family adds over Qwen2-VL / LLaVA:

* Qwen3-VL: deepstack (vision-block features added to the first text layers' hidden states at
  the image positions) and interleaved multi-axis rotary positions.
* Qwen3.5: Qwen3-VL's vision side without deepstack and a hybrid text model: gated delta-net
  layers whose state lives in the engine's state pool (rows of one call right-padded), so a
  prefix resumes only where a state checkpoint was kept, and a repeated image after a new branch
  comes from the MLLM cache.
* Gemma 3: an image framed by ``<start_of_image>`` / ``<end_of_image>`` and newlines, features
  scaled on the way in, and a text model alternating sliding-window (here 8 tokens, shorter
  than every prompt) and global layers: the paged caches must apply the window.
* Gemma 4: the generic path with per-token features: ``get_input_embeddings`` gives per-layer
  inputs beside the embeddings (id 0's at the image tokens), which travel with the image's rows
  and reach the text model by name; its last two layers reuse the keys and values of earlier
  ones (KV sharing), and its global layers have a wider head than its sliding ones.
* Mistral 3: images at their own resolution (token count from the size), expanded to rows of
  ``[IMG]`` separated by ``[IMG_BREAK]`` and closed by ``[IMG_END]``: features go to the
  ``[IMG]`` positions only.
* SmolVLM: an image split into tiles plus a global view, each framed by marker tokens
  (``<fake_token_around_image><row_i_col_j>``); a text model without a hidden-state entry point.
* Idefics3 and Pixtral: no adapter or hook of ours at all, the generic path alone
  (``vlm_generic.py``), as LLaVA, Mistral 3 and SmolVLM now go too.
* GLM-4.1V, GLM-4.5V (a mixture-of-experts text model) and GLM-OCR: the generic path with
  multi-axis positions the text model computes itself (``get_rope_index``, once per prompt on
  the engine thread, passed with every call).
* LLaVA-OneVision (SigLIP tiles, a Qwen2 text model), Aya Vision (SigLIP tiles, Cohere 2 with
  sliding-window layers and global layers without rotary positions), LFM2-VL (a hybrid text
  model: short convolutions in the state pool): the generic path alone.
* Kimi-VL: MoonViT at the image's own size (2-D rotary, interpolated learned positions, 2x2
  patch merge) and a DeepSeek-V3 text model (multi-head latent attention, sigmoid-routed MoE):
  the generic path alone.
* Llama 4: a text model with chunked attention (chunks of 16, shorter than every image prompt:
  one row per forward call), a global layer without rotary positions and a mixture of experts;
  one tile per image (mlx-vlm's processor and model disagree for several).
* InternVL (``internvl_chat``: InternViT and a Qwen2 text model; ``internvl``: transformers'
  port, a Qwen3 text model): tiles plus a thumbnail, each 4 ``<IMG_CONTEXT>`` tokens, framed
  by ``<img>`` / ``</img>`` (tests/tiny_vlm_internvl.py). ``internvl_chat``'s placeholder is the
  text ``<image>``, several tokens: the engine writes one token in for it before tokenizing.
* Nemotron 3 Nano Omni: RADIO at the image's own size (16 px patches, shuffled 2x2), framed by
  ``<img>`` / ``</img>``, and a Nemotron-H hybrid text model (a Mamba-2 layer, whose state lives
  in the state pool with rows never right-padded, and an attention layer).
* Phi-4-multimodal and Bunny: the processor (Bunny's: mlx-vlm's prompt builder) leaves one mark
  (-200, outside the vocabulary) per image and the model splices the image's rows in: served as an
  image the model expands, its run written as an in-vocabulary stand-in; Bunny one image a prompt.
* FastVLM (tests/tiny_vlm_towers.py): its processor leaves a -200 mark per image, served as an image
  the model expands; mlx-vlm builds its FastViTHD tower from class constants, shrunk while its tests
  build and load it. One image a prompt (``ONE_IMAGE``): mlx-vlm's model puts a second image one
  token late.
* Idefics2 (a perceiver resampler to 4 latents per image): its processor rewrites the text
  around an image (two images' markers merge into one, a space goes between a closing marker
  and the text after it), which the family hook applies where the pieces meet.
* Muse Glimmer (tests/tiny_vlm_others.py): its own processor (``<|patch|>`` framed by image
  start/end markers), a sliding-window layer with rotary positions and a global one without,
  gated attention and soft-capped scaled logits (the whole call, no backbone/head split).
* d1: LFM2-VL's model under its own type (typed-decision readouts beside it): its short
  convolutions go in the state pool as LFM2-VL's do.
* Muse Spark: Muse Glimmer's prompt, its tower on whole images, and a text model of fused Metal
  kernels, which run as their MLX-ops twins without Metal (``models/portable_kernels.py``).
* Mage-VL: Mage-ViT (3-D rotary, 2x2 merge) under a plain qwen3 text model with 1-D positions,
  and mlx-vlm's own torch-free processor: the generic path alone.
* LLM-jp-VL: SigLIP with InternVL's pixel shuffle and a llama text model, expanded by
  transformers' ``LlavaProcessor`` (mlx-vlm ships none for it): the generic path alone.
* LLaVA-NeXT and Granite Vision (tests/tiny_vlm.py, tests/tiny_vlm_llava_like.py): the model, not
  the processor, decides an image's length (a tile's features and a block of newlines per image
  token): the engine's run is the model's rows, measured on the engine thread; one image a prompt
  (mlx-vlm's model merges the first image's tiles only).
* Molmo, Moondream 3, GOT-OCR 2.0: their processor places the image itself (before the whole text;
  after the BOS; inside a conversation of its own), and the engine serves them as mlx-vlm does: the
  processor writes the prompt (``places_images_itself``). One image a prompt.
* PLaMo 2 VL (tests/tiny_vlm_plamo.py): its processor places the images itself too, at the start of
  a fixed Japanese instruction template (2 tokens in the tiny vocabulary), and a PLaMo 2 hybrid text
  model (Mamba state in the state pool). One image a prompt (``ONE_IMAGE``): its processor shares one
  tile budget among a prompt's images, which the engine's probe at load fills with large ones.
* Florence-2 (tests/tiny_vlm_encdec.py): an encoder-decoder (BART): the prompt, its image first (its
  processor places it), goes through the encoder once, the decoder generates from its start token over
  caches of its own held per request (``HELD``; the adapter's ``encoder_decoder``). One image a prompt.
* NeMo Parse (tests/tiny_vlm_encdec.py): an encoder-decoder whose encoder reads the image alone and whose
  decoder the prompt's ids seed (``IMAGE_ALONE``): the image's encoder states go first in the engine's prompt,
  the processor's ids after them. Held as Florence-2's; one image a prompt; a text alone is refused.
* Molmo 2: the generic path alone, with the placeholder its processor names
  ``image_placeholder_token``: a low-resolution view and overlapping crops, rows closed by
  ``<im_col>``, features added to the ``<im_patch>`` embeddings; its images are 400+ tokens
  even in a tiny model (378 px crops, fixed by mlx-vlm's ``load``), so its pools are larger.
* dots.ocr (tests/tiny_vlm_qwen_like.py): Qwen2-VL's patches without temporal depth, its own
  tower and a Qwen2 text model with 1-D positions, under the real model's image token ids.
* CLEF: Qwen3.5 whole (mlx-vlm's model subclasses it) with a decision head beside it: Qwen3.5's
  hook and recurrent state. IndicOCR's OCR stage: Qwen3.5 under its own name, the same. Prism's
  Hadamard pack of Qwen3.5: 2-bit layers with their own kernel (rotated inputs), kept quantized.
* Kimi K2.5: Kimi-VL's MoonViT and DeepSeek-V3 text under mlx-vlm's own processor, which expands
  ``<|media_pad|>`` at the id level and hands the model the placeholder's id beside the pixels.
* Kimi K3: MoonViT-3D and a hybrid text model (Kimi delta attention, whose state lives in the
  engine's state pool, NoPE MLA, MoE, attention residuals mixing earlier layers' outputs).
* MiMo-V2: Qwen2.5-VL's processor with a tower of its own (attention sinks) and a MiMo-V2-Flash
  text model: sliding-window (8 tokens) and global layers with attention-sink biases, a MoE.
* Falcon OCR (tests/tiny_vlm_falcon.py): patches projected straight to the text width; its processor
  writes the whole prompt (one image, then the instruction of the OCR category the text names), its
  1-D positions stand still over an image's run, beside 2-D positions of the patches (a per-token
  feature, zero at text), and its image blocks attend to themselves both ways (one prefill chunk each).
* Falcon Perception (tests/tiny_vlm_perception2.py): Falcon OCR's layout, positions and mask, its processor
  placing the image before an instruction and the text (its query), and decode steps that feed a coordinate
  and a size decoded from the previous step's hidden state back into the next embedding (state on its text
  model): held per request (``HELD``, one row a call); its tiny model generates such tokens. One image a prompt.
* GLM-5-Next (tests/tiny_vlm_moe_text.py): GLM-4.1V's prompt layout and Qwen2-VL-style patches under a
  hybrid text model without positions (delta attention, NoPE sparse attention with an indexer's pooled
  keys, hyper-connections, a MoE) whose caches the engine holds per request (``HELD``); its images are laid
  out by the package's own image processor, which mlx-vlm's ``load`` puts over the checkpoint's (so does the
  engine's load), at its defaults whatever the processor config says (the tiny model's asks fewer tokens).
* Refused at load, saying why: Mistral Large 3 without torch (mlx-vlm leaves it transformers' torch-only
  PixtralProcessor).
* Gemma 4 with ``use_bidirectional_attention="vision"`` (Gemma 4 unified's default): each block of
  soft tokens sees itself whole; its span stays in one prefill chunk whatever the budget.
* DiffusionGemma is refused, saying why: no token-by-token generator (it denoises a canvas).
* Cohere Compass (tests/tiny_vlm_deepstack.py): the generic path with image-token features:
  ``visual_pos_masks`` and deepstack rows (vision blocks 0 and 1, added after text layers 0 and 1)
  travel with the image's rows and reach the text model by name, the mask over the step's tokens
  and each layer's rows at its image tokens; multi-axis positions from its ``get_rope_index``.
* Zaya1-VL (tests/tiny_vlm_zaya.py): CCA attention (queries and keys through causal convolutions, values
  half from the previous token) whose convolution inputs and last hidden state sit in a ``CacheList``
  beside the KV: the engine holds its own caches per request (``HELD``); a vision LoRA where its
  ``visual_pos_masks`` (which travel with the image's rows) are True. Its oracle is its model's own call
  (``MODEL_CALL_ORACLE``: mlx-vlm's generation prefills with ``inputs=``, which its text model does not take).
* Granite 4 Vision (tests/tiny_vlm_granite.py): deepstack features as whole-prompt arrays (a row
  per prompt token, zeros at text) that its text model slices at its cache's offset, one slice for
  the call: the engine keeps each layer's row with the image's rows and gives each call its rows'
  own positions (``vlm_generic.StepWindow``); its embeddings are zeros at image tokens, so images
  reach it through deepstack alone. One image a prompt: mlx-vlm builds every image token's rows
  from the first image (the engine's probe at load).
* MiniCPM-o (tests/tiny_vlm_minicpm.py): a resampler's queries per image and Qwen3-VL's text
  model on plain 1-D positions (the model's own, kept as state: the engine counts tokens), under
  a processor that gives ``tgt_sizes`` for grids and ``image_bound`` in its prompt's coordinates.
* MiniCPM-V 4.6: crops after a thumbnail, Qwen3.5's hybrid text model (recurrent state in the
  state pool) on 1-D positions, images numbered in the prompt (``<image_id>k</image_id>``, text
  written before each run). MiniCPM-V 4.7: the same with "canvas" positions from the crop grids.

* PaddleOCR-VL (tests/tiny_vlm_qwen_like.py): a SigLIP-like tower with interpolated positions and
  an ERNIE text model with Qwen2-VL's multi-axis positions (``get_rope_index``); one image a prompt
  (``ONE_IMAGE``): its processor fails on two, so the engine refuses a prompt of two, alone.
* Qwen3-Omni-MoE (tests/tiny_vlm_qwen_rest.py): the thinker (talker off) under a config that nests
  its vision tower (``thinker_config``): Qwen3-VL's tower, deepstack residuals that the thinker's
  ``get_input_embeddings`` gives one row per token (zeros at text tokens), which travel as
  per-token features, and a MoE text model with ``get_rope_index``. Audio is no input here.
* Step 3.7: a perception-encoder tower (2-D rotary, layer scale, two stride-2 convolutions) on
  every image at 728 px (mlx-vlm's processor, fixed: 171 tokens an image, so its pools are
  larger), and a Step 3.5 text model: a sliding-window layer with fewer heads and half-rotary
  heads, a global layer with a sigmoid-routed MoE, head-wise gates. One image a prompt
  (``ONE_IMAGE``): its processor puts all of a prompt's images at its one ``<im_patch>``.
* Qwen4-Exp (tests/tiny_vlm_qwen_rest.py): delta-net layers with n-gram PLE and sparse-attention
  layers whose indexer keeps pooled keys in a cache of its own: held per request (``HELD``).

* DeepSeek-VL2 (tests/tiny_vlm_deepseek.py): SigLIP tiles plus a global view, each row closed by
  a learned newline, a learned view separator, and a DeepSeek-V2 text model (latent attention, a
  MoE); its hook pads the per-image tile counts, which mlx-vlm's model reads past (so does the
  oracle: else mlx-vlm drops the image in about one run of two).

* Gemma 4 unified (tests/tiny_vlm_unified_minimax.py): an encoder-free vision embedder (48 px patches,
  a dense layer, learned 2-D positions) and Gemma 4's text model with image blocks both ways
  (``use_bidirectional_attention="vision"``, its default) and keys as values in its global layer;
  its images are up to 280 tokens even in a tiny model (mlx-vlm's ``load`` builds its image processor
  with its defaults), so its pools are larger.
* Gemma 3n (tests/tiny_vlm_gemma3n.py: its MobileNet-V5 tower shrunk): per-layer inputs as Gemma 4's, KV
  sharing read as ``cache.state``, Gemma 3's newline frame around an image (``<image_soft_token>``); its
  hook scales text rows as Hugging Face does, which mlx-vlm's prompt embeddings lack: the oracle is mlx-vlm's
  generation with that one correction (``ORACLE_CORRECTIONS``), and a text prompt equals mlx-lm's gemma3n.
* MiniMax-M3-VL: its sparse-attention layers keep the indexer's keys in a cache kind of mlx-vlm's
  own, ``MiniMaxM3KVCache``: held per request (``HELD``).

* LocateAnything (tests/tiny_vlm_misc.py): MoonViT and a Qwen2 text model under a processor
  that expands numbered ``<image-N>`` placeholders, not its ``image_token``: a hook names the
  placeholder and writes the run's token for each numbered one.
* Inkling (tests/tiny_vlm_misc.py): a patchifier without attention, one token a 40 px tile, and
  a text model without rotary positions (a banded relative-bias mask and log-scaled queries
  placed from the number of keys the cache returns: one row a forward call), with short
  convolutions whose states sit in the state pool beside each layer's KV (a ``CacheList``).
* Moondream 2 (tests/tiny_vlm_moondream2.py): Moondream 3's processor (the image placed by it, after the
  BOS), its tokenizer always loaded from the hub repo ``moondream/starmie-v1``: its tests run offline on a
  warm hub cache holding a tiny tokenizer as that repo, which the engine and mlx-vlm both read; without
  it the engine fails at once naming the repo. A Phi text model (partial rotary positions).

* Hunyuan-VL (tests/tiny_vlm_hunyuan.py): its family hook passes the processor's 4-axis rotary
  positions (base, w, h, t; grid values inside each image) with every call and takes mlx-vlm's
  4-axis path at every offset (mlx-vlm's attention takes it only at offset 0); an image is 274+
  tokens (512x512 px at least), so its pools are larger. One image a prompt (``ONE_IMAGE``):
  mlx-vlm's tower attends across a prompt's images, where the engine encodes each alone.
* Jina VLM (tests/tiny_vlm_towers.py): SigLIP-style crops pooled 2x2, columns closed by ``<im_col>``, a
  text model with extra embeddings past the vocabulary, one row a call (``ONE_ROW_PER_CALL``); its
  processor's crops (378 px, fixed) shrunk to 56 px while its tests build and load it. mlx-vlm's own
  generation raises on two images (``ORACLE_FAILS_ON_TWO``): each is held to it alone.
* ERNIE 4.5 VL (tests/tiny_vlm_ernie.py): a MoE whose vision experts take the image tokens, by token
  types its model's own call builds from the ids (and the engine from its image runs), beside 3-D
  positions its ``get_rope_index`` gives batch first; the oracle is that call (``MODEL_CALL_ORACLE``:
  mlx-vlm's generation passes no token types, so there its image tokens take the text experts).
* Janus (``multi_modality``, tests/tiny_vlm_deepseek_ocr.py): mlx-vlm's ``load`` gives a tokenizer
  alone, so the engine builds the prompt as mlx-vlm's ``prepare_inputs`` does (``SplicingPromptBuilder``:
  a BOS on the text after the image); its model expands the one ``<image>`` token to 16 image
  tokens (``MODEL_EXPANDS``), and that BOS keeps its own id after them. One image a prompt
  (``ONE_IMAGE``): mlx-vlm's model splices every image's features at the first mark.

* Phi-4-SigLIP (tests/tiny_vlm_phi4.py): a SigLIP2 NaFlex tower (an image's own patch grid) under a
  phi3 text model; its processor wraps a prompt without ``<|im_start|>`` in the chat template, then
  leaves one -200 mark per image (an image the model expands): its hook writes the same wrap, once.

* PaliGemma (tests/tiny_vlm_paligemma.py): a prefix LM (``use_bidirectional_attention=True``): the
  whole prompt, text-only ones too, is one both-ways span (one prefill chunk whatever the budget, no
  prefix hit inside it: ``WHOLE_PROMPT_BOTH_WAYS``); its processor writes the BOS after the image and a
  closing newline (its hook). One image a prompt (``ONE_IMAGE``): mlx-vlm merges the first image only.
* DeepSeek-OCR (tests/tiny_vlm_ocr.py): SAM's features are CLIP's patch embeddings, a global view of rows
  closed by a learned newline and a view separator; its processor, told to keep the whole prompt (its hook:
  by default it drops the last token), writes its BOS itself and gives its pixels as a list of arrays of
  several sizes (kept apart). SAM (built from ``SAMViTConfig()``'s defaults) and the 1024 px global view
  shrunk while its tests build and load it. mlx-vlm's own generation raises on two images
  (``ORACLE_FAILS_ON_TWO``): each is held to it alone.

* Phi-3-vision (``phi3_v``, tests/tiny_vlm_phi3v.py): its CLIP tower built from a class constant, shrunk
  while its tests build and load it (1024 wide, 336 px crops: literals of mlx-vlm's code, 313 tokens an
  image); numbered placeholders (``<|image_1|>``, ``<|image_2|>``: ``NUMBERED``) and runs of -N the model
  overwrites with the image's rows, served as an image the model expands under an in-vocabulary stand-in.

* Llama 3.2 Vision (``mllama``, tests/tiny_vlm_mllama.py): an image is its one ``<|image|>`` token; the
  tower's states (every tile) reach a cross-attention layer beside the embeddings with per-token masks from
  the whole prompt: per-request inputs, kept with its caches held per request (``HELD``), each call given its
  own; the states are kept per image in the MLLM cache, after the image token's row.

All: one and two images (one for ``ONE_IMAGE``) equal mlx-vlm, batched with text-only requests
equals solo (chunked prefills ending inside images, preemption), prefix cache on equals off with an
image in the cached prefix, and the MLLM cache runs the encoder once for an image seen twice.
"""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the `vlm` extra) is not installed")

from test_multimodal import mlx_vlm_greedy, picture, run_prompts, tokens

from vllm_mlx import EngineCore
from vllm_mlx.core.kv.spec import FullAttentionSpec, SlidingWindowSpec
from vllm_mlx.executor.attention import UnsupportedModelError
from vllm_mlx.platform.errors import ModelSourceError

PLACEHOLDER = {
    "gemma4_unified": "<|image|>",
    "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "gemma3": "<start_of_image>",
    "mistral3": "[IMG]",
    "smolvlm": "<image>",
    "idefics3": "<image>",
    "pixtral": "[IMG]",
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm4v_moe": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm_ocr": "<|begin_of_image|><|image|><|end_of_image|>",
    "llava_onevision": "<image>",
    "aya_vision": "<image>",
    "lfm2_vl": "<image>",
    "kimi_vl": "<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
    "llama4": "<|image|>",
    "gemma4": "<|image|>",
    "internvl": "<IMG_CONTEXT>",
    "internvl_chat": "<image>",
    "nemotron_h_nano_omni": "<image>",
    "idefics2": "<image>",
    "muse_glimmer": "<|patch|>",
    "d1": "<image>",
    "muse_spark": "<|patch|>",
    "mage_vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "llmjpvl": "<image>",
    "molmo2": "<|image|>",
    "dots_ocr": "<|img|><|imgpad|><|endofimg|>",
    "clef": "<|vision_start|><|image_pad|><|vision_end|>",
    "indic_ocr": "<|vision_start|><|image_pad|><|vision_end|>",
    "prism_hadamard_qwen35": "<|vision_start|><|image_pad|><|vision_end|>",
    "kimi_k25": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "mimo_v2": "<|vision_start|><|image_pad|><|vision_end|>",
    "kimi_k3": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    "llava_next": "<image>",
    "granite_vision": "<image>",
    "cohere_compass": "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>",
    "granite4_vision": "<image>",
    "minicpmo": "<image>",
    "minicpmv4_6": "<|image_pad|>",
    "minicpmv4_7": "<|image_pad|>",
    "paddleocr_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
    "qwen3_omni_moe": "<|vision_start|><|image_pad|><|vision_end|>",
    "step3p7": "<im_patch>",
    "deepseek_vl_v2": "<image>",
    "falcon_ocr": "<|image|>",
    "phi4mm": "<image>",
    "llava_bunny": "<image>",
    "multi_modality": "<image>",
    "locateanything": "<image-1>",
    "inkling": "<|content_image|><|unused_200054|>",
    "hunyuan_vl": "<hy_im_start><hy_image><hy_im_end>",
    # Their processor places the image itself, whatever the text says (``PROMPT_WRITTEN_BY_PROCESSOR``):
    # no placeholder (a text one would be text to them; PLaMo 2 VL's own would count as one image more).
    "molmo": "",
    "moondream3": "",
    "moondream2": "",
    "got": "",
    "plamo2vl": "",
    "florence2": "",
    "nemotron_parse": "",
    "paligemma": "<image>",
    "fastvlm": "<image>",
    "jina_vlm": "<|image|>",
    "ernie4_5_moe_vl": "<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>",
    "minimax_m3_vl": "]<]image[>[",
    "qwen4_exp": "<|vision_start|><|image_pad|><|vision_end|>",
    "phi4_siglip": "<image>",
    "zaya1_vl": "<|vision_start|><image><|vision_end|>",
    "falcon_perception": "",  # its processor places the image itself: the text is its query
    "phi3_v": "<|image_1|>",  # numbered: a prompt's k-th image is <|image_k|> (``numbered``)
    "mllama": "<|image|>",
    "glm5_next": "<|begin_of_image|><|image|><|end_of_image|>",
    "deepseekocr": "<image>",
    "gemma3n": "<image_soft_token>",  # its processor expands the image token itself (no <start_of_image> here)
}

NUMBERED = {"phi3_v"}
"""Families whose processor numbers a prompt's images and raises on a number written twice (Phi-3-vision's
``<|image_1|>``, ``<|image_2|>``): a test prompt's k-th placeholder is written with k (``numbered``)."""


def numbered(name: str, text: str) -> str:
    """``text`` with its k-th placeholder numbered k, for ``NUMBERED`` families (as it is for others)."""
    if name not in NUMBERED:
        return text
    pieces = text.split(PLACEHOLDER[name])
    out = pieces[0]
    for number, piece in enumerate(pieces[1:], start=1):
        out += PLACEHOLDER[name].replace("1", str(number)) + piece
    return out

MODEL_CALL_ORACLE = {"ernie4_5_moe_vl", "zaya1_vl"}
"""Families whose oracle is the model's own call (``model_call_greedy``), not mlx-vlm's generation,
which disagrees with it: ERNIE 4.5 VL's ``Model.__call__`` builds token types from the ids (image
tokens to the vision experts), which its generation, running the text model on embeddings, never
passes (``test_ernie_token_types_reach_the_text_model``); or fails: mlx-vlm 0.7.10's prefill calls
Zaya1-VL's text model with ``inputs=``, which it does not take (``test_zaya1_vl_generation_fails_in_mlx_vlm``)."""


def _gemma3n_corrected():
    from tiny_vlm_gemma3n import gemma3n_corrected

    return gemma3n_corrected()


ORACLE_CORRECTIONS = {"gemma3n": _gemma3n_corrected}
"""Families whose oracle runs with documented corrections of mlx-vlm's bugs (a context), each held to
mlx-vlm's code by a test of its own: Gemma 3n's prompt embeddings get the scale its decode steps and Hugging
Face's model give text tokens (``test_gemma3n_prompt_embeddings_lack_the_scale_of_its_decode_steps``), and its
KV-shared layers' queries their positions (``test_gemma3n_shared_kv_layers_rotate_queries_past_their_positions``)."""


def greedy(name: str, model_dir, text: str, images: list, max_tokens: int) -> list[int]:
    """The family's oracle: mlx-vlm's generation, or the model's own call (``MODEL_CALL_ORACLE``), under
    the family's correction of mlx-vlm where it has one (``ORACLE_CORRECTIONS``)."""
    from contextlib import nullcontext

    oracle = model_call_greedy if name in MODEL_CALL_ORACLE else mlx_vlm_greedy
    with ORACLE_CORRECTIONS.get(name, nullcontext)():
        return oracle(model_dir, text, images, max_tokens)


def model_call_greedy(model_dir, text: str, images: list, max_tokens: int) -> list[int]:
    """Greedy tokens of mlx-vlm's ``Model.__call__`` over its own cache: the prompt as mlx-vlm's
    ``prepare_inputs`` gives it, with the pixels and the processor's other outputs, then one token a
    call without them (as mlx-vlm's decode steps run). No end-of-sequence stop, as ``mlx_vlm_greedy``."""
    from mlx_vlm import load

    return loaded_model_call_greedy(*load(str(model_dir)), text, images, max_tokens)


def loaded_model_call_greedy(model, processor, text: str, images: list, max_tokens: int) -> list[int]:
    """``model_call_greedy`` on a model and processor already loaded (a test may change the model first)."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(processor, images=images, prompts=text)
    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    cache = make_prompt_cache(model.language_model)
    logits = model(inputs["input_ids"], inputs["pixel_values"], cache=cache, **rest).logits
    out = []
    for _ in range(max_tokens):
        out.append(int(logits[0, -1].argmax().item()))
        logits = model(mx.array([[out[-1]]]), cache=cache).logits
    return out


HYBRID = {"qwen3_5", "qwen3_5_moe", "lfm2_vl", "d1", "nemotron_h_nano_omni", "clef", "indic_ocr",
          "prism_hadamard_qwen35", "kimi_k3", "minicpmv4_6", "minicpmv4_7", "inkling",
          "plamo2vl"}
"""Families whose text model has recurrent layers (a state pool beside the KV blocks)."""

HELD = {"minimax_m3_vl", "qwen4_exp",
        "florence2",
        "mllama",
        "glm5_next",
        "nemotron_parse",
        "zaya1_vl",
        "falcon_perception"}
"""Families whose text model keeps caches of its own package's classes: the engine holds them per
request (``executor/held_caches.py``), with no prefix cache."""

KV_SCALE = {"molmo2": 8, "step3p7": 2, "gemma4_unified": 5, "llava_bunny": 7, "hunyuan_vl": 3, "moondream3": 7,
            "got": 4, "phi3_v": 6, "moondream2": 7,
            "florence2": 0.7}
"""Families whose images are hundreds of tokens even in a tiny model (mlx-vlm's ``load`` builds
Molmo 2's image processor with its defaults: 378 px crops, 424 tokens or more an image; Step
3.7's processor resizes every image to 728 px, 171 tokens; Gemma 4 unified's, built with its
defaults too, up to 280 tokens, 531 for the batched test's two images; mlx-vlm's Bunny asserts
729 features an image; Hunyuan-VL's processor resizes to 512x512 px or more, 274 tokens or more;
Moondream 3's and Moondream 2's processor writes 729 image tokens; GOT-OCR's 256 inside a conversation of its
own; Phi-3-vision's 313 tokens at least, a 336 px crop and the global view of its 1024-wide tower, literals of
mlx-vlm's code): their KV pools are this many times larger, so the same prompts fit, and the small pool
still preempts. Florence-2's is smaller (its held prompts prefill whole and finish fast: 30 blocks never fill).
"""


MODEL_EXPANDS = {"llava_next", "granite_vision", "phi4mm", "llava_bunny", "multi_modality", "fastvlm", "phi4_siglip",
                 "phi3_v"}  # fmt: skip
"""Families whose model, not their processor, decides an image's length (``vlm_generic``:
``expands_in_model``): the engine's prompt is the sequence mlx-vlm's model generates over."""

ONE_IMAGE = {
    # mlx-vlm's LLaVA-NeXT model merges the first image's tiles only and drops what follows its
    # first image token run: the text between two images and the second never reach its text model.
    "llava_next": "mlx-vlm's model merges the first image's features only",
    "granite_vision": "mlx-vlm's model merges the first image's features only",
    # mlx-vlm's Granite 4 Vision builds every image token's deepstack rows from the first image's pixels
    # (a second image's tokens get the first's last row; its size still changes the prompt's length).
    "granite4_vision": "builds every image token's features from the first image",
    "paddleocr_vl": "fails on two",  # its processor stacks a prompt's images as one array
    "step3p7": "fails on two",  # its processor puts all of a prompt's images at its one <im_patch>
    "falcon_ocr": "writes the prompt itself, with one image",  # and expands the first image only
    "falcon_perception": "places the image itself",  # before its instruction and the query, one image
    # mlx-vlm builds Bunny's prompt itself, keeping the text up to a second <image> only, and its
    # model splices the first image's features alone.
    "llava_bunny": "mlx-vlm's model merges the first image's features only",
    # mlx-vlm's tower runs one attention over all of a prompt's patches: the oracle takes two images,
    # but each one's features depend on the other, where the engine encodes (and caches) each alone.
    "hunyuan_vl": "tower attends across a prompt's images",
    # mlx-vlm builds Janus's prompt itself, as Bunny's, keeping the text up to a second <image> only.
    "multi_modality": "mlx-vlm's model merges the first image's features only",
    # mlx-vlm's FastVLM splits the text between images at the marks' indices in the prompt, not in the
    # text without them: each image after the first lands one token late (the engine's probe at load).
    "fastvlm": "places an image after the first off its run",
    # Their processor places images itself, and not two in one prompt as each alone (Molmo's makes a prompt
    # an image, Moondream 3's, Moondream 2's and GOT-OCR's write one image's tokens).
    **dict.fromkeys(("molmo", "moondream3", "moondream2", "got"), "places images itself"),
    # PLaMo 2 VL's processor gives a prompt's images fewer tiles together than alone once their tokens pass its
    # tile_context_length (the engine processes and caches each image alone): the check at load lays out large ones.
    "plamo2vl": "shares one budget of tokens",
    # Florence-2's processor writes one image's tokens before BOS, the text and EOS.
    "florence2": "places images itself",
    # NeMo Parse's encoder reads one image (its processor stacks a prompt's images as a batch).
    "nemotron_parse": "its encoder reads one image",
    # mlx-vlm's PaliGemma keeps the first image's features alone and writes them by prompt position:
    # right for one image at the prompt's start, as its checkpoints are prompted.
    "paligemma": "mlx-vlm's model merges the first image's features only",
}
"""Families the engine serves one image a prompt (the reason its refusal gives): mlx-vlm's own
generation (the oracle) cannot take two either. A prompt of two is refused, that request alone,
and their batched test uses one image a prompt."""

ORACLE_FAILS_ON_TWO = {"jina_vlm": "Cannot reshape", "deepseekocr": "cannot be broadcast"}
"""Families the engine serves two images a prompt (each image encoded alone, its processor takes the pair)
where mlx-vlm's own generation raises on two (the message): Jina VLM's model reshapes a prompt's stacked
crops as one image's; DeepSeek-OCR's writes each image's features to all of its prompt's image positions.
Their two-image test holds the engine to mlx-vlm's greedy tokens for each image alone instead, and the
two-image prompt's to swapping its images (both reach the text model, in order); their batched test (a prompt of two images among others) holds it to itself solo."""

SECOND_IMAGE_SPLICED_AFTER_FIRST = {"multi_modality"}
"""Of ``ONE_IMAGE``: mlx-vlm's model (Janus's) splices every image's features at the first mark, one
after another, and its prompt builder drops the text after the second: the second image reaches its
text model, but not where the prompt puts it."""


WHOLE_PROMPT_BOTH_WAYS = {"paligemma"}
"""Prefix LMs: a prompt's tokens see each other both ways, so a prefix-cache hit never ends inside a prompt
(``resumable_blocks``): prompts share no blocks (a preempted request resumes past its prompt), and a
repeated image comes from the MLLM cache."""


PROMPT_WRITTEN_BY_PROCESSOR = {"falcon_ocr", "molmo", "moondream3", "moondream2", "got", "plamo2vl",
                               "florence2",
                               "nemotron_parse",
                               "falcon_perception"}
"""Families whose processor writes the whole prompt itself (Falcon OCR's: the image, then the instruction
of the OCR category the text names; Molmo's, Moondream 3's and 2's, GOT-OCR's and PLaMo 2 VL's: the image
before the text, in a template of their own): two prompts with the same image and other words share the image's
blocks (or are the same prompt), so only a test with the prefix cache off sees the MLLM cache serve the second."""


IMAGE_ALONE = {"nemotron_parse"}
"""Encoder-decoders whose encoder reads the image alone, the prompt's ids seeding the decoder (the adapter's
``image_alone``): a text alone has no call in mlx-vlm and is refused, that request alone; the engine's prompt
is one stand-in per encoder state (mlx-vlm's ``inputs_embeds`` rows), then the processor's ids."""


def kv_blocks(name: str, blocks: int) -> int:
    return int(blocks * KV_SCALE.get(name, 1))


def tiny_builder(name: str):
    """``build_tiny_<name>`` from tests/tiny_vlm.py or one of the ``tests/tiny_vlm_*.py`` modules
    (families grouped by what they share: processor, tower or text model)."""
    import importlib
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    for path in [tests / "tiny_vlm.py", *sorted(tests.glob("tiny_vlm_*.py"))]:
        builder = getattr(importlib.import_module(path.stem), f"build_tiny_{name}", None)
        if builder is not None:
            return builder
    raise LookupError(f"no build_tiny_{name} in tests/tiny_vlm*.py")


@pytest.fixture(scope="module", params=list(PLACEHOLDER))
def family(request, tmp_path_factory):
    """A family's tiny model, its tests run inside its tower's shrink (tests/tiny_vlm_towers.py: mlx-vlm
    builds some towers at sizes no config sets, so building and every load, the engine's and the
    oracle's, take the same small one) and, for Moondream 2, on the warm hub cache its builder writes
    (tests/tiny_vlm_moondream2.py: its processor loads its tokenizer from the hub, offline from there)."""
    from tiny_vlm_moondream2 import hub_cache_of, warm_hub_cache
    from tiny_vlm_towers import shrunk_tower

    name = request.param
    with shrunk_tower(name):
        model_dir = tiny_builder(name)(tmp_path_factory.mktemp(name))
        with warm_hub_cache(hub_cache_of(model_dir)) if name == "moondream2" else contextlib.nullcontext():
            yield name, model_dir


@pytest.fixture(scope="module")
def engine(family):
    _, model_dir = family
    engine = EngineCore(model=str(model_dir), num_kv_blocks=kv_blocks(family[0], 96), block_size=4,
                        force_model_takeover=True)
    yield engine
    engine.shutdown()


def family_engine(model_dir, **options) -> EngineCore:
    return EngineCore(model=str(model_dir), block_size=4, force_model_takeover=True, **options)


# -- engine == mlx-vlm ----------------------------------------------------------------------


def test_one_image_equals_mlx_vlm(family, engine):
    name, model_dir = family
    image = picture(1, (100, 60))
    text = PLACEHOLDER[name] + "What is in the picture?"
    expected = greedy(name, model_dir, text, [image], max_tokens=8)
    [out] = run_prompts(engine, [(text, [image])])
    [bare] = run_prompts(engine, [("What is in the picture?", [image])])  # the engine adds the placeholder
    assert out.outputs[0].token_ids == bare.outputs[0].token_ids == expected


def test_two_images_in_order_equal_mlx_vlm(family, engine):
    name, model_dir = family
    a, b = picture(3), picture(4, (100, 60))
    text = numbered(name, f"First {PLACEHOLDER[name]} then {PLACEHOLDER[name]} compare.")
    if name in ONE_IMAGE:
        if name in SECOND_IMAGE_SPLICED_AFTER_FIRST:  # it reaches the text model, in the wrong place
            assert mlx_vlm_greedy(model_dir, text, [a, b], 8) != mlx_vlm_greedy(model_dir, text, [a, a], 8)
        elif "first image's features only" in ONE_IMAGE[name]:  # mlx-vlm's second image never reaches the text model
            assert mlx_vlm_greedy(model_dir, text, [a, b], 8) == mlx_vlm_greedy(model_dir, text, [a, a], 8)
        with pytest.raises(ValueError, match=rf"at most 1 image\(s\) per prompt \(.*{ONE_IMAGE[name]}.*has 2"):
            engine.prepare_prompt(text, [a, b])
        return
    if name in ORACLE_FAILS_ON_TWO:
        with pytest.raises(Exception, match=ORACLE_FAILS_ON_TWO[name]):
            mlx_vlm_greedy(model_dir, text, [a, b], max_tokens=8)
        alone = [mlx_vlm_greedy(model_dir, f"First {PLACEHOLDER[name]} compare.", [x], 8) for x in (a, b)]
        engine_alone = tokens(run_prompts(engine, [(f"First {PLACEHOLDER[name]} compare.", [x]) for x in (a, b)]))
        both, swapped = tokens(run_prompts(engine, [(text, [a, b]), (text, [b, a])]))
        assert engine_alone == alone and both != swapped
        return
    expected = greedy(name, model_dir, text, [a, b], max_tokens=8)
    swapped = greedy(name, model_dir, text, [b, a], max_tokens=8)
    assert tokens(run_prompts(engine, [(text, [a, b]), (text, [b, a])])) == [expected, swapped]
    assert expected != swapped


def test_the_prompt_is_expanded_as_mlx_vlm_expands_it(family, engine):
    """Same token ids as mlx-vlm's processor, which expands the text before tokenizing. The tiny
    Gemma 3 tokenizer, like Gemma's, has single tokens for runs of newlines: the "\n\n" around
    an image must merge with the newlines next to the placeholder."""
    from mlx_vlm import load

    name, model_dir = family
    _, processor = load(str(model_dir))
    pad, mark = PLACEHOLDER[name], "\0"  # the mark counts the images where the placeholder is "" (no text)
    texts = [f"First {mark} then {mark} compare.", f"user\n{mark}\nWhat?", f"A:{mark}{mark}\n\nB", mark]
    for marked in texts:
        text = numbered(name, marked.replace(mark, pad))
        images = [picture(i, (100, 60)) for i in range(marked.count(mark))]
        if name in ONE_IMAGE and len(images) > 1:  # refused, that request alone, saying why
            with pytest.raises(ValueError, match=r"at most 1 image\(s\) per prompt .*has 2"):
                engine.prepare_prompt(text, images)
            continue
        # The text alone, not in a list, as mlx-vlm's generation passes it (DeepSeek-VL2's processor
        # takes a list as a batch of prompts with one image each).
        expected = processor_ids(model_dir, processor, text, images)
        if name in IMAGE_ALONE:
            expected = [engine.vision.image_token_id] * encoder_rows(model_dir, images) + expected
        if name in MODEL_EXPANDS:
            expected = model_expanded(model_dir, text, images, expected, engine.vision.image_token_id)
        assert engine.prepare_prompt(text, images).token_ids == expected, text
    if name in ("gemma3", "gemma3n"):  # "user\n" + "\n\n<start_of_image>" tokenized as one "\n\n\n"
        [three_newlines] = engine.tokenizer.encode("\n\n\n", add_special_tokens=False)
        assert three_newlines in engine.prepare_prompt(f"user\n{pad}\nWhat?", [picture(0)]).token_ids


def processor_ids(model_dir, processor, text: str, images: list) -> list[int]:
    """The prompt's ids as mlx-vlm's processor gives them, or, where mlx-vlm's ``load`` gives a
    tokenizer alone (Bunny), as mlx-vlm's ``prepare_inputs`` builds them (it inserts the mark)."""
    from mlx_vlm.utils import load_config, prepare_inputs

    if getattr(processor, "tokenizer", None) is not None:
        return np.asarray(processor(text=text, images=images)["input_ids"]).reshape(-1).tolist()  # [1, n] or [n]
    mark = load_config(model_dir).get("image_token_index")
    inputs = prepare_inputs(processor, images=images, prompts=text, image_token_index=mark)
    return np.array(inputs["input_ids"])[0].tolist()


def encoder_rows(model_dir, images: list) -> int:
    """The encoder states mlx-vlm's model gives for ``images`` (an ``IMAGE_ALONE`` family's)."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(model_dir))
    inputs = prepare_inputs(processor, images=images, prompts="x")
    return model.get_input_embeddings(inputs["input_ids"], mx.array(inputs["pixel_values"])).inputs_embeds.shape[1]


def model_expanded(model_dir, text: str, images: list, ids: list[int], stand_in: int) -> list[int]:
    """The processor's ``ids`` with each image's run as long as the rows mlx-vlm's model merges for
    it: the sequence mlx-vlm's generation runs its text model over. One image: its run (first to last
    image token) takes the model's rows for the prompt; a mark outside the vocabulary (-200, one per
    image) takes the model's rows for that image alone, written as the engine's ``stand_in``; a run of marks
    whose every mark the model overwrites with a row of the image (Phi-3-vision's -N) is the stand-in there."""
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(model_dir))
    image_token = getattr(model.config, "image_token_index", None)
    if image_token is None:  # Phi-4-SigLIP's config names none: its model's module-level mark (-200)
        image_token = sys.modules[type(model).__module__].IMAGE_TOKEN_INDEX

    def rows(prompt: str, pictures: list) -> int:
        inputs = prepare_inputs(processor, images=pictures, prompts=prompt, image_token_index=image_token)
        rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        merged = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **rest)
        return merged.inputs_embeds.shape[1] - inputs["input_ids"].shape[1]  # rows the model adds

    if min(ids) < 0 and rows(text, images) == 0:  # runs of marks the model overwrites one for one (Phi-3-vision's)
        return [stand_in if token < 0 else token for token in ids]
    if image_token < 0:
        marks = iter(images)  # each mark's rows: the image alone under the placeholder these families share
        return [t for token in ids for t in ([stand_in] * (1 + rows("<image>", [next(marks)]))
                                              if token == image_token else [token])]  # fmt: skip
    first = ids.index(image_token)
    run = len(ids) - first - ids[::-1].index(image_token)
    return ids[:first] + [image_token] * (rows(text, images) + run) + ids[first + run :]


def test_plamo2vl_greedy_tokens_depend_on_its_images(tmp_path):
    """The tiny PLaMo 2 VL's family tests can fail: mlx-vlm's greedy tokens differ for other images and
    for two images swapped (a random PLaMo 2 at init repeats the prompt's last token whatever the image)."""
    from tiny_vlm_plamo import build_tiny_plamo2vl

    model_dir = build_tiny_plamo2vl(tmp_path)
    alone = {tuple(mlx_vlm_greedy(model_dir, "What is in the picture?", [picture(s, (100, 60))], 8)) for s in (1, 2, 3)}
    a, b = picture(3), picture(4, (100, 60))
    assert len(alone) == 3
    assert mlx_vlm_greedy(model_dir, "First then compare.", [a, b], 8) != mlx_vlm_greedy(
        model_dir, "First then compare.", [b, a], 8
    )


def test_plamo2vl_takes_two_images_where_its_budget_holds_large_ones(tmp_path):
    """With a tile budget that four large images fit (the check at load's probe), each image's run is its
    own in any prompt: the engine takes two, as mlx-vlm does, in both orders."""
    from tiny_vlm_plamo import build_tiny_plamo2vl

    model_dir = build_tiny_plamo2vl(tmp_path, tile_budget=1000)
    engine = family_engine(model_dir, num_kv_blocks=300)
    try:
        assert engine.vision.max_images_per_prompt is None
        a, b = picture(3), picture(4, (100, 60))
        text = "First then compare."
        expected = [mlx_vlm_greedy(model_dir, text, images, 8) for images in ([a, b], [b, a])]
        assert tokens(run_prompts(engine, [(text, [a, b]), (text, [b, a])])) == expected
    finally:
        engine.shutdown()


# -- batching, chunking, preemption -------------------------------------------------------------


def test_batched_with_text_requests_equals_solo(family):
    name, model_dir = family
    pad = PLACEHOLDER[name]
    prompts = [
        ("Describe the image.", [picture(4)]),
        ("Plain text, no image at all, long enough to pass the window.", []),
        (numbered(name, f"Two of them: {pad} and {pad}."), [picture(5, (100, 60)), picture(6)])
        if name not in ONE_IMAGE
        else (f"One of them: {pad}.", [picture(5, (100, 60))]),
        ("Short text.", []),
        ("Another look.", [picture(7, (90, 90))]),
    ]
    # Small steps: prefill chunks end inside images; a small pool forces preemption.
    options = {"num_kv_blocks": kv_blocks(name, 30), "max_num_batched_tokens": 12, "enable_prefix_caching": False}
    engine = family_engine(model_dir, **options)
    try:
        if name in IMAGE_ALONE:  # a text alone is refused, saying why; the text requests take an image instead
            for text, _ in [p for p in prompts if not p[1]]:
                with pytest.raises(ValueError, match="it needs an image"):
                    engine.prepare_prompt(text, [])
            prompts = [(text, images or [picture(10 + i)]) for i, (text, images) in enumerate(prompts)]
        solo = [tokens(run_prompts(engine, [p]))[0] for p in prompts]
        batched = tokens(run_prompts(engine, prompts))
        preemptions = engine.get_stats()["scheduler"]["preemptions"]
    finally:
        engine.shutdown()
    assert batched == solo
    assert preemptions > 0
    assert greedy(name, model_dir, pad + "Another look.", [picture(7, (90, 90))], 8) == solo[4]


# -- caches -----------------------------------------------------------------------------------


def test_prefix_cache_on_equals_off_with_an_image_in_the_prefix(family):
    name, model_dir = family
    image = picture(8)
    prefix = f"You look at pictures closely. {PLACEHOLDER[name]} "
    prompts = [(prefix + question, [image]) for question in ("What is it?", "What colour?", "What is it?")]

    def outputs(enabled: bool):
        engine = family_engine(model_dir, num_kv_blocks=kv_blocks(name, 96), enable_prefix_caching=enabled)
        try:
            prepared = engine.prepare_prompt(*prompts[0])
            first = prepared.token_ids
            image_end = prepared.mm_input.images[-1].end  # the image's run, closing markers included
            outs = [run_prompts(engine, [p])[0] for p in prompts]
            cached = [o.num_cached_tokens for o in outs]
            hybrid = engine.kv_cache.checkpoints is not None
            return tokens(outs), cached, engine.get_stats()["mllm"], image_end, len(first), hybrid
        finally:
            engine.shutdown()

    (on, cached_on, mllm_on, image_end, length, hybrid), (off, cached_off, *_) = outputs(True), outputs(False)
    assert on == off
    assert cached_off == [0, 0, 0]
    # A prefix LM's every prompt is one span, where no hit ends; a held model's caches are each request's own:
    # prefix caching is off there, asked for or not. Either way the image comes from the MLLM cache.
    if name in WHOLE_PROMPT_BOTH_WAYS or name in HELD:
        assert cached_on == [0, 0, 0]
        assert mllm_on["encoder_runs"] == 1 and mllm_on["hits"] == 2
        return
    if hybrid:  # recurrent layers resume only where a state checkpoint was kept
        assert name in HYBRID
        # The second prompt branches off the first after the image: no checkpoint there yet.
        assert cached_on[0:2] == [0, 0] and cached_on[2] >= length - 4  # the repeat resumes
        # The image, encoded once, came from the MLLM cache for the second prompt.
        assert mllm_on["encoder_runs"] == 1 and mllm_on["hits"] == 1
        return
    assert cached_on[1] >= image_end  # the shared prefix, image included, comes from the cache
    assert cached_on[2] >= length - 4  # all but the last block
    # Later prompts resume past the image: the encoder output is not even looked up.
    assert mllm_on["encoder_runs"] == 1 and mllm_on["hits"] == 0


def test_the_mllm_cache_encodes_an_image_seen_twice_once(family):
    name, model_dir = family
    image = picture(9)
    # Different text before the image each time: no KV prefix reaches it (nor any, where the
    # processor writes the prompt: the prefix cache is off).
    prompts = [(f"{n} {PLACEHOLDER[name]} Describe.", [image]) for n in ("One", "Two")]
    options = {"enable_prefix_caching": False} if name in PROMPT_WRITTEN_BY_PROCESSOR else {}

    def outputs(enabled: bool):
        engine = family_engine(model_dir, num_kv_blocks=kv_blocks(name, 96), enable_mllm_cache=enabled, **options)
        try:
            return [tokens(run_prompts(engine, [p]))[0] for p in prompts], engine.get_stats()["mllm"]
        finally:
            engine.shutdown()

    (on, on_stats), (off, off_stats) = outputs(True), outputs(False)
    assert on == off
    assert on_stats["encoder_runs"] == 1 and on_stats["hits"] == 1
    assert off_stats["encoder_runs"] == 2


# -- family specifics -------------------------------------------------------------------------


def test_qwen3_vl_deepstack_features_reach_the_text_model(tmp_path):
    """The oracle without deepstack answers differently, so equality above needs it."""
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from tiny_vlm import build_tiny_qwen3_vl

    model_dir = build_tiny_qwen3_vl(tmp_path / "qwen3-vl")
    text, image = PLACEHOLDER["qwen3_vl"] + "What is in the picture?", picture(1, (100, 60))
    with_deepstack = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    model, processor = load(str(model_dir))
    model.vision_tower.deepstack_visual_indexes = []  # the tower then returns no deepstack features
    processor.tokenizer.stopping_criteria = lambda token: False
    steps = stream_generate(model, processor, text, image=[image], max_tokens=8, temperature=0.0)
    assert [s.token for s in steps][:8] != with_deepstack


def test_qwen3_omni_deepstack_features_reach_the_text_model(tmp_path):
    """Qwen3-Omni's thinker gives its deepstack residuals per token (``TOKEN_FEATURES``): the
    oracle without them answers differently, so equality above needs them to reach the text model."""
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from tiny_vlm_qwen_rest import build_tiny_qwen3_omni_moe

    model_dir = build_tiny_qwen3_omni_moe(tmp_path / "qwen3_omni_moe")
    text, image = PLACEHOLDER["qwen3_omni_moe"] + "What is in the picture?", picture(1, (100, 60))
    with_deepstack = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    model, processor = load(str(model_dir))
    model.thinker.vision_tower.deepstack_visual_indexes = []  # the thinker then adds zeros
    processor.tokenizer.stopping_criteria = lambda token: False
    steps = stream_generate(model, processor, text, image=[image], max_tokens=8, temperature=0.0)
    assert [s.token for s in steps][:8] != with_deepstack


def test_ernie_token_types_reach_the_text_model(tmp_path):
    """ERNIE 4.5 VL's image tokens go to its vision experts by the token types the engine passes
    (``vlm_generic.TOKEN_TYPES``): mlx-vlm's generation, which passes none, answers otherwise than
    the model's own call (the oracle), and so does the engine with the token types off."""
    from tiny_vlm_ernie import build_tiny_ernie4_5_moe_vl

    model_dir = build_tiny_ernie4_5_moe_vl(tmp_path / "ernie4_5_moe_vl")
    text, image = PLACEHOLDER["ernie4_5_moe_vl"] + "What is in the picture?", picture(1, (100, 60))
    engine = family_engine(model_dir, num_kv_blocks=96, enable_prefix_caching=False)  # each run computes all
    try:
        assert engine.vision.token_types and engine.vision.positions_batch_first
        typed = tokens(run_prompts(engine, [(text, [image])]))[0]
        engine.vision.token_types = False
        untyped = tokens(run_prompts(engine, [(text, [image])]))[0]
    finally:
        engine.shutdown()
    generated = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    assert typed == model_call_greedy(model_dir, text, [image], max_tokens=8) != generated
    assert untyped == generated


def test_zaya1_vl_generation_fails_in_mlx_vlm(tmp_path):
    """Why Zaya1-VL's oracle is its model's own call (``MODEL_CALL_ORACLE``): mlx-vlm 0.7.10's generation
    prefills by calling the text model with ``inputs=``, a keyword its ``LanguageModel.__call__`` does not
    take (its ids are ``input_ids``), so it raises on any prompt of more than one token. When it runs, its
    tokens should equal the model call's, and the family can be held to it."""
    from tiny_vlm_zaya import build_tiny_zaya1_vl

    model_dir = build_tiny_zaya1_vl(tmp_path / "zaya1_vl")
    text, image = PLACEHOLDER["zaya1_vl"] + "What is in the picture?", picture(1, (100, 60))
    with pytest.raises(TypeError, match="input_ids"):
        mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)


def test_zaya1_vl_caches_are_held_and_its_image_mask_reaches_the_text_model(tmp_path):
    """Zaya1-VL's ``make_cache`` gives each layer a ``CacheList`` of mlx-vlm's ``KVCache`` and an
    ``ArraysCache`` (its CCA convolution's last inputs and the last hidden state) of an architecture no test
    checks in the state pool: the engine holds them per request, from their classes (``layer_specs``). Its
    vision LoRA applies where ``visual_pos_masks`` is True, which travels with the image's rows: the engine
    equals the model's call, which answers otherwise with the LoRA off."""
    from mlx_vlm import load
    from tiny_vlm_zaya import build_tiny_zaya1_vl

    from vllm_mlx.core.kv.spec import HeldCacheSpec

    model_dir = build_tiny_zaya1_vl(tmp_path / "zaya1_vl")
    text, image = PLACEHOLDER["zaya1_vl"] + "What is in the picture?", picture(1, (100, 60))
    engine = family_engine(model_dir, num_kv_blocks=96)
    try:
        assert engine.runner.specs == [HeldCacheSpec()]
        served = tokens(run_prompts(engine, [(text, [image])]))[0]
    finally:
        engine.shutdown()
    model, processor = load(str(model_dir))
    with_lora = loaded_model_call_greedy(model, processor, text, [image], max_tokens=8)
    model.language_model.args.vision_lora = False  # the config every layer reads at each call
    assert served == with_lora != loaded_model_call_greedy(model, processor, text, [image], max_tokens=8)


def test_granite4_vision_image_rows_at_different_offsets_share_a_call_and_equal_mlx_vlm(tmp_path):
    """Granite 4 Vision's text model slices whole-prompt deepstack arrays at its cache's offset, one
    slice for the call: the engine gives it each row's own positions (``vlm_generic.StepWindow``).
    Two image prompts whose images sit at different offsets, prefilled together in chunks that end
    inside the images, each equal mlx-vlm; its embeddings are zeros at image tokens, so an image
    reaches the text model through deepstack alone, and another picture answers differently."""
    from tiny_vlm_granite import build_tiny_granite4_vision

    model_dir = build_tiny_granite4_vision(tmp_path / "granite4_vision")
    pad = PLACEHOLDER["granite4_vision"]
    prompts = [(f"{pad}What is it?", [picture(1, (100, 60))]),
               (f"A longer question comes first, then {pad} a look.", [picture(2)])]  # fmt: skip
    engine = family_engine(model_dir, num_kv_blocks=96, max_num_batched_tokens=12, enable_prefix_caching=False)
    try:
        batched = tokens(run_prompts(engine, prompts))
        other_picture = tokens(run_prompts(engine, [(prompts[0][0], [picture(2)])]))[0]
    finally:
        engine.shutdown()
    assert batched == [mlx_vlm_greedy(model_dir, text, images, max_tokens=8) for text, images in prompts]
    assert other_picture != batched[0]


def test_qwen3_5_rows_of_different_lengths_share_a_padded_call_and_equal_solo(tmp_path):
    """An image prompt and two text prompts of other lengths prefill in one right-padded
    forward call: each delta-net layer must take its convolution window and state at the row's
    last real token (``lengths`` and the padding mask), not at the padding."""
    from tiny_vlm import build_tiny_qwen3_5

    model_dir = build_tiny_qwen3_5(tmp_path / "qwen3_5")
    image = picture(4, (100, 60))
    prompts = [
        ("A plain text prompt, the longest of the three.", []),
        ("Describe the picture, please.", [image]),  # 8 image tokens: 37 in all
        ("A shorter text prompt, no image.", []),
    ]
    engine = family_engine(model_dir, num_kv_blocks=96, enable_prefix_caching=False)  # no hits: all prefill
    try:
        solo = [tokens(run_prompts(engine, [p]))[0] for p in prompts]
        engine.step_records.clear()
        batched = tokens(run_prompts(engine, prompts))
        prefill = engine.step_records[0]
    finally:
        engine.shutdown()
    assert len(set(prefill.num_new_tokens)) == 3 and prefill.num_forward_calls == 1  # padded
    assert batched == solo
    pad = PLACEHOLDER["qwen3_5"]
    assert mlx_vlm_greedy(model_dir, pad + "Describe the picture, please.", [image], 8) == solo[1]


def test_gemma3_reports_its_sliding_window_and_the_window_matters(tmp_path):
    from tiny_vlm import build_tiny_gemma3

    image = picture(2, (100, 60))
    text = PLACEHOLDER["gemma3"] + "What is in the picture?"  # 33 tokens: past the window of 8
    results = {}
    for window in (8, 4096):
        model_dir = build_tiny_gemma3(tmp_path / f"w{window}", sliding_window=window)
        engine = family_engine(model_dir, num_kv_blocks=64)
        try:
            assert engine.runner.specs == [SlidingWindowSpec(window), FullAttentionSpec()] * 2
            results[window] = tokens(run_prompts(engine, [(text, [image])]))[0]
        finally:
            engine.shutdown()
        assert results[window] == mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    assert results[8] != results[4096]


def test_mistral_large3_without_torch_is_refused_saying_its_processor_needs_it(tmp_path):
    """mlx-vlm registers its own Pixtral-style processor for ``mistral3`` only: a Mistral Large 3
    directory (Mistral 3's vision side under a DeepSeek-V3 text model) gets transformers'
    PixtralProcessor, which needs torch and torchvision; without them neither mlx-vlm nor the
    engine can load it, and the engine says why."""
    import importlib.util

    from tiny_vlm_moe_text import build_tiny_mistral_large3

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: transformers' PixtralProcessor loads")
    model_dir = build_tiny_mistral_large3(tmp_path / "mistral_large3")
    with pytest.raises(ModelSourceError, match="mistral_large3: PixtralProcessor requires"):
        EngineCore(model=str(model_dir), num_kv_blocks=32, block_size=4)


def test_mistral3_with_a_ministral3_text_model_is_refused_before_loading(tmp_path):
    """mlx-vlm's ministral3 text model scales attention by the first row's position only."""
    from tiny_vlm import build_tiny_mistral3

    model_dir = build_tiny_mistral3(tmp_path / "mistral3")
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["model_type"] = "ministral3"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'mistral3'.*text model 'ministral3'.*first row"):
        EngineCore(model=str(model_dir))


def test_phi4_siglip_wraps_a_plain_prompt_once_as_its_processor_does(tmp_path):
    """Phi-4-SigLIP's processor wraps a prompt without ``<|im_start|>`` in one user turn of its chat template
    (mlx-vlm generates over that), and leaves one the template wrote as it is: so does the engine, never
    twice. A plain prompt is prepared as the turn the template writes for it; a chat prompt (a system turn
    first) keeps its own turns; both equal mlx-vlm on the same text."""
    from tiny_vlm_phi4 import build_tiny_phi4_siglip

    model_dir = build_tiny_phi4_siglip(tmp_path / "phi4_siglip")
    image, question = picture(1, (100, 60)), "<image>What is in the picture?"
    turn = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"  # the tiny template's user turn
    chat = "<|im_start|>system\nLook closely.<|im_end|>\n" + turn
    engine = family_engine(model_dir, num_kv_blocks=64)
    try:
        plain_ids, turn_ids, chat_ids = (engine.prepare_prompt(t, [image]).token_ids for t in (question, turn, chat))
        outs = tokens(run_prompts(engine, [(question, [image]), (chat, [image])]))
    finally:
        engine.shutdown()
    im_start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert plain_ids == turn_ids and chat_ids.count(im_start) == 3  # wrapped once; the chat prompt not again
    assert outs == [mlx_vlm_greedy(model_dir, text, [image], max_tokens=8) for text in (question, chat)]


REFUSED_AT_LOAD = {
    # MolmoPoint's point predictor keeps per-request image state on the model between steps.
    "molmo_point": r"'molmo_point'.*per-request image state.*point predictor",
    # Unlimited-OCR (DeepSeek-OCR's towers and processor, tests/tiny_vlm_ocr.py): its decode steps attend to the
    # whole prompt plus a ring of the last generated tokens (RingSlidingKVCache, mlx-vlm's own), which a held
    # cache rebuilt after a preemption (one prefill of prompt and generated tokens) does not reproduce.
    "unlimited_ocr": r"'unlimited-ocr' needs RingSlidingKVCache caches.*cannot rebuild after a preemption",
}
"""Families the engine refuses at load, on a tiny model of their own: the message each must say
(``support.REFUSED_AT_LOAD`` gives the support table the same verdict, naming this test)."""


@pytest.mark.parametrize("name", list(REFUSED_AT_LOAD))
def test_a_family_the_generic_path_cannot_drive_is_refused_at_load_saying_why(tmp_path, name):
    """The check at load runs the generic path on a small image: a family it cannot drive is
    refused with what differs, never served wrong."""
    from tiny_vlm_towers import shrunk_tower

    with shrunk_tower(name):  # built and loaded at the same small size (a no-op but for shrunk towers)
        model_dir = tiny_builder(name)(tmp_path / name)
        with pytest.raises(UnsupportedModelError, match=REFUSED_AT_LOAD[name]):
            EngineCore(model=str(model_dir), num_kv_blocks=32, block_size=4)


def test_gemma3n_prompt_embeddings_lack_the_scale_of_its_decode_steps(tmp_path):
    """mlx-vlm 0.7.10's bug that Gemma 3n's oracle corrects (``ORACLE_CORRECTIONS``), held to its code on the tiny
    model: the prompt path (``get_input_embeddings``, which mlx-vlm's generation prefills with and its model call
    runs on every token) gives text tokens ``embed_tokens(ids)`` unscaled, and the text model given the ids
    (mlx-vlm's decode steps) scales them by sqrt(hidden_size), as Hugging Face's Gemma 3n scales every text
    token: the two answer differently. The engine's hook (``vlm_families.Gemma3nModel``) scales them. When
    mlx-vlm scales its prompt embeddings this fails, and the correction can go."""
    import mlx.core as mx
    from mlx_vlm import load
    from tiny_vlm_gemma3n import build_tiny_gemma3n
    from tiny_vlm_towers import shrunk_tower

    with shrunk_tower("gemma3n"):
        model, _ = load(str(build_tiny_gemma3n(tmp_path / "gemma3n")))
    ids = mx.array([[40, 41, 42, 43, 44]])
    prompt = model.get_input_embeddings(ids)
    text_model = model.language_model
    unscaled = text_model.model.embed_tokens(ids)
    assert mx.array_equal(prompt.inputs_embeds, unscaled)
    as_decoded = text_model(ids).logits
    as_prompted = text_model(None, inputs_embeds=prompt.inputs_embeds, per_layer_inputs=prompt.per_layer_inputs).logits
    scaled = text_model(None, inputs_embeds=unscaled * text_model.model.hidden_size**0.5,
                        per_layer_inputs=prompt.per_layer_inputs).logits  # fmt: skip
    assert mx.allclose(as_decoded, scaled, atol=1e-4) and not mx.allclose(as_decoded, as_prompted, atol=1e-2)


def test_gemma3n_shared_kv_layers_rotate_queries_past_their_positions(tmp_path):
    """mlx-vlm 0.7.10's other Gemma 3n bug that its oracle corrects, held to its code on the tiny model: a
    KV-shared layer rotates its queries at ``cache.offset`` read after the layer it shares wrote this call's
    keys, one call's length past their positions, so the same prompt prefilled whole or in two calls (mlx-vlm's
    generation prefills all but the last token, then that one) gives other logits. With its queries at their
    positions (``gemma3n_shared_kv_queries_at_their_positions``: Hugging Face's, mlx-lm's gemma3n's one offset
    for the whole call, the engine's pre-call offsets) both agree."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.models.cache import make_prompt_cache
    from tiny_vlm_gemma3n import build_tiny_gemma3n, gemma3n_shared_kv_queries_at_their_positions
    from tiny_vlm_towers import shrunk_tower

    with shrunk_tower("gemma3n"):
        model, _ = load(str(build_tiny_gemma3n(tmp_path / "gemma3n")))
    text_model, ids = model.language_model, mx.array([list(range(40, 60))])

    def last_logits(split: int | None) -> mx.array:
        cache, logits = make_prompt_cache(text_model), None
        for part in [ids] if split is None else [ids[:, :split], ids[:, split:]]:
            logits = text_model(part, cache=cache).logits
        return logits[0, -1]

    assert not mx.allclose(last_logits(None), last_logits(19), atol=1e-2)
    with gemma3n_shared_kv_queries_at_their_positions():
        assert mx.allclose(last_logits(None), last_logits(19), atol=1e-4)
        assert mx.allclose(last_logits(None), last_logits(7), atol=1e-4)


def test_gemma3n_text_prompt_equals_mlx_lm_and_the_corrected_oracle(tmp_path):
    """A text prompt on the tiny Gemma 3n's text weights: the engine equals mlx-lm's ``gemma3n`` (which scales
    every token and places the shared layers' queries as Hugging Face does) and mlx-vlm's generation with its
    two corrections (``ORACLE_CORRECTIONS``), which mlx-vlm's uncorrected generation does not."""
    from oracles import mlx_lm_tokens
    from tiny_vlm_gemma3n import build_tiny_gemma3n, gemma3n_corrected, gemma3n_text_model_dir
    from tiny_vlm_towers import shrunk_tower

    text = "A question about the weather today?"
    with shrunk_tower("gemma3n"):
        model_dir = build_tiny_gemma3n(tmp_path / "gemma3n")
        engine = family_engine(model_dir, num_kv_blocks=32)
        try:
            served = tokens(run_prompts(engine, [(text, [])]))[0]
        finally:
            engine.shutdown()
        uncorrected = mlx_vlm_greedy(model_dir, text, [], max_tokens=8)
        with gemma3n_corrected():
            corrected = mlx_vlm_greedy(model_dir, text, [], max_tokens=8)
    [mlx_lm] = mlx_lm_tokens(gemma3n_text_model_dir(model_dir, tmp_path / "text"), [text], max_tokens=8)
    assert served == mlx_lm == corrected != uncorrected


@pytest.mark.parametrize("name", ["falcon_ocr", "falcon_perception"])
def test_falcon_image_blocks_attend_both_ways_in_mlx_vlm(name):
    """What Falcon OCR's both-ways spans serve (and Falcon Perception's mask does too), held to
    mlx-vlm's own masks: the token after an image's start marker sees the image token after it, where
    a causal prefill would hide it."""
    import importlib

    import mlx.core as mx

    language = importlib.import_module(f"mlx_vlm.models.{name}.language")
    make_mask = getattr(language, f"create_{name}_mask")
    start, image, end, text = 1, 2, 3, 4
    mask = make_mask(mx.array([text, start, image, image, end, text]), start, end)[0, 0]
    assert mask[1, 3].item() and mask[2, 3].item()  # inside the block: both ways
    assert not mask[0, 1].item() and not mask[4, 5].item()  # outside it: causal


@pytest.mark.parametrize("budget", [None, 3])
def test_falcon_ocr_image_blocks_both_ways_equal_mlx_vlm_when_a_chunk_budget_would_split_them(tmp_path, budget):
    """Falcon OCR: the engine's both-ways spans add to causal attention exactly what mlx-vlm's mask
    (``create_falcon_ocr_mask`` over the prepared prompt) adds; a budget of 3 would end prefill chunks
    inside the block, which goes whole into one; the tokens equal mlx-vlm's, and the first differs from
    what mlx-vlm's text model gives the same prompt without its mask (causal)."""
    import mlx.core as mx
    from mlx_vlm.models.falcon_ocr.language import create_falcon_ocr_mask
    from tiny_vlm_falcon import build_tiny_falcon_ocr

    model_dir = build_tiny_falcon_ocr(tmp_path / "falcon_ocr", seed=8)  # its mask changes the first token
    config = json.loads((model_dir / "config.json").read_text())
    text, image = PLACEHOLDER["falcon_ocr"] + "What is in the picture?", picture(1, (100, 60))
    expected = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    engine = family_engine(model_dir, num_kv_blocks=64, **options)
    try:
        prepared = engine.prepare_prompt(text, [image])
        [out] = run_prompts(engine, [(text, [image])])
    finally:
        engine.shutdown()
    ids = mx.array(prepared.token_ids)
    mlx_vlm_mask = np.array(create_falcon_ocr_mask(ids, config["image_cls_token_id"], config["img_end_id"])[0, 0])
    engine_mask = np.tri(len(prepared.token_ids), dtype=bool)
    for start, end in prepared.mm_input.both_ways:
        engine_mask[start:end, start:end] = True
    assert prepared.mm_input.both_ways == [(0, 11)]  # <|image_cls|>, 4 registers, 2x3 patches; not <|image_end|>
    assert np.array_equal(engine_mask, mlx_vlm_mask)
    assert out.outputs[0].token_ids == expected
    assert expected[0] != first_token_without_the_mask(model_dir, text, image)


def first_token_without_the_mask(model_dir, text: str, image) -> int:
    """mlx-vlm's text model on its own prompt inputs, all but the image-block mask (``attention_mask_4d``):
    causal attention over caches, as a text model without that mask runs."""
    from mlx_vlm import load
    from mlx_vlm.models.cache import KVCache
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(model_dir))
    inputs = prepare_inputs(processor, images=[image], prompts=text)
    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    merged = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **rest).to_dict()
    features = {k: v for k, v in merged.items() if v is not None and k not in ("inputs_embeds", "attention_mask_4d")}
    caches = [KVCache() for _ in model.layers]
    logits = model.language_model(inputs["input_ids"], inputs_embeds=merged["inputs_embeds"], cache=caches, **features)
    return int(logits.logits[0, -1].argmax().item())


@pytest.mark.parametrize("budget", [None, 3, 2])
def test_an_image_attending_both_ways_equals_mlx_vlm_when_a_chunk_budget_would_split_it(tmp_path, budget):
    """Gemma 4 with ``use_bidirectional_attention="vision"``: mlx-vlm overlays each block of soft
    tokens (4 here, prompt positions 1-4) on its causal mask, so they see each other both ways.
    The engine's masks do the same, and a budget that would end a prefill chunk inside the block
    (at 3 or 2 tokens) gets the block whole in one chunk; causal attention answers otherwise."""
    from tiny_vlm import build_tiny_gemma4

    model_dir = build_tiny_gemma4(tmp_path / "gemma4")
    config = json.loads((model_dir / "config.json").read_text())
    text, image = PLACEHOLDER["gemma4"] + "What is in the picture?", picture(1, (90, 90))
    causal = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (model_dir / "config.json").write_text(json.dumps(config))
    expected = mlx_vlm_greedy(model_dir, text, [image], max_tokens=8)
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    engine = family_engine(model_dir, num_kv_blocks=64, **options)
    try:
        prepared = engine.prepare_prompt(text, [image])
        [out] = run_prompts(engine, [(text, [image])])
    finally:
        engine.shutdown()
    assert prepared.mm_input.both_ways == [(1, 5)]  # the soft tokens, not the markers around them
    assert out.outputs[0].token_ids == expected != causal


def test_an_image_the_model_expands_is_measured_on_the_engine_thread(tmp_path):
    """``prepare_prompt`` runs on the caller's thread; the length of an image the model expands is
    MLX work, so the engine thread measures it (between steps), and the prompt is the one the
    engine prepares on its own thread."""
    import threading

    from tiny_vlm import build_tiny_llava_next

    from vllm_mlx import AsyncEngineCore

    model_dir = build_tiny_llava_next(tmp_path / "llava_next")
    text, image = PLACEHOLDER["llava_next"] + "What is in the picture?", picture(1, (100, 60))
    measured_on = []
    with AsyncEngineCore(model=str(model_dir), num_kv_blocks=96, block_size=4) as engine:
        vision = engine.engine.vision
        on_engine_thread = vision.on_engine_thread

        def recording(fn):
            return on_engine_thread(lambda: (measured_on.append(threading.current_thread().name), fn())[1])

        vision.on_engine_thread = recording
        prepared = engine.prepare_prompt(text, [image])
        on_its_thread = engine.call(lambda core: core.prepare_prompt(text, [image]))
    assert measured_on == ["vllm-mlx-engine", "vllm-mlx-engine"]
    assert prepared.token_ids == on_its_thread.token_ids
    assert prepared.mm_input.images[0].num_tokens > len(model_expanded_run(model_dir, image))


def model_expanded_run(model_dir, image) -> list[int]:
    """The processor's run for ``image`` alone (the model's is longer: the test above)."""
    from mlx_vlm import load

    _, processor = load(str(model_dir))
    ids = np.asarray(processor(text="<image>", images=[image])["input_ids"]).reshape(-1).tolist()
    return [token for token in ids if token == processor.tokenizer.convert_tokens_to_ids("<image>")]


def test_moondream2_offline_without_its_hub_tokenizer_fails_at_once_naming_it(tmp_path):
    """mlx-vlm's Moondream2Processor loads its tokenizer from the hub (``moondream/starmie-v1``) whatever the
    directory holds: offline, on a hub cache without that repo, the engine says so at once (transformers'
    own attempt retries for most of a minute), and serves the same directory once the cache holds it."""
    import time

    from tiny_vlm_moondream2 import (
        build_tiny_moondream2,
        hub_cache_of,
        tokenizer_repo,
        warm_hub_cache,
    )

    model_dir = build_tiny_moondream2(tmp_path / "moondream2")
    with warm_hub_cache(tmp_path / "empty-hub-cache"):
        start = time.perf_counter()
        missing = rf"'moondream2'.*Hub repo '{tokenizer_repo()}'.*neither in the local hub cache"
        with pytest.raises(ModelSourceError, match=missing):
            EngineCore(model=str(model_dir), num_kv_blocks=32, block_size=4)
        assert time.perf_counter() - start < 5
    with warm_hub_cache(hub_cache_of(model_dir)):
        engine = family_engine(model_dir, num_kv_blocks=kv_blocks("moondream2", 32))
        engine.shutdown()


def test_locateanything_numbered_placeholders_are_expanded_as_its_processor_expands_them(tmp_path):
    """Its processor expands every ``<image-N>`` (numbers ignored, images in order): so does the
    engine, whichever numbers a prompt uses, and greedy tokens equal mlx-vlm's."""
    from mlx_vlm import load
    from tiny_vlm_misc import build_tiny_locateanything

    model_dir = build_tiny_locateanything(tmp_path / "locateanything")
    _, processor = load(str(model_dir))
    a, b = picture(3), picture(4, (100, 60))
    text = "First <image-1> then <image-2> compare."
    expected_ids = np.asarray(processor(text=text, images=[a, b])["input_ids"]).reshape(-1).tolist()
    engine = family_engine(model_dir, num_kv_blocks=96)
    try:
        assert engine.prepare_prompt(text, [a, b]).token_ids == expected_ids
        assert tokens(run_prompts(engine, [(text, [a, b])])) == [mlx_vlm_greedy(model_dir, text, [a, b], 8)]
    finally:
        engine.shutdown()


def test_jina_vlm_rows_at_different_positions_take_a_call_each_and_equal_mlx_vlm(tmp_path):
    """Jina VLM's rotary positions start at ``offset.max()`` for every row of a call, so rows take
    a call each (``ONE_ROW_PER_CALL``): an image prompt batched with a text one equals both solo and
    mlx-vlm (its image processor shrunk as in its family tests: tests/tiny_vlm_towers.py)."""
    from tiny_vlm_towers import build_tiny_jina_vlm, shrunk_tower

    image = picture(1, (100, 60))
    prompts = [("<|image|>What is in the picture?", [image]), ("A plain text prompt, no image.", [])]
    with shrunk_tower("jina_vlm"):
        model_dir = build_tiny_jina_vlm(tmp_path / "jina_vlm")
        engine = family_engine(model_dir, num_kv_blocks=96, enable_prefix_caching=False)
        try:
            solo = [tokens(run_prompts(engine, [p]))[0] for p in prompts]
            batched = tokens(run_prompts(engine, prompts))
        finally:
            engine.shutdown()
        assert batched == solo
        assert solo[0] == mlx_vlm_greedy(model_dir, *prompts[0], max_tokens=8)


@pytest.mark.parametrize("budget", [None, 5])
def test_a_prefix_lm_prompt_attends_both_ways_whole_and_equals_mlx_vlm(tmp_path, budget):
    """PaliGemma (``use_bidirectional_attention=True``): mlx-vlm prefills the whole prompt in one call with
    no mask, text-only prompts too. The engine's span is the whole prompt, image or not; a budget of 5
    tokens (prompts of 28 and 29) gets it whole in one chunk; the tokens equal mlx-vlm's, and causal
    attention (the same checkpoint with the field False) answers otherwise. A block's hash carries its
    span, so the prompt's blocks and those of a longer prompt with the same start are not shared."""
    from tiny_vlm_paligemma import build_tiny_paligemma

    model_dir = build_tiny_paligemma(tmp_path / "paligemma")
    image = picture(1, (100, 60))
    prompts = [(PLACEHOLDER["paligemma"] + "What is in the picture?", [image]), ("Plain text, no image at all.", [])]
    expected = [mlx_vlm_greedy(model_dir, text, images, max_tokens=8) for text, images in prompts]
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    engine = family_engine(model_dir, num_kv_blocks=64, **options)
    try:
        prepared = [engine.prepare_prompt(*prompt) for prompt in prompts]
        outs = tokens(run_prompts(engine, prompts))
        solo = [tokens(run_prompts(engine, [prompt]))[0] for prompt in prompts]
        with pytest.raises(ValueError, match="attends to itself both ways"):  # its blocks are its own
            engine.save_prefix(prompts[1][0], tmp_path / "prefix.vmx")
    finally:
        engine.shutdown()
    assert [p.mm_input.both_ways for p in prepared] == [[(0, len(p.token_ids))] for p in prepared]
    assert outs == solo == expected
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = False
    (model_dir / "config.json").write_text(json.dumps(config))
    assert [mlx_vlm_greedy(model_dir, text, images, max_tokens=8) for text, images in prompts] != expected
    text_only = prepared[1].mm_input
    longer = type(text_only)(both_ways=[(0, len(prepared[1].token_ids) + 4)])
    assert text_only.block_extra_keys(0, 4) != longer.block_extra_keys(0, 4)


def test_falcon_perception_feeds_decoded_boxes_back_and_replays_them_after_preemption(tmp_path):
    """Falcon Perception's decode steps give a generated ``<|coord|>`` (``<|size|>``) the coordinate (size)
    decoded from the previous step's hidden state as its embedding, state its text model keeps per request
    (``FalconPerceptionModel``). Its tiny model generates both tokens; mlx-vlm's tokens without the feedback
    differ, so equality needs it; two such requests in a pool too small for both equal mlx-vlm's, the one
    preempted in its decode replaying its tokens, feedback included, from a fresh state."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate import stream_generate
    from tiny_vlm_perception2 import build_tiny_falcon_perception

    from vllm_mlx import SamplingParams

    model_dir = build_tiny_falcon_perception(tmp_path / "falcon_perception")
    config = json.loads((model_dir / "config.json").read_text())
    prompts = [("What is in the picture?", [picture(seed, (100, 60))]) for seed in (1, 2)]
    expected = [mlx_vlm_greedy(model_dir, text, images, max_tokens=16) for text, images in prompts]
    for out in expected:  # a size and a coordinate fed back, with tokens after them
        assert config["size_token_id"] in out[:-1] and config["coord_token_id"] in out[:-1]
    model, processor = load(str(model_dir))
    object.__delattr__(model.language_model, "_perception_config")  # no coordinates or sizes decoded, none fed back
    processor.tokenizer.stopping_criteria = lambda token: False
    text, images = prompts[0]
    steps = stream_generate(model, processor, text, image=images, max_tokens=16, temperature=0.0)
    assert [s.token for s in steps][:16] != expected[0]
    mx.clear_cache()
    # Both prompts' blocks fit (103 tokens, 26 blocks each), not both decodes: one request is preempted about
    # 9 tokens into its decode (past its first size and coordinate tokens), and replays them.
    engine = family_engine(model_dir, num_kv_blocks=56, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outputs = tokens(run_prompts(engine, prompts, params))
        preemptions = engine.get_stats()["scheduler"]["preemptions"]
    finally:
        engine.shutdown()
    assert outputs == expected
    assert preemptions > 0

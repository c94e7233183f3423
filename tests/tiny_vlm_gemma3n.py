"""A tiny random-weight Gemma 3n, whose MobileNet-V5 vision tower mlx-vlm builds at a size no config sets.

Same pattern as tiny_vlm.py and tiny_vlm_towers.py: the tower's architecture definition is shrunk while
the model is built and loaded (``tiny_vlm_towers.shrunk_tower("gemma3n")`` applies :func:`gemma3n_shrunk`).

* :func:`build_tiny_gemma3n`: Gemma 3n. Its tower (``mlx_vlm.models.gemma3n.vision``) is built from a
  module-level block list (``gemma3n_mobilenet_def``: 4 stages, 294M parameters) and a multi-scale fusion
  adapter whose widths and output grid are literals of ``VisionTower.__init__`` (1920 channels in, 2048 out,
  16x16 tokens): shrunk to one or three blocks a stage of width 8-16 and an adapter from the last two
  stages (16 + 16 channels) to the config's vision width (32) on a 2x2 grid. It still downsamples 32x and
  fuses stages 3 and 4 as the real one does: a 96 px image is 6x6 at stage 3, pooled 3x3 to 2x2 = 4 soft
  tokens (768 px, 48x48 and 16x16 in the real one). The soft tokens are embedded by a multimodal embedder
  of its own, and the image's end marker, in the vision token range, by that embedder's hard embeddings,
  so the image's run (``\\n\\n<start_of_image>`` + 4 soft tokens + ``<end_of_image>\\n\\n``) gets rows of
  the vision side but for its first marker. The text model has per-layer inputs (image tokens take id
  0's), AltUp and Laurel blocks, sliding-window and global layers and KV sharing in its last two layers;
  the audio tower is built from its config alone, tiny here (never used: no audio input). The vocabulary
  keeps the real one's layout, shrunk: text ids below 128 (per-layer inputs), the vision range 128-135
  (``<end_of_image>`` 128, ``<image_soft_token>`` 129), the audio range 136-143. Served
  (``vlm_families.Gemma3nModel``) as Hugging Face's model runs: its text rows scaled, which mlx-vlm's prompt
  embeddings lack, and its KV-shared layers' queries at their positions, which mlx-vlm's place one call's
  length late; its oracle is mlx-vlm's generation with these two corrections (:func:`gemma3n_corrected`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tiny_vlm import CHARS, _instantiate, _save_model, _save_tokenizer, _write_json, square_image_processor

# The real vocabulary's layout, shrunk: text (with per-layer inputs), then vision, then audio ids.
GEMMA3N_TEXT_VOCAB, GEMMA3N_MEDIA_VOCAB = 128, 8
GEMMA3N_VISION_OFFSET = GEMMA3N_TEXT_VOCAB
GEMMA3N_AUDIO_OFFSET = GEMMA3N_VISION_OFFSET + GEMMA3N_MEDIA_VOCAB
GEMMA3N_VOCAB = GEMMA3N_AUDIO_OFFSET + GEMMA3N_MEDIA_VOCAB
GEMMA3N_TEXT_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                               "<start_of_audio>"]  # fmt: skip
# Where the real model has them: the first ids of the vision and audio ranges.
GEMMA3N_MEDIA_TOKENS = {
    "<end_of_image>": GEMMA3N_VISION_OFFSET,
    "<image_soft_token>": GEMMA3N_VISION_OFFSET + 1,
    "<end_of_audio>": GEMMA3N_AUDIO_OFFSET,
    "<audio_soft_token>": GEMMA3N_AUDIO_OFFSET + 1,
}

# Gemma 3's template with Gemma 3n's image part: <image_soft_token>, which mlx-vlm's processor (and the
# engine) expand to "\n\n<start_of_image>" + <image_soft_token> x image_seq_length + "<end_of_image>\n\n".
GEMMA3N_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image_soft_token>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Gemma 3n's text model, small: layers 0 and 2 slide (window 8), 1 and 3 attend globally; the last two
# (num_kv_shared_layers 2) reuse the keys and values of the last earlier layer of their kind; every layer
# adds a per-layer input (width 8); layer 0's MLP keeps its top 5% activations (activation sparsity).
GEMMA3N_TEXT_CONFIG = {
    "model_type": "gemma3n_text",
    "hidden_size": 64,
    "intermediate_size": [128] * 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 8,
    "laurel_rank": 8,
    "altup_num_inputs": 4,
    # mlx-vlm's defaults, which mlx-lm's gemma3n (the text-only oracle) requires in the config (the real one's)
    "altup_active_idx": 0,
    "altup_coef_clip": 120.0,
    "altup_correct_scale": True,
    "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    "final_logit_softcapping": 30.0,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "max_position_embeddings": 4096,
    "vocab_size": GEMMA3N_VOCAB,
    "vocab_size_per_layer_input": GEMMA3N_TEXT_VOCAB,
}

GEMMA3N_VISION_WIDTH = 32
GEMMA3N_VISION_CONFIG = {
    "model_type": "gemma3n_vision",
    "hidden_size": GEMMA3N_VISION_WIDTH,  # the fusion adapter's output width: the soft tokens'
    "rms_norm_eps": 1e-6,
    "vocab_offset": GEMMA3N_VISION_OFFSET,
    "vocab_size": GEMMA3N_MEDIA_VOCAB,
}

# The audio tower is built from these alone (no class constant): one conformer block of width 16.
GEMMA3N_AUDIO_CONFIG = {
    "input_feat_size": 16,
    "hidden_size": 16,
    "conf_num_attention_heads": 2,
    "conf_num_hidden_layers": 1,
    "conf_positional_bias_size": 16,
    "sscp_conv_channel_size": [8, 8],
    "vocab_offset": GEMMA3N_AUDIO_OFFSET,
    "vocab_size": GEMMA3N_MEDIA_VOCAB,
}

GEMMA3N_IMAGE_SIZE = 96
GEMMA3N_TOKEN_GRID = 2  # the fusion adapter's output grid: 2x2 soft tokens an image
GEMMA3N_SOFT_TOKENS = GEMMA3N_TOKEN_GRID**2


def tiny_mobilenet_def():
    """MobileNet-V5's four stages, small, with the real one's kinds of block in the real order: edge
    residuals, universal inverted residuals, then multi-query attention (keys and values strided 2 in
    stage 3, not in stage 4) between inverted residuals. Every stage opens with a stride-2 block."""
    from mlx_vlm.models.gemma3n.vision import _er, _mmqa, _uir

    return [
        [_er(3, 8, 2)],
        [_uir(3, 5, 16, 2, 2.0)],
        [_uir(5, 5, 16, 2, 2.0), _mmqa(2, 8, 2), _uir(0, 0, 16, 1, 2.0, is_multiscale=True)],
        [_uir(5, 5, 16, 2, 2.0), _mmqa(2, 8, 1), _uir(0, 0, 16, 1, 2.0, is_multiscale=True)],
    ]


TINY_FUSION_IN = 16 + 16
"""The fusion adapter's input: stages 3 and 4 concatenated (640 + 1280 = 1920 in the real tower)."""


def _tiny_fusion_adapter(adapter_class):
    """``adapter_class`` (the multi-scale fusion adapter) built for the tiny stages: its widths and output
    grid are literals of ``VisionTower.__init__``, so the tower's call is answered with the tiny ones."""

    def build(*args, **kwargs):
        kwargs.update(in_chs=[TINY_FUSION_IN], out_chs=GEMMA3N_VISION_WIDTH, output_resolution=GEMMA3N_TOKEN_GRID)
        return adapter_class(*args, **kwargs)

    return build


@contextmanager
def gemma3n_shrunk() -> Iterator[None]:
    """mlx-vlm's Gemma 3n vision module with the tiny block list and fusion adapter (module doc), restored
    after: only what the tower is built from, never its forward code."""
    from mlx_vlm.models.gemma3n import vision
    from tiny_vlm_towers import _class_attributes

    adapter = _tiny_fusion_adapter(vision.MobileNetV5MultiScaleFusionAdapter)
    with _class_attributes(
        vision, gemma3n_mobilenet_def=tiny_mobilenet_def, MobileNetV5MultiScaleFusionAdapter=adapter
    ):
        yield


def _gemma3n_tokenizer():
    """Gemma's character-level tiny tokenizer (tiny_vlm's alphabet and newline runs) with the text special
    tokens below 128, filler tokens ``<fN>`` up to the media ranges and the media tokens where the real
    model has them (``GEMMA3N_MEDIA_TOKENS``), fillers to the end of the vocabulary."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{ch: i for i, ch in enumerate(CHARS, start=1)}}
    vocab.update({"\n" * n: len(vocab) + n - 2 for n in (2, 3, 4)})
    vocab.update({token: len(vocab) + i for i, token in enumerate(GEMMA3N_TEXT_SPECIAL_TOKENS)})
    inverse = {token_id: token for token, token_id in GEMMA3N_MEDIA_TOKENS.items()}
    vocab.update({inverse.get(i, f"<f{i}>"): i for i in range(len(vocab), GEMMA3N_VOCAB)})
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", *GEMMA3N_TEXT_SPECIAL_TOKENS, *GEMMA3N_MEDIA_TOKENS])
    return tok


def _random_layer_scales(model) -> None:
    """The tower's layer scales start at 1e-5: a block would then add nothing to its shortcut and a block
    without one would hand the next norm a signal below its epsilon. Random around 1 instead."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    tower = model.vision_tower.parameters()
    scales = [(k, mx.random.uniform(0.5, 1.5, v.shape)) for k, v in tree_flatten(tower) if k.endswith(".gamma")]
    model.vision_tower.update(tree_unflatten(scales))


def build_tiny_gemma3n(out_dir: Path, *, seed: int = 0, weight_scale: float = 1.0) -> Path:
    """A tiny random-weight Gemma 3n directory (module doc): built inside the tower's shrink, as its tests
    load it. Weights scaled x1 (Gemma's embedding scaling saturates larger ones, as in tiny_vlm's Gemma 3)."""
    import mlx.core as mx
    from mlx_vlm.models import gemma3n

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _gemma3n_tokenizer()
    ids = {t: tok.token_to_id(t) for t in [*GEMMA3N_TEXT_SPECIAL_TOKENS, *GEMMA3N_MEDIA_TOKENS]}
    text = {**GEMMA3N_TEXT_CONFIG, "pad_token_id": ids["<pad>"]}
    config = {
        "model_type": "gemma3n",
        "architectures": ["Gemma3nForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(GEMMA3N_VISION_CONFIG),
        "audio_config": dict(GEMMA3N_AUDIO_CONFIG),
        "vocab_size": GEMMA3N_VOCAB,
        "hidden_size": text["hidden_size"],
        "image_token_id": ids["<image_soft_token>"],
        "image_token_index": ids["<image_soft_token>"],
        "audio_token_id": ids["<audio_soft_token>"],
        "boi_token_id": ids["<start_of_image>"],
        "eoi_token_id": ids["<end_of_image>"],
        "vision_soft_tokens_per_image": GEMMA3N_SOFT_TOKENS,
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
    }
    with gemma3n_shrunk():
        model = _instantiate(gemma3n, config, seed)
    _random_layer_scales(model)
    # Zero (tied) embedding rows for the media tokens: their logit is then 0, below the best of the others,
    # so the model never writes one (as tiny_vlm's Gemma 4).
    embed = model.language_model.model.embed_tokens
    embed.weight = embed.weight.at[mx.arange(GEMMA3N_TEXT_VOCAB, GEMMA3N_VOCAB)].multiply(0.0)
    _save_model(out_dir, model, config, weight_scale)
    extra = {
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
            "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>",
            "audio_token": "<audio_soft_token>",
        }
    }
    _save_tokenizer(out_dir, tok, "<end_of_turn>", "<pad>", text["max_position_embeddings"], GEMMA3N_CHAT_TEMPLATE,
                    extra)  # fmt: skip
    preprocessor = square_image_processor("SiglipImageProcessor", GEMMA3N_IMAGE_SIZE, resample=2,
                                          processor_class="Gemma3nProcessor")  # fmt: skip
    _write_json(out_dir / "preprocessor_config.json", preprocessor)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Gemma3nProcessor",
                                                    "image_seq_length": GEMMA3N_SOFT_TOKENS})  # fmt: skip
    return out_dir


@contextmanager
def gemma3n_prompt_embeddings_scaled() -> Iterator[None]:
    """The oracle's correction of mlx-vlm 0.7.10's Gemma 3n, and nothing else: ``Model.get_input_embeddings``
    gives text tokens ``embed_tokens(ids)`` without the sqrt(hidden_size) its text model applies to the ids it
    embeds itself (its decode steps) and Hugging Face's to every text token
    (``test_gemma3n_prompt_embeddings_lack_the_scale_of_its_decode_steps``). Inside, its rows of text ids
    (below the vision range) are scaled so; the vision range's rows (its embedder's) are left as they are."""
    import mlx.core as mx
    from mlx_vlm.models.gemma3n.gemma3n import Model
    from tiny_vlm_towers import _class_attributes

    unscaled = Model.get_input_embeddings

    def get_input_embeddings(self, input_ids=None, pixel_values=None, **kwargs):
        out = unscaled(self, input_ids, pixel_values, **kwargs)
        if input_ids is not None:
            text_rows = (input_ids < self.embed_vision.vocab_offset)[..., None]
            scaled = out.inputs_embeds * (self.language_model.model.hidden_size**0.5)
            out.inputs_embeds = mx.where(text_rows, scaled, out.inputs_embeds)
        return out

    with _class_attributes(Model, get_input_embeddings=get_input_embeddings):
        yield


class _OffsetBeforeThisCall:
    """A shared layer's view of the cache it reads: its ``state`` (keys and values), at the offset before the
    layer it shares wrote this call's ``length`` tokens (where this call's queries stand)."""

    def __init__(self, cache, length: int) -> None:
        self.cache, self.length = cache, length

    @property
    def offset(self):
        return self.cache.offset - self.length

    @property
    def state(self):
        return self.cache.state


@contextmanager
def gemma3n_shared_kv_queries_at_their_positions() -> Iterator[None]:
    """The oracle's correction of mlx-vlm 0.7.10's Gemma 3n KV sharing, and nothing else: a shared layer rotates
    its queries at ``cache.offset`` read after the layer it shares has written this call's keys, so its
    queries stand one call's length past their positions (its answer depends on how a prompt is chunked:
    ``test_gemma3n_shared_kv_layers_rotate_queries_past_their_positions``); Hugging Face's rotate them at their
    positions, as the engine does. Inside, a shared layer reads the offset before this call's write."""
    from mlx_vlm.models.gemma3n.language import Gemma3nAttention
    from tiny_vlm_towers import _class_attributes

    shifted = Gemma3nAttention.__call__

    def call(self, x, mask=None, cache=None):
        if self.is_kv_shared_layer and cache is not None:
            cache = _OffsetBeforeThisCall(cache, x.shape[1])
        return shifted(self, x, mask, cache)

    with _class_attributes(Gemma3nAttention, __call__=call):
        yield


@contextmanager
def gemma3n_corrected() -> Iterator[None]:
    """Both corrections of mlx-vlm's Gemma 3n (its oracle's): text rows scaled, shared layers' queries placed."""
    with gemma3n_prompt_embeddings_scaled(), gemma3n_shared_kv_queries_at_their_positions():
        yield


def gemma3n_text_model_dir(model_dir: Path, out_dir: Path) -> Path:
    """The tiny Gemma 3n's text model as mlx-lm's ``gemma3n`` loads it: the same config, tokenizer and text
    weights (mlx-vlm's ``language_model.model.*`` under the checkpoint's ``model.language_model.*``), no tower."""
    import shutil

    import mlx.core as mx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out_dir / name)
    prefix = "language_model.model."
    weights = mx.load(str(Path(model_dir) / "model.safetensors"))
    text = {"model.language_model." + k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    mx.save_safetensors(str(out_dir / "model.safetensors"), text)
    return out_dir

"""Which adapter drives an mlx-vlm architecture: the generic one, or a family hook.

Every architecture goes through ``vlm_generic.GenericVisionModel`` (the processor expands an
image, ``get_input_embeddings`` merges its features, the text model runs on embeddings and the
paged caches) unless a family hook here knows what the generic path cannot derive:

* ``Qwen3VLModel`` and ``Qwen3_5Model``: Qwen3-VL's deepstack features, passed to the text model
  beside the embeddings, and Qwen3.5's recurrent layers, whose mlx-vlm code talks to the state
  cache through calls of its own; both with multi-axis positions computed here
  (``mrope_positions``);
* ``Gemma3Model``: the newlines framing an image merge with the prompt's own (Gemma's tokenizer
  has single tokens for runs of newlines), so the expansion is re-tokenized where they meet;
* ``Gemma3nModel``: the generic path, with its text rows' embedding scale (mlx-vlm's prompt embeddings
  lack it) and Gemma 3's newline merge around an image;
* ``Idefics2Model``: the generic path, with the processor's rewriting of the text where an
  image meets its neighbours (markers merged, a space before text);
* ``DeepseekVL2Model``: the generic path, with the processor's per-image tile counts padded so
  mlx-vlm's model reads them in bounds;
* ``FalconOCRModel``: the generic path, with the prompt its processor writes itself, its 1-D
  positions (still over an image's run) and the image blocks its mask lets attend both ways.
* ``HunyuanVLModel``: the generic path, with 4-axis rotary positions from its processor, applied
  at any cache offset (mlx-vlm applies them only where the batch's one offset is 0).
* ``PaliGemmaModel``: the generic path, with the prompt its processor writes around the images (the
  BOS after the last one, a closing newline); its prefix LM is the generic path's (``WHOLE_PROMPT``).
* ``Ernie4_5VLModel``: the generic path, with the placeholder its processor expands, which no
  attribute names.
* ``Phi4SigLipModel``: the generic path, with the prompt its processor writes (a prompt without
  ``<|im_start|>`` wrapped in the chat template).
* ``MllamaModel``: the generic path with image states beside the embeddings (held per request), with
  its one-token image, the BOS its processor writes after leading images, and its per-token masks.

``TEXT_MODEL_REFUSALS`` names text models refused whatever the vision side, for what the
load-time check (one row) cannot see; ``load_vision_language_model`` picks the adapter.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_mlx.core.multimodal import ImageInput, MultiModalInput, mrope_positions
from vllm_mlx.executor.attention import UnsupportedModelError
from vllm_mlx.multimodal.images import ImageSource, load_image
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.multimodal.vlm_generic import (
    GRID_KEY,
    IMAGE_STATES,
    PROMPT_POSITION_KEYS,
    GenericVisionModel,
    LanguageSplit,
    true_runs,
)
from vllm_mlx.multimodal.vlm_models import VisionLanguageModel
from vllm_mlx.multimodal.vlm_placeholder import (
    LAYOUT_TEXT,
    PROBE_IMAGE_SIZE,
    ImageRun,
    expanded_ids,
    text_ids,
)
from vllm_mlx.platform.errors import ModelSourceError

__all__ = [
    "ARCHITECTURE_REFUSALS",
    "FAMILIES",
    "TEXT_MODEL_REFUSALS",
    "DeepseekVL2Model",
    "Ernie4_5VLModel",
    "FalconOCRModel",
    "Gemma3Model",
    "Gemma3nModel",
    "HunyuanVLModel",
    "Idefics2Model",
    "LocateAnythingModel",
    "MiniCPMV47Model",
    "MiniCPMVModel",
    "MllamaModel",
    "PaliGemmaModel",
    "Phi4SigLipModel",
    "Qwen2VLModel",
    "Qwen3VLModel",
    "Qwen3_5Model",
    "load_vision_language_model",
    "refusal",
    "supported_model_types",
]


class Qwen2VLModel(VisionLanguageModel):
    """Qwen2-VL's layout: dynamic-resolution patches, 2×2 merge, multi-axis rotary positions
    computed here (``mrope_positions``, numpy, on the caller's thread).

    The base of Qwen3-VL's hook. Qwen2-VL and Qwen2.5-VL themselves need no hook any more: the
    generic path takes their positions from their text model's ``get_rope_index``."""

    model_types: tuple[str, ...] = ()
    uses_mrope = True
    image_placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def merge_size(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        out = self.processor.image_processor(images=[rgb], return_tensors="np")
        grid = tuple(int(n) for n in np.asarray(out["image_grid_thw"])[0])
        num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        pixels = np.asarray(out["pixel_values"])
        return ImageInput(self._hash(rgb), rgb, pixels, offset=0, num_tokens=num_tokens, grid=grid)

    def multimodal_input(self, num_tokens: int, images: list[ImageInput]) -> MultiModalInput:
        positions, delta = mrope_positions(num_tokens, images, self.merge_size)
        return MultiModalInput(images, positions, delta)

    def encode(self, image: ImageInput) -> mx.array:
        tower = self.model.vision_tower
        pixels = mx.array(image.pixel_values).astype(tower.patch_embed.proj.weight.dtype)
        return tower(pixels, mx.array([image.grid]), output_hidden_states=False)

    def language_hidden_states(self, embeds, inputs, cache, position_ids):
        return self.language.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=position_ids)


class Qwen3VLModel(Qwen2VLModel):
    """Qwen3-VL and Qwen3-VL-MoE: Qwen2-VL's patches and merge (16 px patches, learned position
    embeddings), interleaved multi-axis rotary, and deepstack.

    Deepstack: the outputs of some vision blocks (``deepstack_visual_indexes``), each merged by
    its own projector, are *added* to the hidden states of the first text layers (layer ``k``
    gets the ``k``-th) at the image's positions. mlx-vlm's text model takes those features
    (``deepstack_visual_embeds``) and the image positions (``visual_pos_masks``) as arguments
    and injects them itself, so no layer is forked: ``encode`` returns the main features and
    the deepstack ones side by side, ``[num_tokens, hidden * (1 + num_deepstack)]`` (one MLLM
    cache entry holds all of them), and ``hidden_states`` splits them back for the step's rows.

    Positions: the same (t, h, w) grid positions as Qwen2-VL (mlx-vlm's ``get_rope_index`` for
    still images gives ``mrope_positions``'s layout); the interleaving of the rotary
    frequencies happens inside the model.
    """

    model_types = ("qwen3_vl", "qwen3_vl_moe")

    @property
    def num_deepstack(self) -> int:
        return len(self.model.config.vision_config.deepstack_visual_indexes)

    def encode(self, image: ImageInput) -> mx.array:
        tower = self.model.vision_tower
        pixels = mx.array(image.pixel_values).astype(tower.patch_embed.proj.weight.dtype)
        features, deepstack = tower(pixels, mx.array([image.grid]))
        return mx.concatenate([features, *deepstack], axis=-1)

    def hidden_states(self, inputs, cache, position_ids, images):
        embeds = self.embed(inputs)
        mask = deepstack = None
        if images is not None:
            main, *deepstack = mx.split(images.features, 1 + self.num_deepstack, axis=-1)
            embeds = images.scatter(embeds, main)
            mask = images.mask()
        return self.language.model(
            inputs,
            inputs_embeds=embeds,
            cache=cache,
            position_ids=position_ids,
            visual_pos_masks=mask,
            deepstack_visual_embeds=deepstack or None,
        )


class Qwen3_5Model(Qwen3VLModel):
    """Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's vision side and positions, and a hybrid text model
    (gated delta-net layers, a full-attention layer every ``full_attention_interval``).

    * Vision: Qwen3-VL's tower; mlx-vlm disables deepstack for 3.5 (its config refuses
      ``deepstack_visual_indexes``), so ``encode`` returns the main features only and the text
      model takes embeddings and positions as Qwen2-VL's does.
    * Positions: Qwen3-VL's (mlx-vlm's ``get_rope_index`` is the same for still images);
      the attention layers rotate only part of each head, inside the model.
    * Recurrent layers: their state lives in the engine's state pool, as for the text-only
      ``qwen3_5`` (``attention.RECURRENT_ARCHITECTURES``), but mlx-vlm's delta-net code talks
      to it through two calls mlx-lm's does not make; ``MlxVlmStateCache`` adds them.
    """

    model_types = ("qwen3_5", "qwen3_5_moe", "clef", "indic_ocr", "prism_hadamard_qwen35")
    """Qwen3.5's and the packages whose ``Model`` subclasses it unchanged for generation: CLEF
    (a decision head beside it, never called by generation), IndicOCR's OCR stage, Prism's
    Hadamard packs (2-bit modules that rotate their inputs, same layers otherwise)."""
    hidden_states = VisionLanguageModel.hidden_states  # no deepstack features to pass on

    def language_hidden_states(self, embeds, inputs, cache, position_ids):
        cache = [MlxVlmStateCache(c) if layer.is_linear else c for layer, c in zip(self.layers, cache)]
        return super().language_hidden_states(embeds, inputs, cache, position_ids)


class MlxVlmStateCache:
    """mlx-vlm's recurrent-cache calls over a cache with mlx-lm's ``ArraysCache`` protocol
    (the engine's ``RecurrentLayerCache``; mlx-lm's own ``ArraysCache`` while probing).

    mlx-vlm's delta-net layers do not assign ``cache[i]``: they hand the convolution input to
    ``update_window`` (keep each row's last ``width`` inputs) and the state update to
    ``update_recurrent`` (run it from the cached state, keep the new one). mlx-vlm's own cache
    also records speculative-decoding history there, which the engine never asks for. The rest
    (``cache[i]``, ``lengths``, ``advance``, ``make_mask``) is the wrapped cache's.
    """

    def __init__(self, cache) -> None:
        self.cache = cache

    def __getattr__(self, name: str):
        return getattr(self.cache, name)

    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def update_window(self, index: int, source: mx.array, width: int, *, lengths: mx.array | None = None):
        """Keep ``source[:, n - width : n]`` where ``n`` is the row's real length in ``source``
        (``source`` is the previous window followed by the new tokens; ``lengths``: each row's
        real new tokens when rows are right-padded)."""
        new = source.shape[1] - width
        if lengths is None:
            window = source[:, new:]
        else:
            positions = mx.clip(lengths, 0, new)[:, None] + mx.arange(width)
            window = mx.take_along_axis(source, positions[:, :, None], axis=1)
        self.cache[index] = window
        return window

    def update_recurrent(self, index: int, length: int, update):
        output, state = update(self.cache[index], None)[:2]  # None: no history to keep
        self.cache[index] = state
        return output, state


class MergesNewlineRuns:
    """Gemma's tokenizers have single tokens for runs of newlines, and its processors expand an image's
    placeholder to text framed by ``"\\n\\n"`` before tokenizing the whole prompt: the frame's newlines merge
    with the prompt's own next to the placeholder (``"user\\n"`` + ``"\\n\\n"`` is one ``"\\n\\n\\n"`` token).
    ``_extend`` re-tokenizes the newline tokens where two pieces meet, as that whole-prompt tokenizing does."""

    def _extend(self, expanded: list[int], tokens: list[int]) -> None:
        """Append, re-tokenizing the run of newline tokens where the two lists meet."""
        left = _newline_run(expanded, self._newline_text, from_end=True)
        right = _newline_run(tokens, self._newline_text, from_end=False)
        if left and right:
            text = "".join(self._newline_text(t) for t in expanded[-left:] + tokens[:right])
            del expanded[-left:]
            tokens = self.tokenizer.encode(text, add_special_tokens=False) + tokens[right:]
        expanded += tokens

    def _newline_text(self, token_id: int) -> str | None:
        text = self.tokenizer.decode([token_id])
        return text if text and set(text) == {"\n"} else None


class Gemma3Model(MergesNewlineRuns, VisionLanguageModel):
    r"""Gemma 3: a SigLIP tower at a fixed resolution, an average-pooling projector, and a Gemma 3
    text model whose layers alternate sliding-window and global attention.

    * Prompt: an image is ``<start_of_image>`` in the template; it expands to
      ``"\n\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\n\n"``
      as the processor's text replacement does. Gemma's tokenizer has single tokens for runs of
      newlines, so the newlines the frame adds merge with the ones around it (re-tokenized).
    * Features: mlx-vlm divides the projector output by ``sqrt(config.hidden_size)`` and the
      text model multiplies every input embedding by ``sqrt(text hidden size)``; ``encode``
      returns the divided features and the text model, run on our embeddings, scales them.
    * Attention: mlx-vlm's generation runs the text model with its own causal masks (the 4-D
      mask ``get_input_embeddings`` builds is not passed on), so image tokens attend causally,
      with the window on sliding layers, as here. (HF lets an image's tokens see each other
      both ways; mlx-vlm, the reference here, does not.)
    * Cache: ``make_cache`` reports the sliding layers' window; the paged caches apply it.

    Not done: pan-and-scan crops (off in the released configs; forced off here).
    """

    model_types = ("gemma3",)
    image_placeholder_text = "<start_of_image>"

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_index)

    def _placeholder_token_id(self) -> int:
        return self._token_id("boi_token_index", "boi_token")

    def _token_id(self, config_key: str, tokenizer_attr: str) -> int:
        if config_key in self.config:
            return int(self.config[config_key])
        return int(self.tokenizer.convert_tokens_to_ids(getattr(self.tokenizer, tokenizer_attr)))

    @property
    def tokens_per_image(self) -> int:
        return int(self.model.config.text_config.mm_tokens_per_image)

    def image_frame(self) -> tuple[list[int], list[int]]:
        newlines = self.tokenizer.encode("\n\n", add_special_tokens=False)
        end = self._token_id("eoi_token_index", "eoi_token")
        return newlines + [self.placeholder_token_id], [end] + newlines

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        out = self.processor.image_processor(images=[rgb], return_tensors="np", do_pan_and_scan=False)
        pixels = np.asarray(out["pixel_values"])
        return ImageInput(self._hash(rgb), rgb, pixels, offset=0, num_tokens=self.tokens_per_image)

    def encode(self, image: ImageInput) -> mx.array:
        model = self.model
        dtype = model.language_model.model.embed_tokens.weight.dtype
        pixels = mx.array(image.pixel_values).transpose(0, 2, 3, 1).astype(dtype)  # NCHW -> NHWC
        hidden, _, _ = model.vision_tower(pixels, output_hidden_states=True)
        features = model.multi_modal_projector(hidden) / (model.config.hidden_size**0.5)
        return features.reshape(-1, features.shape[-1])


class Gemma3nModel(MergesNewlineRuns, GenericVisionModel):
    r"""Gemma 3n: the generic path (its per-layer inputs travel as per-token features, its last layers read
    the keys and values of earlier ones as ``cache.state``), with two things it cannot derive. (Those shared
    layers rotate their queries at ``cache.offset``: the paged caches' is the call's start, as Hugging Face
    places them; mlx-vlm's own caches have advanced by the call's length there, which its oracle corrects.)

    * Prompt embeddings: mlx-vlm 0.7.10's ``get_input_embeddings`` gives text tokens ``embed_tokens(ids)``
      unscaled, where its text model given ids (mlx-vlm's decode steps) scales them by sqrt(hidden_size), as
      Hugging Face's Gemma 3n scales every text token (its scaled word embedding; mlx-vlm's Gemma 4 scales
      them in ``get_input_embeddings`` too). Every call of it here scales the rows of text ids (below the
      vision range): prompt and decode steps agree, as in HF. Vision-range ids (``<end_of_image>``, the soft
      tokens) keep the vision embedder's rows, as HF's, which writes them over the text rows unscaled.
    * Newlines: the processor expands ``<image_soft_token>`` to ``"\n\n<start_of_image>"`` + soft tokens +
      ``"<end_of_image>\n\n"`` before tokenizing the prompt, so those newlines are the image's frame, merged
      with the prompt's own where they meet (``MergesNewlineRuns``), and the run is what lies between.
    """

    model_types = ("gemma3n",)

    def __init__(self, model, processor, config: dict, path) -> None:
        model.get_input_embeddings = _text_rows_scaled(model)  # before the check at load: every path scaled
        super().__init__(model, processor, config, path)

    def image_frame(self) -> tuple[list[int], list[int]]:
        newlines = self.tokenizer.encode("\n\n", add_special_tokens=False)
        return newlines, newlines

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        """The generic image, its run without the frame's newlines (``image_frame`` puts them back)."""
        image = super().process(source, policy)
        before, after = self.image_frame()
        run = list(image.token_ids)
        if run[: len(before)] != before or run[len(run) - len(after) :] != after:
            raise UnsupportedModelError(f"its processor's image run is not framed by newlines: {run}")
        image.token_ids = run[len(before) : len(run) - len(after)]
        image.num_tokens = len(image.token_ids)
        return image


def _text_rows_scaled(model):
    """mlx-vlm's Gemma 3n ``model.get_input_embeddings`` with Hugging Face's sqrt(hidden_size) on the rows of
    text ids (``Gemma3nModel``), computed as its text model scales the ids it embeds itself."""
    unscaled = model.get_input_embeddings
    scale = model.language_model.model.hidden_size**0.5
    vision_start = model.embed_vision.vocab_offset

    def get_input_embeddings(input_ids=None, pixel_values=None, **kwargs):
        merged = unscaled(input_ids, pixel_values, **kwargs)
        if input_ids is not None:
            is_text = (input_ids < vision_start)[..., None]
            merged.inputs_embeds = mx.where(is_text, merged.inputs_embeds * scale, merged.inputs_embeds)
        return merged

    return get_input_embeddings


class Idefics2Model(GenericVisionModel):
    """Idefics2: the generic path, with its processor's rewriting of the text around an image.

    The processor (mlx-vlm's, after transformers') writes ``<fake_token_around_image> <image> x n
    <fake_token_around_image>`` for an image and then rewrites the prompt as text: where two
    images meet, their markers merge into one; where text follows a closing marker directly (no
    space, no tag), it puts a space in between. One image's run, spliced alone, cannot know its
    neighbours, so here the markers are the image's frame (``image_frame``), ``_extend`` applies
    both rules where the pieces meet, and an image's run is what lies between its markers (the
    same wherever the image stands: the MLLM cache keys its rows on the image alone).
    """

    model_types = ("idefics2",)

    @property
    def marker_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.processor.fake_image_token))

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        image = super().process(source, policy)
        run = list(image.token_ids)
        if len(run) > 2 and run[0] == run[-1] == self.marker_id:
            image.token_ids, image.num_tokens = run[1:-1], len(run) - 2
        return image

    def image_frame(self) -> tuple[list[int], list[int]]:
        return [self.marker_id], [self.marker_id]

    def _extend(self, expanded: list[int], tokens: list[int]) -> None:
        if expanded and tokens and expanded[-1] == self.marker_id:
            if tokens[0] == self.marker_id:  # two images meet: one marker between them
                tokens = tokens[1:]
            else:
                text = self._text_after_marker(tokens[0])
                if text and not text[0].isspace() and text[0] != "<":  # the processor's (?=[^\s<])
                    # It tokenizes " " + the text: the first token is re-tokenized with the space.
                    tokens = self.tokenizer.encode(" " + text, add_special_tokens=False) + tokens[1:]
        expanded += tokens

    def _text_after_marker(self, token_id: int) -> str:
        """``token_id``'s text where it follows a marker (a tokenizer that drops a word's leading
        space when it decodes the word alone keeps it there)."""
        marker = self.tokenizer.decode([self.marker_id])
        return self.tokenizer.decode([self.marker_id, token_id])[len(marker) :]


class MiniCPMVModel(GenericVisionModel):
    """MiniCPM-V 4.6 and 4.7: the generic path over Qwen3.5's hybrid text model, whose mlx-vlm
    delta-net layers talk to their state cache through ``MlxVlmStateCache``'s calls (as in
    ``Qwen3_5Model``); the generic path refuses those calls elsewhere (GLM-5-Next's), so the
    wrapping is this family's. The rest is generic: positions one per token
    (``GenericVisionModel.sequential_positions``), ``image_bound`` moved to the run.

    Image ids (``use_image_id``, on in MiniCPM-V's processor by default): the processor writes
    ``<image_id>k</image_id>`` before the ``k``-th image of a prompt, so one image's expansion
    alone always says 0. Those tokens are text (embedded as such, outside ``image_bound``): here
    they are cut off the run (which then is the same wherever the image stands, as the MLLM
    cache needs) and written before each image with its number (``image_frame_at``).
    """

    model_types = ("minicpmv4_6",)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        image = super().process(source, policy)
        numbered = len(self._image_id(0))
        if numbered and list(image.token_ids[:numbered]) == self._image_id(0):
            image.token_ids, image.num_tokens = image.token_ids[numbered:], image.num_tokens - numbered
            # Positions in the run move with it: mlx-vlm writes features at image_bound unchecked.
            image.encoder_inputs = {name: value - numbered if name in PROMPT_POSITION_KEYS else value
                                    for name, value in image.encoder_inputs.items()}  # fmt: skip
        return image

    def image_frame_at(self, index: int) -> tuple[list[int], list[int]]:
        return self._image_id(index), []

    def _image_id(self, index: int) -> list[int]:
        """The processor's ``<image_id>index</image_id>`` tokens ([] where it numbers no images)."""
        return list(self.processor._build_image_id_ids(index))

    def language_hidden_states(self, embeds, inputs, cache, position_ids, **features):
        return super().language_hidden_states(embeds, inputs, _state_caches(self.layers, cache), position_ids,
                                              **features)  # fmt: skip

    def probe_cache(self) -> list:
        return _state_caches(self.layers, self.make_cache())


class MiniCPMV47Model(MiniCPMVModel):
    """MiniCPM-V 4.7: 4.6's path with "canvas" positions. Each image's thumbnail and crops are laid
    on one 3-D canvas whose size comes from the crop grids (``tgt_sizes``), and the text after it
    resumes past the canvas. mlx-vlm computes them inside ``get_input_embeddings`` over the whole
    prompt; its text model's ``get_rope_index`` refuses image tokens (it has no grids). Here
    ``positions`` runs the same computation (mlx-vlm's ``CanvasRoPE``) over the prompt with its
    images' grids in order, on the engine thread at the prompt's first step."""

    model_types = ("minicpmv4_7",)

    def embed(self, inputs: mx.array) -> mx.array:
        """The token embeddings, which ``get_input_embeddings`` starts from: called without
        pixels on a step with image tokens it refuses (no grids), where the image's rows follow."""
        return self.language.model.embed_tokens(inputs)

    def _grid_free_positions(self, merged, image: ImageInput) -> bool:
        return "tgt_sizes" in image.encoder_inputs  # the canvas needs the crop grids (``positions``)

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        from mlx_vlm.models.minicpmv4_7.rope import CanvasRoPE

        config = self.model.config
        ids = np.array([token_ids])
        kinds = np.where(ids == config.image_token_id, 1, np.where(ids == config.video_token_id, 2, 0))
        grids = [np.asarray(image.encoder_inputs["tgt_sizes"]).reshape(-1, 2) for image in images]
        positions, deltas = CanvasRoPE(config).get_rope_index(
            ids, mm_token_type_ids=kinds, target_sizes=np.concatenate(grids) if grids else np.zeros((0, 2), np.int32),
            target_sizes_videos=np.zeros((0, 2), np.int32), downsample_mode=config.downsample_mode,
        )  # fmt: skip
        return positions[:, 0, :].astype(np.int64), int(deltas[0, 0])


def _state_caches(layers, caches: list) -> list:
    """``caches`` with each delta-net layer's (``is_linear``) wrapped in ``MlxVlmStateCache``."""
    return [MlxVlmStateCache(c) if getattr(layer, "is_linear", False) else c for layer, c in zip(layers, caches)]


class DeepseekVL2Model(GenericVisionModel):
    """DeepSeek-VL2: the generic path, with the image's ``images_spatial_crop`` padded in bounds.

    mlx-vlm's ``get_input_embeddings`` reads ``images_spatial_crop[b][j]`` (one row per image)
    for ``j`` up to the pixels' tile count, stopping at the first zero row, which the processor's
    batch padding supplies. For one image of ``n`` tiles the rows past the first do not exist, and
    MLX indexes without bounds checks: it reads whatever memory follows, and a non-zero row there
    adds phantom tiles or empties the tile slice, dropping the image (about one call in two on the
    CPU backend). Zero rows up to the tile count, as that padding gives, keep every read in bounds
    and stop the walk after the image.
    """

    model_types = ("deepseek_vl_v2",)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        image = super().process(source, policy)
        image.encoder_inputs = pad_spatial_crops(image.encoder_inputs, image.pixel_values.shape[1])
        return image


def pad_spatial_crops(encoder_inputs: dict[str, np.ndarray], tiles: int) -> dict[str, np.ndarray]:
    """``encoder_inputs`` with ``images_spatial_crop`` (``[batch, images, 2]``) padded with zero
    rows to ``tiles`` images (``DeepseekVL2Model``)."""
    crops = encoder_inputs.get("images_spatial_crop")
    if crops is None or crops.shape[1] >= tiles:
        return encoder_inputs
    padding = np.zeros((crops.shape[0], tiles - crops.shape[1], crops.shape[2]), dtype=crops.dtype)
    return {**encoder_inputs, "images_spatial_crop": np.concatenate([crops, padding], axis=1)}


class FalconOCRModel(GenericVisionModel):
    """Falcon OCR: the generic path (patches projected straight to the text width, no tower; its 2-D
    "golden" positions ``pos_hw`` travel as a per-token feature, zero at text: ``ZERO_AT_TEXT``), with
    what its processor and text model do that the generic path cannot read off:

    * Prompt: its processor writes the whole prompt itself, ``make_ocr_prompt(text)``: one image, then
      the instruction of the OCR category the text names (the plain one for any other text). So does
      ``prompt_text`` (the package's own function), and the image's run is what the processor puts
      where that prompt's image token stands.
    * Positions: 1-D, one for the whole run from ``<|image_cls|>`` to ``<|image_end|>``, the text after
      it one past (its ``get_rope_index``, which mlx-vlm keeps as state): computed per request on the
      engine thread (``positions``) and given to the text model as ``[batch, tokens]``.
    * Attention: its mask (``create_falcon_ocr_mask``: ``causal | same_image``) lets a block, from
      ``<|image_cls|>`` up to ``<|image_end|>`` (not included), attend to itself both ways: each
      image's block is a both-ways span (``_both_ways_spans``).
    """

    model_types = ("falcon_ocr",)

    def __init__(self, model, processor, config: dict, path) -> None:
        # The processor's prompt holds one image (with two it expands the first only).
        self.max_images_per_prompt = 1
        self.images_limit_reason = "its processor writes the prompt itself, with one image"
        super().__init__(model, processor, config, path)

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """``<|image|>`` (the image token of ``make_ocr_prompt``), the ids of the prompt the processor
        writes for it, and the run the processor puts at it: the two prompts share the instruction."""
        from PIL import Image

        text = processor.tokenizer.convert_ids_to_tokens(processor.img_id)
        plain = text_ids(processor, self.prompt_text(text))
        expanded = expanded_ids(processor, text, Image.new("RGB", PROBE_IMAGE_SIZE))
        return text, plain, ImageRun.of(plain, expanded)

    def prompt_text(self, text: str) -> str:
        from mlx_vlm.models.falcon_ocr.processing_falcon_ocr import make_ocr_prompt

        return make_ocr_prompt(text)

    def _grid_free_positions(self, merged, image: ImageInput) -> bool:
        return True  # ``positions`` reads the prompt's ids alone

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """Its text model's own 1-D positions (``get_rope_index``), on all three axes; engine thread.
        Only the positions are evaluated (the mask it also builds stays an unevaluated graph)."""
        position_ids, _, delta, _ = self.language.get_rope_index(mx.array([token_ids]))
        positions = np.array(position_ids).astype(np.int64)
        return np.broadcast_to(positions, (3, positions.shape[0])).copy(), int(delta)

    def language_hidden_states(self, embeds, inputs, cache, position_ids, **features):
        # Its text model reads [batch, tokens] positions (a [3, batch, tokens] array it would flatten).
        one_axis = position_ids[0] if position_ids is not None else None
        return super().language_hidden_states(embeds, inputs, cache, one_axis, **features)

    def _both_ways_spans(self, num_tokens: int, images: list[ImageInput]) -> list[tuple[int, int]]:
        """Each image's block as ``create_falcon_ocr_mask`` sees it in the image's run: from a start
        marker (``image_cls_token_id``) up to the next end marker (``img_end_id``), not included."""
        config = self.model.config
        spans = []
        for image in images:
            ids = np.asarray(image.token_ids)
            opened = np.cumsum(ids == config.image_cls_token_id) - np.cumsum(ids == config.img_end_id)
            spans += [(image.offset + s, image.offset + e) for s, e in true_runs(opened > 0)]
        return spans


class FalconPerceptionModel(FalconOCRModel):
    """Falcon Perception: Falcon OCR's layout, positions and mask, with heads whose outputs its decode
    steps feed back. After each call its text model decodes a coordinate and a size from the last
    hidden state (a coordinate already detected is skipped); a decode step whose token is
    ``coord_token_id`` (``size_token_id``) gets them encoded as its embedding, and ``seg_token_id``
    closes a detection. mlx-vlm keeps all this on its text model between calls (``request_state``):
    the engine holds it per request beside the request's caches, one row a call.

    * Prompt: its processor places the image itself, always: ``<|image|>``, an instruction, then the
      whole text as the query (``_make_prompt``), so a placeholder in the text would be a second image
      token there. The engine follows it (``places_images_itself``): the text is the query, and an image
      is processed with the empty one (``_find_placeholder``).
    * 2-D positions: its ``get_input_embeddings`` keeps them on the model for the whole prompt and
      returns none, so ``_merged_run`` gives each image run's own (``pos_hw``, Falcon OCR's feature).
    * Prompt tokens but the last: Falcon OCR's path (the engine's positions and ``pos_hw``), with the
      model's own mask of the prompt (held caches take no engine mask), sliced as its text model does,
      through its transformer (``probe_split``: its text model's call reads these from the model).
    * The last prompt token and each generated one: one call of the text model itself
      (``LanguageModel.__call__``, as mlx-vlm's generation calls it), which decodes the coordinate and
      size; the prompt's last token with its embedding (no feedback, as mlx-vlm's prefill), a generated
      one by id (the feedback). A request whose caches are made fresh (preempted) replays its generated
      tokens so, one a call, from a fresh state: the same states again.
    * Not served: the detections' segmentation masks (mlx-vlm's ``get_detections``: outputs beside the
      tokens, which they do not change).
    """

    model_types = ("falcon_perception",)
    places_images_itself = True  # its processor puts the image before an instruction and the text, the query
    request_state = ("language._pending_coord_xy", "language._pending_size_hw", "language._detections",
                     "language._current_det", "prompt_length", "prompt_delta", "prompt_mask")  # fmt: skip

    def __init__(self, model, processor, config: dict, path) -> None:
        super().__init__(model, processor, config, path)
        # Segmentation masks are not served (class doc): no parent reference, so decode steps compute none.
        object.__setattr__(self.language, "_parent_model_ref", None)
        self.images_limit_reason = "its processor places the image itself, before its instruction and the query"
        self.prompt_length, self.prompt_delta, self.prompt_mask = 0, 0, None

    def check(self) -> None:
        self.uses_mrope = True  # its positions are ``positions``' (the generic __init__ looks for get_rope_index)
        super().check()

    def prompt_text(self, text: str) -> str:
        """Its processor's own wrap of any text it is given with an image (``_make_prompt``: the image,
        an instruction, the text as the query), as mlx-vlm generates over it."""
        from mlx_vlm.models.falcon_perception.processing_falcon_perception import (
            FalconPerceptionProcessor,
        )

        return FalconPerceptionProcessor._make_prompt(None, text)

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """The empty query (``LAYOUT_TEXT``: an image is processed with it, as Falcon OCR's with its
        image token, which here would be a second image token in the query), the ids of the prompt the
        processor writes for it, and the run it puts at that prompt's image token, ``<|image|>``."""
        from PIL import Image

        plain = text_ids(processor, self.prompt_text(LAYOUT_TEXT))
        expanded = expanded_ids(processor, LAYOUT_TEXT, Image.new("RGB", PROBE_IMAGE_SIZE))
        return LAYOUT_TEXT, plain, ImageRun.of(plain, expanded)

    def layout_prompt_ids(self, text: str, count: int) -> list[int]:
        """The prompt its processor writes for ``text`` (the query) and one image: the whole text is the
        query, a placeholder in it is text (``places_images_itself``), and its image token is the image's."""
        if count != 1:
            raise ValueError(f"its processor places the image itself and does not place {count} in one prompt")
        ids = text_ids(self.processor, self.prompt_text(text))
        if ids.count(self.placeholder_token_id) != 1:  # its processor would expand the first alone
            raise ValueError("its processor places the image itself, before the text: the text takes no image token")
        return ids

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """Its model's own 1-D positions (``_precompute_positions``), on all three axes; engine thread."""
        position_ids, _, delta = self.model._precompute_positions(mx.array([token_ids]), None)
        positions = np.array(position_ids).astype(np.int64)
        return np.broadcast_to(positions, (3, positions.shape[0])).copy(), int(delta)

    def _merged_run(self, run: list[int], pixels: np.ndarray, encoder_inputs: dict[str, np.ndarray]):
        """``get_input_embeddings``'s rows with the run's 2-D positions: its model (unlike Falcon OCR's)
        keeps them as state, for the whole prompt, and returns none. The same function on the run alone
        gives each patch its own (zero at the markers: a prompt's one image's patches are the run's), to
        travel as Falcon OCR's do (a per-token feature, ``ZERO_AT_TEXT``)."""
        from mlx_vlm.models.falcon_perception.language import compute_pos_hw

        merged = super()._merged_run(run, pixels, encoder_inputs)
        grids = [tuple(int(n) for n in grid) for grid in np.asarray(encoder_inputs["image_grid_hw"]).reshape(-1, 2)]
        merged.pos_hw = compute_pos_hw(mx.array(run), self.model.config.img_id, grids)
        return merged

    def probe_split(self, embeds: mx.array, **features) -> LanguageSplit:
        """Its transformer and head: its text model's own call ignores the positions, 2-D positions and
        mask it is given for a prompt, taking them from what ``get_input_embeddings`` last left on it (a
        prompt's, maybe another request's). The hook gives them to the transformer itself, and calls the
        whole text model only one token at a time, where it reads none of them (``language_hidden_states``)."""
        head = getattr(self.language, "lm_head", None)
        return LanguageSplit(
            self.language.model, head if head is not None else self.language.model.embed_tokens.as_linear
        )

    def fresh_request_state(self, request) -> dict:
        from mlx_vlm.models.falcon_perception.language import (
            create_falcon_perception_mask,
        )

        ids = mx.array([request.prompt_token_ids])
        _, _, delta = self.model._precompute_positions(ids, None)
        config = self.model.config
        mask = create_falcon_perception_mask(ids, config.image_cls_token_id, config.img_end_id)
        return {"language._pending_coord_xy": None, "language._pending_size_hw": None, "language._detections": [],
                "language._current_det": {}, "prompt_length": len(request.prompt_token_ids),
                "prompt_delta": delta, "prompt_mask": mask}  # fmt: skip

    def language_hidden_states(self, embeds, inputs, cache, position_ids, **features):
        offset, width = cache[0].offset, inputs.shape[1]
        before_last = max(min(self.prompt_length - 1 - offset, width), 0)  # prompt tokens but its last
        pieces = []
        if before_last:
            end = offset + before_last
            pieces.append(super().language_hidden_states(
                embeds[:, :before_last], inputs[:, :before_last], cache,
                position_ids[..., :before_last] if position_ids is not None else None,
                mask=self.prompt_mask[:, :, offset:end, :end], **{k: v[:, :before_last] for k, v in features.items()},
            ))  # fmt: skip
        for i in range(before_last, width):
            self.language._rope_delta = self.prompt_delta  # its decode positions (mlx-vlm's get_input_embeddings)
            by_id = offset + i >= self.prompt_length  # a generated token: the text model feeds back
            self.language(inputs[:, i : i + 1], inputs_embeds=None if by_id else embeds[:, i : i + 1], cache=cache)
            pieces.append(self.language.model._last_hidden_state)
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=1)


class PaliGemmaModel(GenericVisionModel):
    """PaliGemma: the generic path, with the prompt its processor writes around the images, which the
    generic path cannot read off one placeholder: each ``<image>`` becomes the image's tokens where it
    stands, the BOS goes after the *last* image (at the start where there is none) and a newline closes
    the prompt. ``prompt_text`` writes the same text, so each placeholder's run is the image's tokens
    alone. Its text model is a prefix LM, which the generic path serves (``WHOLE_PROMPT``)."""

    model_types = ("paligemma",)

    def __init__(self, model, processor, config: dict, path) -> None:
        # mlx-vlm's model keeps the tower's output for the first image alone and writes it by prompt
        # position (features[i] at token i), not in image-token order: one image a prompt, as
        # checkpoints are used (an image first; the engine's own placement holds anywhere).
        self.max_images_per_prompt = 1
        self.images_limit_reason = "mlx-vlm's model merges the first image's features only, at the prompt's start"
        super().__init__(model, processor, config, path)

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """``<image>``, the ids of the prompt the processor writes for it (the placeholder, the BOS, the
        newline) and the run against them: the image's tokens alone."""
        from PIL import Image

        text = processor.image_token
        plain = text_ids(processor, self._processor_prompt(processor, text))
        expanded = expanded_ids(processor, text, Image.new("RGB", PROBE_IMAGE_SIZE))
        return text, plain, ImageRun.of(plain, expanded)

    def prompt_text(self, text: str) -> str:
        return self._processor_prompt(self.processor, text)

    @staticmethod
    def _processor_prompt(processor, text: str) -> str:
        """``text`` as PaliGemma's processor writes it, its placeholders not expanded."""
        image = processor.image_token
        bos_at = text.rfind(image) + len(image) if image in text else 0
        return f"{text[:bos_at]}{processor.tokenizer.bos_token}{text[bos_at:]}\n"


XD_POSITIONS_KEY = "position_ids"
"""Hunyuan-VL's processor output of 4-axis positions (``[1, 4, prompt tokens]``)."""
TOWER_MIXES_IMAGES = (
    "mlx-vlm's vision tower attends across a prompt's images, so each image's features depend on the others, "
    "where the engine encodes and caches each image alone"
)
"""Why Hunyuan-VL takes one image a prompt (``HunyuanVLModel._tower_mixes_images``)."""


class HunyuanVLModel(GenericVisionModel):
    """Hunyuan-VL: the generic path, with its 4-axis rotary positions (xdrope: base, w, h, t) passed
    with every call and applied at any cache offset.

    * Positions: its processor's (mlx-vlm keeps them as state on the text model, ``_position_ids``):
      each token's index on every axis, except inside an image's run, where every token but the
      first and last (the tower's begin and end features) takes the image's own grid values on the
      w, h and t axes, the same wherever the image stands. ``process`` keeps the image's, cut to its
      run; ``positions`` lays them over the token index. Delta 0: a generated token's position is
      its index, as mlx-vlm's decode has it.
    * Rotary at any offset: mlx-vlm's attention applies the 4-axis rotary only where the cache's
      offset (one scalar for the batch) is 0, its prefill, and 1-D rotary from the offset after.
      Rows of the engine's batch are at different offsets and an image may fall in any prefill
      chunk, so every call here takes the 4-axis path (``XdRopeTextModel``). Where all four axes are
      equal (text, generated tokens) it is the 1-D rotary exactly: same table rows, same formula.
    """

    model_types = ("hunyuan_vl",)
    position_axes = 4

    def check(self) -> None:
        """The generic check, and one image a prompt where the tower mixes a prompt's images."""
        self.uses_mrope = True  # the generic __init__ sets it from get_rope_index, which Hunyuan-VL lacks
        for layer in self.layers:
            layer.self_attn.rotary_emb = WholeRotaryTable(layer.self_attn.rotary_emb)
        super().check()
        if self.max_images_per_prompt is None and self._tower_mixes_images():
            self.max_images_per_prompt = 1
            self.images_limit_reason = TOWER_MIXES_IMAGES

    def _tower_mixes_images(self) -> bool:
        """Whether two images' rows from one ``get_input_embeddings`` call differ from each image's
        alone: mlx-vlm's tower runs one attention over all of a call's patches, no mask between images."""
        from PIL import Image

        width, height = PROBE_IMAGE_SIZE
        probes = [Image.new("RGB", (width, height), (96, 160, 32)), Image.new("RGB", (height, width), (32, 96, 160))]
        images = [self.process(probe, MediaPolicy.operator()) for probe in probes]
        alone = mx.concatenate([self.encode(image) for image in images])
        ids = mx.array([[token for image in images for token in image.token_ids]])
        pixels = mx.array(np.concatenate([image.pixel_values for image in images]))
        grids = mx.array(np.concatenate([image.encoder_inputs[GRID_KEY] for image in images]))
        # The runs' positions (else the model computes them with a function of its own that takes one image).
        positions = mx.array(np.concatenate([image.encoder_inputs[XD_POSITIONS_KEY] for image in images], axis=2))
        joint = self.model.get_input_embeddings(ids, pixels, image_grid_thw=grids, position_ids=positions)
        joint = joint.inputs_embeds[0]
        return not mx.allclose(joint, alone, atol=1e-5).item()

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        image = super().process(source, policy)
        own = image.encoder_inputs[XD_POSITIONS_KEY]  # [1, 4, the placeholder's expansion]
        start = self._run.prefix
        image.encoder_inputs[XD_POSITIONS_KEY] = own[:, :, start : start + image.num_tokens]
        return image

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        positions = np.broadcast_to(np.arange(len(token_ids)), (self.position_axes, len(token_ids))).copy()
        for image in images:
            own = np.asarray(image.encoder_inputs[XD_POSITIONS_KEY])[0]
            grid = own != own[:1]  # where an axis leaves the base (the token's index): the image's grid
            span = positions[:, image.offset : image.end]
            span[grid] = own[grid]
        return positions.astype(np.int64), 0

    def probe_split(self, embeds: mx.array, **features) -> LanguageSplit:
        """``XdRopeTextModel`` and the head, checked against mlx-vlm's own call over the check's image
        (its prefill: a fresh cache, the image's positions as the state ``get_input_embeddings`` left).

        Raises:
            UnsupportedModelError: The two disagree.
        """
        language = self.language
        head = getattr(language, "lm_head", None)
        head = language.model.embed_tokens.as_linear if head is None else head  # tied embeddings
        split = LanguageSplit(XdRopeTextModel(language.model, self.layers, self.position_axes), head)
        inputs = mx.zeros(embeds.shape[:2], dtype=mx.int32)
        positions = language._position_ids  # [1, 4, run]: the processor's, for the check's image
        whole = language(inputs, inputs_embeds=embeds, cache=self.make_cache()).logits
        ours = head(split.backbone(inputs, inputs_embeds=embeds, cache=self.make_cache(),
                                   position_ids=positions.transpose(1, 0, 2)))  # fmt: skip
        if not mx.allclose(whole, ours, atol=1e-5).item():
            raise UnsupportedModelError(
                "its 4-axis rotary positions, applied at every offset, differ from its own prefill"
            )
        return split


class XdRopeTextModel:
    """Hunyuan-VL's text model (mlx-vlm's ``HunyuanModel``) on its 4-axis rotary path in every call.

    Its attention takes that path only where ``cache_position_offset(cache)`` is 0, so the layers get
    their caches behind ``AtOffsetZero`` views; the mask is built from the real caches first (each
    row's offset, the paged layout), and each layer's rotary table is grown to the call's largest
    position (``WholeRotaryTable``: mlx-vlm would slice it to the offset, 0 here, plus the call's
    tokens). ``position_ids``: the runner's ``[4, B, T]``; None (the check's text-only calls): each
    row's offset onwards on every axis, the 1-D positions.
    """

    def __init__(self, text_model, layers, axes: int) -> None:
        self.text_model = text_model
        self.tables = [layer.self_attn.rotary_emb for layer in layers]
        self.axes = axes

    def __call__(self, inputs, inputs_embeds=None, cache=None, position_ids=None, **_):
        from mlx_vlm.models.base import create_attention_mask

        embeds = self.text_model.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        batch, length = embeds.shape[:2]
        if position_ids is None:
            offset = cache[0].offset if cache is not None else 0
            rows = mx.array(offset).reshape(-1, 1) + mx.arange(length)
            position_ids = mx.broadcast_to(rows[:, None, :], (batch, self.axes, length))
        else:
            position_ids = position_ids.transpose(1, 0, 2)  # mlx-vlm's [B, 4, T]
        largest = int(position_ids.max().item()) + 1
        for table in self.tables:
            table.reserve(largest)
        mask = create_attention_mask(embeds, cache) if cache is not None else None
        views = [AtOffsetZero(c) for c in cache] if cache is not None else None
        return self.text_model(inputs, inputs_embeds=embeds, mask=mask, cache=views, position_ids=position_ids)


class AtOffsetZero:
    """A layer's cache whose ``offset`` reads 0 (``XdRopeTextModel``); the rest is the cache's own."""

    offset = 0

    def __init__(self, cache) -> None:
        self.cache = cache

    def __getattr__(self, name: str):
        return getattr(self.cache, name)


class WholeRotaryTable:
    """A Hunyuan-VL layer's rotary table (mlx-vlm's ``HunyuanRotaryEmbedding``) given whole, at least
    ``reserve``'s length: mlx-vlm slices it to the cache's offset plus the call's tokens, where the
    engine's calls read it at positions past that (``XdRopeTextModel``). Table rows are the same
    whatever its length (each from its own position), so a 4-axis call (offset 0) reads the same values
    as mlx-vlm's; its 1-D path (``cos[-L:]`` at an offset) would not, and no call here takes it: the
    model instance is the engine's alone, and its every call goes through ``XdRopeTextModel``."""

    def __init__(self, table) -> None:
        self.table = table
        self.length = 0

    def reserve(self, length: int) -> None:
        self.length = max(self.length, length)

    def __call__(self, x: mx.array, seq_len: int) -> tuple[mx.array, mx.array]:
        self.table._update_cache(max(seq_len, self.length), x.dtype)
        return self.table._cos_cached, self.table._sin_cached


def _newline_run(tokens: list[int], newline_text, *, from_end: bool) -> int:
    """How many tokens at the end (or start) of ``tokens`` are newlines only."""
    count = 0
    for token in reversed(tokens) if from_end else tokens:
        if newline_text(token) is None:
            break
        count += 1
    return count


class LocateAnythingModel(GenericVisionModel):
    """LocateAnything: the generic path with numbered placeholders.

    Its processor expands ``<image-N>`` (the number ignored: the images are taken in order) to
    ``<img> <IMG_CONTEXT> x n </img>``, and refuses a prompt without as many of them as images:
    its ``image_token`` (``<IMG_CONTEXT>``) is what the run repeats, not a placeholder, and no
    attribute names the numbered one. So ``<image-1>`` is the placeholder, and every ``<image-N>``
    of a prompt becomes the run's token before tokenizing, as the processor replaces each (the generic
    path's numbered placeholders: ``vlm_placeholder.NUMBERED_PLACEHOLDERS``, which find it too; named
    here first, before its ``image_token``, which its processor refuses in a prompt)."""

    model_types = ("locateanything",)
    placeholder_texts = ("<image-1>",)


class Ernie4_5VLModel(GenericVisionModel):
    """ERNIE 4.5 VL: the generic path (token types for its vision experts, its batch-first 3-D
    positions) with the placeholder its processor expands: the chat template's whole
    ``<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>``, named by no attribute (its parts alone
    stay text, and the conventional ``<image>`` would be taken as a run of one character)."""

    model_types = ("ernie4_5_moe_vl",)
    placeholder_texts = ("<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>",)


class Phi4SigLipModel(GenericVisionModel):
    """Phi-4-SigLIP (Phi-4-reasoning-vision): the generic path (its processor leaves one ``-200`` mark per
    ``<image>``, an image the model expands), with the prompt its processor writes. mlx-vlm's
    ``Phi4SigLipProcessor`` wraps any text without ``<|im_start|>`` in the chat template (one user turn and
    the generation prompt) before tokenizing, so mlx-vlm generates over the wrapped prompt, and the
    processor's run for the placeholder alone sits inside that wrap. The engine wraps a prompt by the same
    rule (``chat_wrap_unless``: a chat prompt, which its template already wrote, holds ``<|im_start|>``),
    and the placeholder's own ids are the processor's for the placeholder alone, wrapped as its run is, so
    the run against them is the mark alone."""

    model_types = ("phi4-siglip",)
    chat_wrap_unless = "<|im_start|>"  # its processor's own test for a prompt the chat template wrote

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """``<image>``, the processor's ids for it without an image (the wrap around the placeholder
        token) and the run against its ids with one: the mark."""
        from mlx_vlm.models.phi4_siglip.processing_phi4_siglip import (
            DEFAULT_IMAGE_TOKEN,
        )
        from PIL import Image

        plain = np.asarray(processor(text=[DEFAULT_IMAGE_TOKEN])["input_ids"])[0].tolist()
        expanded = expanded_ids(processor, DEFAULT_IMAGE_TOKEN, Image.new("RGB", PROBE_IMAGE_SIZE))
        return DEFAULT_IMAGE_TOKEN, plain, ImageRun.of(plain, expanded)


class MllamaModel(GenericVisionModel):
    """Llama 3.2 Vision: the generic path, its image's states beside the embeddings (``IMAGE_STATES``, a held
    request's inputs), with what is its own: an image is its ``<|image|>`` token alone (the processor expands
    nothing; the token's row is its embedding), the processor writes the BOS after the prompt's leading images
    (``prompt_text``: the package's own function), and which images each prompt token sees comes from the
    whole prompt (``request_inputs``: the processor's rule and the model's mask code, both mlx-vlm's own).

    mlx-vlm's generation passes the masks with its prompt's calls and none with its decode steps (every image's
    states, unmasked): ``step_inputs`` does the same, past the prompt with masks that change nothing."""

    model_types = ("mllama",)
    builds_step_masks = True
    MASK, ROW_MASK = "cross_attention_mask", "full_text_row_masked_out_mask"

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """``<|image|>``, the ids of the prompt the processor writes for it (the image token, the BOS after
        it), and the run against them: the image token alone."""
        text = processor.image_token
        plain = text_ids(processor, self.prompt_text(text, processor))
        return text, plain, ImageRun(0, len(plain) - 1, processor.image_token_id)

    def prompt_text(self, text: str, processor=None) -> str:
        from mlx_vlm.models.mllama.processing_mllama import build_string_from_input

        processor = processor or self.processor
        return build_string_from_input(text, processor.bos_token, processor.image_token)

    def request_inputs(self, prompt_ids: list[int], images: list[ImageInput], features: list[mx.array]) -> dict:
        """The states of every image, and the prompt's masks as mlx-vlm's processor and model build them for
        the whole prompt: each image's tiles from its own processor output (``cross_attention_mask``)."""
        from mlx_vlm.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        inputs = super().request_inputs(prompt_ids, images, features)
        if not inputs:
            return inputs
        tiles = [int(np.asarray(image.encoder_inputs[self.MASK])[0, 0, 0].sum()) for image in images]
        spans = [get_cross_attention_token_mask(prompt_ids, self.image_token_id)]
        max_tiles = self.processor.image_processor.max_image_tiles
        dense = convert_sparse_cross_attention_mask_to_dense(spans, [tiles], max_tiles, len(prompt_ids))
        vision = self.model.config.vision_config
        per_tile = (vision.image_size // vision.patch_size) ** 2 + 1
        mask, rows = self.model._prepare_cross_attention_mask(mx.array(dense), num_vision_tokens=per_tile)
        return {**inputs, self.MASK: mask, self.ROW_MASK: rows}

    def step_inputs(self, request_inputs: dict, prompt_length: int, start: int, count: int) -> dict:
        """The states, and the masks of the call's positions: none for a decode step (as mlx-vlm's); past
        the prompt (a recomputed request's generated tokens) masks that leave every state seen, no row out."""
        states = {IMAGE_STATES: request_inputs[IMAGE_STATES]}
        if start >= prompt_length:
            return states
        mask, rows = request_inputs[self.MASK], request_inputs[self.ROW_MASK]
        past = max(start + count - prompt_length, 0)
        mask = mask[:, :, start : start + count - past]
        rows = rows[:, :, start : start + count - past]
        if past:
            mask = mx.concatenate([mask, mx.zeros((*mask.shape[:2], past, mask.shape[-1]), dtype=mask.dtype)], axis=2)
            rows = mx.concatenate([rows, mx.ones((*rows.shape[:2], past, rows.shape[-1]), dtype=rows.dtype)], axis=2)
        return {**states, self.MASK: mask, self.ROW_MASK: rows}


class WholePromptProcessor:
    """A DeepSeek-OCR-style processor called with ``inference_mode=False`` (``DeepseekOCRModel``); its other
    attributes are the processor's."""

    def __init__(self, processor) -> None:
        self._processor = processor

    def __call__(self, *args, **kwargs):
        return self._processor(*args, **kwargs, inference_mode=False)

    def __getattr__(self, name: str):
        return getattr(self._processor, name)


class DeepseekOCRModel(GenericVisionModel):
    """DeepSeek-OCR, DeepSeek-OCR 2 and Unlimited-OCR: the generic path, their processor told to keep the
    whole prompt. Why: in its default ``inference_mode`` it drops a prompt's last token (meant for an EOS
    that its training conversations end with and no prompt here has), so an image's run processed alone
    (``process``) would lose its last token, and every prompt its last word (mlx-vlm's generation does lose
    it)."""

    model_types = ("deepseekocr", "deepseekocr_2", "unlimited_ocr", "unlimited-ocr")  # its checkpoints spell it so

    def __init__(self, model, processor, config: dict, path) -> None:
        super().__init__(model, WholePromptProcessor(processor), config, path)


FAMILIES: tuple[type[VisionLanguageModel], ...] = (
    Qwen3VLModel,
    Qwen3_5Model,
    Gemma3Model,
    Gemma3nModel,
    Idefics2Model,
    MiniCPMVModel,
    MiniCPMV47Model,
    DeepseekVL2Model,
    FalconOCRModel,
    FalconPerceptionModel,
    LocateAnythingModel,
    HunyuanVLModel,
    PaliGemmaModel,
    Ernie4_5VLModel,
    Phi4SigLipModel,
    MllamaModel,
    DeepseekOCRModel,
)
"""The hooks: families whose prompt or positions the generic path cannot derive."""

TEXT_MODEL_REFUSALS: dict[str, str] = {
    "ministral3": "scales attention by the position of the batch's first row only (mlx-vlm's llama-4 "
    "scaling), so rows at other positions would get another row's scale",
    "mistral4": "uses multi-latent attention, which mlx-vlm's vision path does not page",
}
"""Text models (``text_config.model_type``) whose vision-language models are refused, and why:
what the load-time check cannot see because it runs one row."""

ARCHITECTURE_REFUSALS: dict[str, str] = {
    "molmo_point": "keeps per-request image state on the model between steps: its point predictor extends "
    "the logits over the image's patches, from the prefill's hidden states, and a logit processor follows "
    "the tokens generated so far (mlx-vlm routes its generation through the whole model's call), where the "
    "engine runs the text model alone over a batch",
}
"""Vision-language architectures (``model_type``) refused whatever their checkpoint, and why:
what the generic path's check at load cannot see (one call of the pieces, no generation)."""

PROCESSOR_HUB_REPOS = dict.fromkeys(("moondream1", "moondream2"), "moondream/starmie-v1")
"""Hugging Face Hub repos that an architecture's mlx-vlm processor loads from at every load, whatever the
checkpoint holds (Moondream 2's: its tokenizer, ``TOKENIZER_REPO``; the checkpoint bundles a stale one):
``_processor_hub_repo_at_hand`` finds or fetches them before anything loads."""
PROCESSOR_HUB_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""What a tokenizer repo's snapshot needs (its configs, vocabularies, merges, templates)."""


def supported_model_types() -> list[str]:
    """The architectures a family hook drives (every other one goes through the generic path)."""
    return sorted(t for family in FAMILIES for t in family.model_types)


def refusal(config: dict) -> str | None:
    """Why the vision-language model of ``config`` is refused before loading (None: it is not)."""
    model_type = config.get("model_type", "?")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is not None:
        return family.refusal(config)
    if model_type in ARCHITECTURE_REFUSALS:
        return f"it {ARCHITECTURE_REFUSALS[model_type]}"
    text_type = (config.get("text_config") or {}).get("model_type")
    reason = TEXT_MODEL_REFUSALS.get(text_type)
    return f"its text model {text_type!r} {reason}" if reason else None


def load_vision_language_model(path: Path, config: dict, trust_remote_code: bool = False) -> VisionLanguageModel:
    """Load the VLM in ``path`` with mlx-vlm and wrap it in its family hook or the generic adapter.

    ``path`` must have passed ``models.trust.check_model_code`` (mlx-vlm imports a config's
    ``model_file`` without asking); ``trust_remote_code`` goes on to the processor's loader.

    Raises:
        UnsupportedModelError: The config is refused (``refusal``), or the generic adapter's
            check at load finds what the model needs beyond it; the message says why.
        ModelSourceError: mlx-vlm is not installed, or cannot load the directory.
    """
    model_type = config.get("model_type", "?")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    reason = refusal(config)
    if reason is not None:
        raise UnsupportedModelError(
            f"vision-language architecture {model_type!r} is not supported by the paged engine: {reason}"
        )
    from vllm_mlx.models.portable_layers import make_portable

    _processor_hub_repo_at_hand(model_type)
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError as exc:
        raise ModelSourceError(
            f"{path} is a vision-language model; install the vlm extra: pip install 'vllm-mlx[vlm]'"
        ) from exc
    try:
        model = load_model(path)
        make_portable(model)  # Metal-only kernels (Muse Spark's) in MLX ops, on a backend without Metal
        processor = load_processor(path, add_detokenizer=False, trust_remote_code=trust_remote_code)
        # mlx-vlm's load puts the package's own image processor on every processor (a tokenizer alone too:
        # Bunny, Janus), in place of the one the checkpoint's processor config built (GLM-5-Next's then sizes
        # images by its defaults, not the config's token budget): the engine's images are laid out as its.
        _attach_image_processor(processor, path)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"cannot load the vision-language model in {path}: {exc}".splitlines()[0]) from exc
    except ImportError as exc:  # a processor class whose backend is missing: transformers' torch-only ones
        raise ModelSourceError(f"cannot load the vision-language model in {path}: {_first_paragraph(exc)}") from exc
    if family is not None:
        return family(model, processor, config, path)
    try:
        return GenericVisionModel(model, processor, config, path)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(
            f"vision-language architecture {model_type!r} is not supported by the paged engine: {exc}"
        ) from None


def _processor_hub_repo_at_hand(model_type: str) -> None:
    """The hub repo ``model_type``'s processor loads from (``PROCESSOR_HUB_REPOS``), found in the local hub
    cache or fetched into it before anything loads. Where it is neither (offline, not cached), a
    ``ModelSourceError`` at once naming it: transformers' own attempt, in the processor, retries for most of
    a minute first, then says nothing of which repo the checkpoint lacks."""
    repo = PROCESSOR_HUB_REPOS.get(model_type)
    if repo is None:
        return
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot_download(repo, allow_patterns=PROCESSOR_HUB_FILES)  # the cached snapshot when offline
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(
            f"the processor of {model_type!r} (mlx-vlm's) loads its tokenizer from the Hugging Face Hub repo "
            f"{repo!r} whatever the checkpoint holds, and that repo is neither in the local hub cache nor reachable "
            f"({_first_paragraph(exc)}); fetch it once where the hub is reachable (hf download {repo}) or copy that "
            "cache here (HF_HUB_CACHE); offline, set HF_HUB_OFFLINE=1 too, or the processor retries the hub first"
        ) from exc


def _attach_image_processor(processor, path: Path) -> None:
    """The model package's own image processor (its ``ImageProcessor``, where it has one) on ``processor``,
    as mlx-vlm's ``load`` attaches it: over the processor's own, or on a tokenizer alone (mlx-vlm's
    ``prepare_inputs`` then builds the prompt itself: ``vlm_generic.SplicingPromptBuilder``)."""
    from mlx_vlm.utils import load_image_processor

    image_processor = load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor


def _first_paragraph(exc: Exception) -> str:
    """The first paragraph of an error's message on one line (transformers' missing-backend errors
    start with a blank line and name one backend per paragraph)."""
    paragraphs = [" ".join(part.split()) for part in str(exc).split("\n\n")]
    return next((part for part in paragraphs if part), type(exc).__name__)

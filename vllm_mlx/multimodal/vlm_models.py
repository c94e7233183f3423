"""Vision-language models from mlx-vlm, as the paged engine drives them.

mlx-vlm's models run a whole prompt (pixels and all) through ``__call__`` with their own caches.
The engine needs the pieces instead, because one batch mixes rows at different stages:

* ``process(image)`` (caller's thread, numpy only): pixel values and the number of placeholder
  tokens the image occupies;
* ``encode(image)`` (engine thread): the vision encoder + projector, ``[num_tokens, hidden]``,
  once per image and cached by content hash in the MLLM cache;
* ``hidden_states`` / ``logits``: the language model over our paged KV cache, with the image
  features written over the placeholder embeddings (``ImageRows``) and, for Qwen2-VL and
  Qwen3-VL, explicit multi-axis rotary positions;
* ``make_cache``: the language model's per-layer caches (mlx-lm kinds), from which the runner
  derives one paged cache spec per layer (Gemma 3's sliding-window layers get their window).

A family adapter (``vlm_families.py``) knows one mlx-vlm architecture's layout. Architectures
without an adapter are refused at load with the list of supported ones (and, for some, why not
yet).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from vllm_mlx.core.multimodal import ImageInput, MultiModalInput
from vllm_mlx.multimodal.images import ImageSource, image_content_hash
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import ImageInputError

__all__ = ["ImageRows", "VisionLanguageModel", "is_vision_language_config"]


VISION_TOWER_KEYS = ("vision_config", "img_processor")
"""Config keys that name a vision tower's settings: ``vision_config``, or Phi-3-vision's ``img_processor``
(its checkpoints name no ``vision_config``: mlx-vlm builds its CLIP tower from constants of its own)."""


def is_vision_language_config(config: dict) -> bool:
    """True for a model directory mlx-vlm should load (it has a vision tower, ``VISION_TOWER_KEYS``): at
    the config's root, or in a sub-model's config (Qwen3-Omni's ``thinker_config``, whose model mlx-vlm
    loads whole and whose ``get_input_embeddings`` delegates to that sub-model)."""
    if any(key in config for key in VISION_TOWER_KEYS):
        return True
    return any(isinstance(value, dict) and "vision_config" in value for value in config.values())


@dataclass
class ImageRows:
    """The image features one forward call writes over placeholder embeddings.

    ``features[i]`` belongs at flat position ``index[i]`` (``row * width + column``) of the
    ``[batch, width]`` call. Rows come in batch order and positions ascend within a row: the
    order in which mlx-vlm's Qwen3-VL consumes its deepstack features.
    """

    index: list[int]
    features: mx.array
    """``[len(index), feature_width]``: the encoder's rows, as ``encode`` returned them."""
    batch: int
    width: int

    def scatter(self, embeds: mx.array, features: mx.array) -> mx.array:
        """``embeds`` (``[batch, width, hidden]``) with ``features`` at the image positions."""
        hidden = embeds.shape[-1]
        flat = embeds.reshape(self.batch * self.width, hidden)
        flat[mx.array(self.index)] = features.astype(flat.dtype)
        return flat.reshape(self.batch, self.width, hidden)

    def mask(self) -> mx.array:
        """``[batch, width]`` booleans: True at the image positions."""
        mask = np.zeros(self.batch * self.width, dtype=bool)
        mask[self.index] = True
        return mx.array(mask.reshape(self.batch, self.width))


class VisionLanguageModel:
    """One mlx-vlm model: the vision side, the language side, the processor and the prompt rules.

    Subclasses set ``model_types``, the placeholder text of one image in a plain prompt, and
    implement ``process`` and ``encode``; ``language_hidden_states`` (or ``hidden_states``) if
    the text model needs more than embeddings and the KV cache, ``image_frame`` if the prompt
    frames an image with tokens of its own.

    Invariant: an image is one contiguous run of ``image.num_tokens`` prompt tokens
    (``image_tokens``), ``encode(image)`` has one row per token of that run, and
    ``hidden_states`` receives exactly those rows (sliced per step) in ``ImageRows.features``.
    A run may hold marker tokens between the feature tokens (Mistral 3's ``[IMG_BREAK]``,
    SmolVLM's tile markers): their rows are their own embeddings. Whatever a family keeps per
    image token besides the input embedding (Qwen3-VL's deepstack) travels in those rows too,
    so the runner, the MLLM cache and prefix reuse need no family knowledge.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    uses_mrope: ClassVar[bool] = False
    position_axes: ClassVar[int] = 3
    """Axes of ``uses_mrope`` positions (``positions``' first dimension): Qwen2-VL's t, h, w; 4 for
    Hunyuan-VL's base, w, h, t."""
    image_placeholder_text: ClassVar[str] = ""
    """What one image looks like in a prompt written without the chat template."""
    image_token_id: int
    """The token each image feature occupies in the expanded prompt."""
    placeholder_token_id: int
    """The token that stands for a whole image in a prompt before expansion (for most families
    ``image_token_id`` itself; Gemma 3's ``<start_of_image>``)."""
    encoder_decoder: bool = False
    """An encoder-decoder text model (Florence-2's BART): the prompt, images over their tokens, goes
    through the encoder once; the decoder starts from its start token and reads the generated tokens,
    over caches of its own and the encoder's outputs (``EncoderOutputs``), held per request
    (``executor/held_caches.py``; ``encoder_decoder_hidden_states``)."""
    max_images_per_prompt: int | None = None
    """Most images one prompt may carry for this model (None: no limit of its own); a request with
    more is refused alone (``check_image_count``), never served with images the model cannot place."""
    images_limit_reason: str = ""
    """Why the model takes no more than ``max_images_per_prompt`` images, for the refusal."""
    request_state: ClassVar[tuple[str, ...]] = ()
    """Attributes (dotted paths from this adapter) in which the model keeps one request's state between
    its calls (Falcon Perception's decoded coordinates): the engine then holds each request's caches
    and this state (``executor/held_caches.py``), runs one row a call, and puts the row's state on the
    model for its call (``put_request_state``), taking it back after (``take_request_state``)."""

    def __init__(self, model, processor, config: dict, path: Path) -> None:
        self.model = model
        self.processor = processor
        self.config = config
        self.path = path
        self.language = model.language_model
        # The architecture as the config names it: the runner's layer checks key on it (the
        # text model's own type, e.g. "qwen3_5_text", is not the one they list).
        self.model_type = config.get("model_type")
        self.image_token_id = self._image_token_id()
        self.placeholder_token_id = self._placeholder_token_id()
        # Everything that turns pixels into encoder input: part of every image's cache key.
        self.processor_key = (str(path), _preprocessor_settings(path))

    # ---- the model as the runner sees it --------------------------------------------------

    @property
    def layers(self) -> list:
        """The language model's decoder layers (one paged KV cache each)."""
        return self.language.model.layers

    @property
    def args(self):
        """The text model's config object (KV sizing reads defaults the config file omits)."""
        return getattr(self.language, "args", None) or getattr(self.language, "config", None)

    def make_cache(self) -> list:
        """The language model's caches, one per layer, as mlx-lm cache kinds.

        ``attention.layer_specs`` reads the kind of each (full attention, sliding window,
        anything else refused). mlx-vlm has its own ``KVCache``/``RotatingKVCache`` classes;
        they are mapped to mlx-lm's here, so the runner needs no second vocabulary (and so is
        mlx-vlm's ``ArraysCache``: recurrent state, checked by the config's ``model_type``, and its
        ``CacheList``, member by member: Inkling's short-convolution state beside the KV).
        """
        from mlx_lm.models.cache import KVCache

        if self.encoder_decoder:  # its own classes and the encoder's outputs: never paged, held per request
            return self.held_caches()
        make = getattr(self.language, "make_cache", None)
        if make is None:
            return [KVCache() for _ in self.layers]
        return [_as_mlx_lm_cache(cache) for cache in make()]

    def held_caches(self) -> list:
        """The text model's own caches, its package's classes as they are, for a model the
        runner serves with per-request caches (``executor/held_caches.py``); an encoder-decoder's
        end with its ``EncoderOutputs``."""
        make = getattr(self.language, "make_cache", None)
        if self.encoder_decoder:
            return [*make(), EncoderOutputs()]
        return make() if make is not None else self.make_cache()

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        """Text only, over ``make_cache()``'s caches: ``state_pool.probe_state_layout`` runs a
        token this way to read the recurrent states a hybrid text model leaves."""
        return self.hidden_states(inputs, cache, None, None)

    def embed(self, inputs: mx.array) -> mx.array:
        return self.language.model.embed_tokens(inputs)

    def hidden_states(
        self, inputs: mx.array, cache: list, position_ids: mx.array | None, images: ImageRows | None
    ) -> mx.array:
        """The language model's last hidden states for ``inputs`` (``[B, T]``), with ``images``
        written over their placeholders' embeddings."""
        embeds = self.embed(inputs)
        if images is not None:
            embeds = images.scatter(embeds, images.features)
        return self.language_hidden_states(embeds, inputs, cache, position_ids)

    def language_hidden_states(self, embeds: mx.array, inputs: mx.array, cache: list, position_ids):
        return self.language.model(inputs, inputs_embeds=embeds, cache=cache)

    def logits(self, hidden: mx.array) -> mx.array:
        head = getattr(self.language, "lm_head", None)
        return head(hidden) if head is not None else self.language.model.embed_tokens.as_linear(hidden)

    def put_request_state(self, state: dict | None, request) -> None:
        """Set ``request_state``'s attributes to ``state``, or to ``fresh_request_state(request)`` where
        the request has none yet (its first call, or its caches made fresh)."""
        for path, value in (state if state is not None else self.fresh_request_state(request)).items():
            owner, _, name = path.rpartition(".")
            setattr(self._attribute_owner(owner), name, value)

    def take_request_state(self) -> dict:
        """``request_state``'s attributes as the row's call left them."""
        state = {}
        for path in self.request_state:
            owner, _, name = path.rpartition(".")
            state[path] = getattr(self._attribute_owner(owner), name)
        return state

    def fresh_request_state(self, request) -> dict:
        """``request_state`` of a request before its first call (a family with state gives its own)."""
        raise NotImplementedError

    def _attribute_owner(self, path: str):
        owner = self
        for name in filter(None, path.split(".")):
            owner = getattr(owner, name)
        return owner

    # ---- prompts ---------------------------------------------------------------------------

    def check_image_count(self, count: int) -> None:
        """Raise ``ValueError`` if a prompt with ``count`` images is more than the model takes."""
        limit = self.max_images_per_prompt
        if limit is not None and count > limit:
            raise ValueError(
                f"this model takes at most {limit} image(s) per prompt ({self.images_limit_reason}); "
                f"this one has {count}: send the images in separate requests"
            )

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def prepare(
        self, token_ids: list[int], images: list[ImageSource], policy: MediaPolicy
    ) -> tuple[list[int], MultiModalInput]:
        """Expand each image placeholder token into the image's run of tokens (``image_tokens``,
        framed by ``image_frame``).

        ``token_ids`` must hold exactly one ``placeholder_token_id`` per image, in image order;
        each image is loaded under ``policy``. Raises ``ImageInputError`` for a bad image
        (naming its position when there are several) and ``ValueError`` for a count mismatch.
        """
        slots = [i for i, t in enumerate(token_ids) if t == self.placeholder_token_id]
        if len(slots) != len(images):
            raise ValueError(
                f"the prompt has {len(slots)} image placeholder(s) but {len(images)} image(s) were given"
            )
        expanded: list[int] = []
        placed: list[ImageInput] = []
        cursor = 0
        for index, (slot, source) in enumerate(zip(slots, images)):
            try:
                image = self.process(source, policy)
            except ImageInputError as exc:
                if len(images) == 1:
                    raise
                raise ImageInputError(f"image {index + 1} of {len(images)}: {exc}") from None
            before, after = self.image_frame_at(index)
            self._extend(expanded, token_ids[cursor:slot])
            self._extend(expanded, before)
            image.offset = len(expanded)
            expanded += self.image_tokens(image)
            expanded += after
            placed.append(image)
            cursor = slot + 1
        self._extend(expanded, token_ids[cursor:])
        return expanded, self.multimodal_input(len(expanded), placed)

    chat_wrap_unless: str | None = None
    """A family whose processor wraps a text prompt in one user turn of the chat template unless it holds
    this mark (Phi-4-SigLIP's ``<|im_start|>``): the engine wraps an image prompt the same way, rendering the
    template in its guarded workers (the text is the request's), so the prompt is the one mlx-vlm generates on."""

    def prompt_text(self, text: str) -> str:
        """A text prompt with images as it is tokenized for ``prepare`` (the generic adapter
        writes one token in for a placeholder of several: ``ImageRun.stand_in``)."""
        return text

    def image_frame(self) -> tuple[list[int], list[int]]:
        """Tokens the expansion puts before and after an image's run of feature tokens."""
        return [], []

    def image_frame_at(self, index: int) -> tuple[list[int], list[int]]:
        """The frame of the prompt's ``index``-th image (from 0): ``image_frame`` for most families;
        MiniCPM-V's processor numbers the images of a prompt in text before each one."""
        return self.image_frame()

    def image_tokens(self, image: ImageInput) -> list[int]:
        """The ``image.num_tokens`` token ids whose embeddings ``encode``'s rows replace."""
        if image.token_ids is not None:
            return list(image.token_ids)
        return [self.image_token_id] * image.num_tokens

    def _extend(self, expanded: list[int], tokens: list[int]) -> None:
        """Append ``tokens`` (a piece of text, or an image's leading frame) to ``expanded``."""
        expanded += tokens

    def multimodal_input(self, num_tokens: int, images: list[ImageInput]) -> MultiModalInput:
        return MultiModalInput(images)

    def text_only_input(self, num_tokens: int) -> MultiModalInput | None:
        """What a prompt of ``num_tokens`` text tokens and no image needs beside its ids: None for a
        causal text model; a prefix LM's (PaliGemma's) whole prompt attends both ways, a span without
        an image (``GenericVisionModel``), which the scheduler and the masks keep as an image's."""
        return None

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """``(positions [position_axes, len(token_ids)], rope_delta)`` of a prompt whose ``multimodal_input``
        left them None (``uses_mrope`` models that compute them with MLX: the engine thread
        asks at the prompt's first step)."""
        raise NotImplementedError

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        """Load (under ``policy``) and preprocess one image (numpy only: safe on any thread)."""
        raise NotImplementedError

    def encode(self, image: ImageInput) -> mx.array:
        """The image's features, ``[image.num_tokens, hidden]`` (engine thread)."""
        raise NotImplementedError

    @classmethod
    def refusal(cls, config: dict) -> str | None:
        """Why this family's adapter cannot run the model in ``config`` (None: it can); checked
        before anything is loaded."""
        return None

    def _image_token_id(self) -> int:
        raise NotImplementedError

    def _placeholder_token_id(self) -> int:
        return self.image_token_id

    def _hash(self, image) -> str:
        return image_content_hash(image, self.processor_key)


class EncoderOutputs:
    """An encoder-decoder request's encoder outputs, beside its decoder's caches (``held_caches``): its
    decoder layers attend to them only where given (their cross-attention caches hold the keys).
    Never trimmed: the decoder's positions are not the engine's, so a rewound request starts afresh."""

    def __init__(self) -> None:
        self.outputs: mx.array | None = None

    @property
    def state(self) -> list[mx.array]:
        return [self.outputs] if self.outputs is not None else []

    @property
    def nbytes(self) -> int:
        return self.outputs.nbytes if self.outputs is not None else 0

    def is_trimmable(self) -> bool:
        return False


def _preprocessor_settings(path: Path) -> Any:
    """The image processor's config as plain data ({} when the directory has none)."""
    file = path / "preprocessor_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _as_mlx_lm_cache(cache):
    """mlx-vlm's cache kinds as mlx-lm's (``make_cache``); any other kind is left as it is, for
    ``layer_specs`` to name."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    kind = type(cache).__name__
    if kind == "KVCache":
        return KVCache()
    if kind == "RotatingKVCache" and cache.keep == 0:
        return RotatingKVCache(max_size=cache.max_size, keep=0)
    if kind == "ArraysCache":
        return ArraysCache(len(cache.cache))
    if kind == "CacheList":
        return CacheList(*(_as_mlx_lm_cache(member) for member in cache.caches))
    return cache

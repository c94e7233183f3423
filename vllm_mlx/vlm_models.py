"""Vision-language models from mlx-vlm, as the paged engine drives them.

mlx-vlm's models run a whole prompt (pixels and all) through ``__call__`` with their own caches.
The engine needs the pieces instead, because one batch mixes rows at different stages:

* ``process(image)`` (caller's thread, numpy only): pixel values and the number of placeholder
  tokens the image occupies;
* ``encode(image)`` (engine thread): the vision encoder + projector, ``[num_tokens, hidden]``,
  once per image and cached by content hash in the MLLM cache;
* ``embed`` / ``hidden_states`` / ``logits``: the language model over our paged KV cache, with
  the image features written over the placeholder embeddings and, for Qwen2-VL, explicit
  multi-axis rotary positions.

A family adapter knows one mlx-vlm architecture's layout. Architectures without an adapter are
refused at load with the list of supported ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from vllm_mlx.attention import UnsupportedModelError
from vllm_mlx.errors import ImageInputError, ModelSourceError
from vllm_mlx.images import ImageSource, image_content_hash, load_image
from vllm_mlx.media_policy import MediaPolicy
from vllm_mlx.multimodal import ImageInput, MultiModalInput, mrope_positions

__all__ = ["VisionLanguageModel", "is_vision_language_config", "load_vision_language_model"]


def is_vision_language_config(config: dict) -> bool:
    """True for a model directory mlx-vlm should load (it has a vision tower)."""
    return "vision_config" in config


class VisionLanguageModel:
    """One mlx-vlm model: the vision side, the language side, the processor and the prompt rules.

    Subclasses set ``model_types``, the placeholder text of one image in a plain prompt, and
    implement ``process`` and ``encode`` (and ``hidden_states`` if the model needs more than
    embeddings and the KV cache).
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    uses_mrope: ClassVar[bool] = False
    image_placeholder_text: ClassVar[str] = ""
    """What one image looks like in a prompt written without the chat template."""

    def __init__(self, model, processor, config: dict, path: Path) -> None:
        self.model = model
        self.processor = processor
        self.config = config
        self.path = path
        self.language = model.language_model
        self.image_token_id = self._image_token_id()
        # Everything that turns pixels into encoder input: part of every image's cache key.
        self.processor_key = (str(path), _preprocessor_settings(path))

    # ---- the model as the runner sees it --------------------------------------------------

    @property
    def layers(self) -> list:
        """The language model's decoder layers (one paged KV cache each)."""
        return self.language.model.layers

    def embed(self, inputs: mx.array) -> mx.array:
        return self.language.model.embed_tokens(inputs)

    def hidden_states(self, embeds: mx.array, inputs: mx.array, cache: list, position_ids: mx.array | None):
        return self.language.model(inputs, inputs_embeds=embeds, cache=cache)

    def logits(self, hidden: mx.array) -> mx.array:
        head = getattr(self.language, "lm_head", None)
        return head(hidden) if head is not None else self.language.model.embed_tokens.as_linear(hidden)

    # ---- prompts ---------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def prepare(
        self, token_ids: list[int], images: list[ImageSource], policy: MediaPolicy
    ) -> tuple[list[int], MultiModalInput]:
        """Expand each image placeholder token into the image's run of feature placeholders.

        ``token_ids`` must hold exactly one ``image_token_id`` per image, in image order; each
        image is loaded under ``policy``. Raises ``ImageInputError`` for a bad image (naming
        its position when there are several) and ``ValueError`` for a count mismatch.
        """
        slots = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
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
            expanded += token_ids[cursor:slot]
            image.offset = len(expanded)
            expanded += [self.image_token_id] * image.num_tokens
            placed.append(image)
            cursor = slot + 1
        expanded += token_ids[cursor:]
        return expanded, self.multimodal_input(len(expanded), placed)

    def multimodal_input(self, num_tokens: int, images: list[ImageInput]) -> MultiModalInput:
        return MultiModalInput(images)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        """Load (under ``policy``) and preprocess one image (numpy only: safe on any thread)."""
        raise NotImplementedError

    def encode(self, image: ImageInput) -> mx.array:
        """The image's features, ``[image.num_tokens, hidden]`` (engine thread)."""
        raise NotImplementedError

    def _image_token_id(self) -> int:
        raise NotImplementedError

    def _hash(self, image) -> str:
        return image_content_hash(image, self.processor_key)


class Qwen2VLModel(VisionLanguageModel):
    """Qwen2-VL and Qwen2.5-VL: dynamic-resolution patches, 2×2 merge, multi-axis rotary."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
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

    def hidden_states(self, embeds, inputs, cache, position_ids):
        return self.language.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=position_ids)


class LlavaModel(VisionLanguageModel):
    """LLaVA 1.5: a CLIP tower at a fixed resolution, a two-layer projector, a llama."""

    model_types = ("llava",)
    image_placeholder_text = "<image>\n"

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_index)

    @property
    def tokens_per_image(self) -> int:
        vision = self.model.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        # The image processor alone: mlx-vlm's llava processor passes a ``padding`` argument
        # that transformers 5's image processors reject, and we expand the placeholders ourselves.
        pixels = np.asarray(self.processor.image_processor(images=[rgb], return_tensors="np")["pixel_values"])
        return ImageInput(self._hash(rgb), rgb, pixels, offset=0, num_tokens=self.tokens_per_image)

    def encode(self, image: ImageInput) -> mx.array:
        model = self.model
        pixels = mx.array(image.pixel_values).transpose(0, 2, 3, 1)  # NCHW -> NHWC
        *_, hidden = model.vision_tower(pixels, output_hidden_states=True)
        layer = model.vision_feature_layer
        if not isinstance(layer, int):
            raise UnsupportedModelError("llava with several vision feature layers is not supported")
        selected = hidden[layer]
        if model.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]  # drop the CLS token
        features = model.multi_modal_projector(selected)
        return features.reshape(-1, features.shape[-1])


FAMILIES: tuple[type[VisionLanguageModel], ...] = (Qwen2VLModel, LlavaModel)


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def load_vision_language_model(path: Path, config: dict, trust_remote_code: bool = False) -> VisionLanguageModel:
    """Load the VLM in ``path`` with mlx-vlm and wrap it in its family adapter.

    ``path`` must have passed ``models.trust.check_model_code`` (mlx-vlm imports a config's
    ``model_file`` without asking); ``trust_remote_code`` goes on to the processor's loader.

    Raises:
        UnsupportedModelError: No adapter for the architecture.
        ModelSourceError: mlx-vlm is not installed, or cannot load the directory.
    """
    model_type = config.get("model_type", "?")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        raise UnsupportedModelError(
            f"vision-language architecture {model_type!r} is not supported by the paged engine "
            f"(supported: {', '.join(supported_model_types())})"
        )
    try:
        from mlx_vlm.utils import load_model, load_processor
    except ImportError as exc:
        raise ModelSourceError(
            f"{path} is a vision-language model; install the vlm extra: pip install 'vllm-mlx[vlm]'"
        ) from exc
    try:
        model = load_model(path)
        processor = load_processor(path, add_detokenizer=False, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"cannot load the vision-language model in {path}: {exc}".splitlines()[0]) from exc
    return family(model, processor, config, path)


def _preprocessor_settings(path: Path) -> Any:
    """The image processor's config as plain data ({} when the directory has none)."""
    file = path / "preprocessor_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}

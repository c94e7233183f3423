"""The family adapters: how each supported mlx-vlm architecture is driven by the paged engine.

Each adapter subclasses ``vlm_models.VisionLanguageModel`` and knows one layout: how an image is
preprocessed and how many tokens it occupies, how the prompt frames it, how the vision tower and
projector turn it into features, and what the language model needs besides embeddings
(multi-axis positions, deepstack features). ``FAMILIES`` lists them; ``NOT_YET`` names
architectures refused for a known reason; ``load_vision_language_model`` picks the adapter.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from vllm_mlx.core.multimodal import ImageInput, MultiModalInput, mrope_positions
from vllm_mlx.executor.attention import UnsupportedModelError
from vllm_mlx.multimodal.images import ImageSource, load_image
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.multimodal.vlm_models import VisionLanguageModel
from vllm_mlx.platform.errors import ModelSourceError

__all__ = [
    "FAMILIES",
    "NOT_YET",
    "Gemma3Model",
    "LlavaModel",
    "Mistral3Model",
    "Qwen2VLModel",
    "Qwen3VLModel",
    "Qwen3_5Model",
    "SmolVLMModel",
    "load_vision_language_model",
    "supported_model_types",
]


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

    def language_hidden_states(self, embeds, inputs, cache, position_ids):
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

    model_types = ("qwen3_5", "qwen3_5_moe")
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


class Gemma3Model(VisionLanguageModel):
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


class Mistral3Model(VisionLanguageModel):
    """Mistral 3 (Mistral Small 3.1 and later): a Pixtral tower at the image's own resolution
    (up to ``longest_edge``), a patch merger (2x2 patches -> 1 token) and a Mistral text model.

    An image is ``[IMG]`` in the prompt and expands, row by row of merged patches, to
    ``[IMG] x cols [IMG_BREAK]`` ... ``[IMG] x cols [IMG_END]``. Only the ``[IMG]`` positions
    get features; the break and end tokens keep their own embeddings. ``encode`` returns a row
    for every token of that block, the break/end rows being those tokens' embeddings, so the
    block is one contiguous run as the runner and the MLLM cache expect (writing a token's own
    embedding over it changes nothing).

    Text models with a position-dependent attention scale (``ministral3``'s llama-4 scaling,
    computed by mlx-vlm from the batch's first row only) or multi-latent attention
    (``mistral4``) are refused at load.
    """

    model_types = ("mistral3",)
    image_placeholder_text = "[IMG]"
    text_types = ("mistral",)

    @classmethod
    def refusal(cls, config: dict) -> str | None:
        text_type = (config.get("text_config") or {}).get("model_type", "mistral")
        if text_type in cls.text_types:
            return None
        return (
            f"its text model {text_type!r} is not one the adapter drives ({', '.join(cls.text_types)}; "
            "ministral3 scales attention by the position of the batch's first row only, mistral4 "
            "uses latent attention)"
        )

    def __init__(self, model, processor, config: dict, path) -> None:
        super().__init__(model, processor, config, path)
        self.break_token_id = self._token_id(getattr(processor, "image_break_token", "[IMG_BREAK]"))
        self.end_token_id = self._token_id(getattr(processor, "image_end_token", "[IMG_END]"))

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_index)

    def _token_id(self, token: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(token))

    @property
    def token_pixels(self) -> int:
        """Side of the square of pixels one merged token covers."""
        return int(self.model.config.vision_config.patch_size) * int(self.model.config.spatial_merge_size)

    def grid(self, image: ImageInput) -> tuple[int, int]:
        """(rows, cols) of merged tokens: the resized image's size over ``token_pixels``."""
        height, width = image.pixel_values.shape[-2:]
        return height // self.token_pixels, width // self.token_pixels

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        out = self.processor.image_processor([rgb], patch_size=self.token_pixels)
        pixels = np.asarray(out["pixel_values"])  # one image: no padding
        image = ImageInput(self._hash(rgb), rgb, pixels, offset=0, num_tokens=0)
        rows, cols = self.grid(image)
        image.num_tokens = rows * (cols + 1)  # each row ends with [IMG_BREAK], the last with [IMG_END]
        return image

    def image_tokens(self, image: ImageInput) -> list[int]:
        rows, cols = self.grid(image)
        row = [self.image_token_id] * cols
        return [*([*row, self.break_token_id] * (rows - 1)), *row, self.end_token_id]

    def encode(self, image: ImageInput) -> mx.array:
        model = self.model
        height, width = image.pixel_values.shape[-2:]
        pixels = mx.array(image.pixel_values).transpose(0, 2, 3, 1)  # NCHW -> NHWC
        *_, hidden = model.vision_tower(pixels, output_hidden_states=True, image_sizes=[(height, width)])
        features = model.multi_modal_projector(hidden[model.vision_feature_layer][0], [(height, width)])
        rows, cols = self.grid(image)
        separators = self.embed(mx.array([self.break_token_id, self.end_token_id])).astype(features.dtype)
        pieces = []
        for r in range(rows):
            last = r == rows - 1
            pieces += [features[r * cols : (r + 1) * cols], separators[1:] if last else separators[:1]]
        return mx.concatenate(pieces)


class SmolVLMModel(VisionLanguageModel):
    """SmolVLM (Idefics3's layout): a SigLIP tower on tiles of the image plus a downscaled
    global view, a pixel-shuffle connector, and a llama text model.

    An image is ``<image>`` in the prompt; the processor splits it into rows x cols tiles and
    expands it to ``<fake_token_around_image><row_i_col_j><image> x image_seq_len`` per tile,
    newlines after each row, then the global view framed the same way. ``process`` builds that
    block with mlx-vlm's own prompt builder and tokenizes it alone (it begins and ends with a
    special token, so it tokenizes the same in context); ``encode`` returns a row per block
    token: mlx-vlm's ``get_input_embeddings`` on the block's ids, i.e. the marker tokens' own
    embeddings with the features at the ``<image>`` positions.

    mlx-vlm's Idefics3 text model computes its logits in ``__call__`` and has no hidden-state
    entry point, so ``language_hidden_states`` runs its layers and norm itself (the same three
    steps as its ``__call__``, without the vocabulary projection, which ``logits`` applies to
    the sampled positions only).
    """

    model_types = ("smolvlm",)
    image_placeholder_text = "<image>"

    def _image_token_id(self) -> int:
        return int(self.model.config.image_token_index)

    @property
    def layers(self) -> list:
        return self.language.layers

    def embed(self, inputs: mx.array) -> mx.array:
        return self.language.embed_tokens(inputs)

    def language_hidden_states(self, embeds, inputs, cache, position_ids):
        from mlx_vlm.models.base import create_attention_mask

        language = self.language
        hidden = embeds.astype(language.norm.weight.dtype)
        mask = create_attention_mask(hidden, cache)
        for layer, layer_cache in zip(language.layers, cache):
            hidden = layer(hidden, mask, layer_cache)
        return language.norm(hidden)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        out = self.processor.image_processor([[rgb]], return_row_col_info=True, return_tensors="np")
        rows, cols = int(np.ravel(out["rows"])[0]), int(np.ravel(out["cols"])[0])
        [text] = self.processor.expand_text_with_image_tokens([self.image_placeholder_text], [[rows]], [[cols]])
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        extra = {"pixel_attention_mask": np.asarray(out["pixel_attention_mask"])}
        pixels = np.asarray(out["pixel_values"])
        return ImageInput(
            self._hash(rgb), rgb, pixels, 0, len(token_ids), token_ids=token_ids, encoder_inputs=extra
        )

    def encode(self, image: ImageInput) -> mx.array:
        inputs = {name: mx.array(value) for name, value in image.encoder_inputs.items()}
        out = self.model.get_input_embeddings(
            mx.array([image.token_ids]), mx.array(image.pixel_values), **inputs
        )
        return out.inputs_embeds[0]


def _newline_run(tokens: list[int], newline_text, *, from_end: bool) -> int:
    """How many tokens at the end (or start) of ``tokens`` are newlines only."""
    count = 0
    for token in reversed(tokens) if from_end else tokens:
        if newline_text(token) is None:
            break
        count += 1
    return count


FAMILIES: tuple[type[VisionLanguageModel], ...] = (
    Qwen2VLModel,
    Qwen3VLModel,
    Qwen3_5Model,
    LlavaModel,
    Gemma3Model,
    Mistral3Model,
    SmolVLMModel,
)

# Architectures mlx-vlm runs that the paged engine refuses for a known reason.
NOT_YET: dict[str, str] = {}


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def load_vision_language_model(path: Path, config: dict, trust_remote_code: bool = False) -> VisionLanguageModel:
    """Load the VLM in ``path`` with mlx-vlm and wrap it in its family adapter.

    ``path`` must have passed ``models.trust.check_model_code`` (mlx-vlm imports a config's
    ``model_file`` without asking); ``trust_remote_code`` goes on to the processor's loader.

    Raises:
        UnsupportedModelError: No adapter for the architecture, or its adapter refuses the
            config (``refusal``); the message says why where it is known.
        ModelSourceError: mlx-vlm is not installed, or cannot load the directory.
    """
    model_type = config.get("model_type", "?")
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    reason = NOT_YET.get(model_type) if family is None else family.refusal(config)
    if family is None or reason is not None:
        raise UnsupportedModelError(
            f"vision-language architecture {model_type!r} is not supported by the paged engine"
            f"{f': {reason}' if reason else ''} (supported: {', '.join(supported_model_types())})"
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

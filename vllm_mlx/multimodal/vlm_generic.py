"""Any mlx-vlm architecture, driven through the interfaces mlx-vlm's models share.

mlx-vlm's own generation never calls a model whole: the processor expands each image into its
run of tokens, ``Model.get_input_embeddings(input_ids, pixel_values, mask, **processor_outputs)``
merges the vision features into the token embeddings, and ``Model.language_model(inputs,
inputs_embeds=..., cache=...)`` runs the text model over mlx-lm style caches. So does this
adapter, a piece at a time, for rows at different stages of one batch:

* ``process`` (caller's thread): the processor on the image's placeholder text alone. Its ids
  against the placeholder's own give the image's run (``ImageRun.of``: what the processor put
  where the placeholder stood, frames and markers included); its other outputs (pixels, grid
  sizes, masks) are the image's encoder inputs.
* ``encode`` (engine thread): ``get_input_embeddings`` on the run's ids and the image's encoder
  inputs: one row per run token (features at the image positions, the markers' own embeddings
  elsewhere), which the MLLM cache keeps per image content hash.
* ``hidden_states``: ``get_input_embeddings`` without pixels (the text embeddings), the run's
  rows written over their positions, then the language model over the paged caches. Its logits
  are split into backbone and head where that split reproduces them exactly (``LanguageSplit``).

* per-token features: what ``get_input_embeddings`` returns beside the embeddings, one row per
  token, for text alone too (``TOKEN_FEATURES``: Gemma 3n's and Gemma 4's ``per_layer_inputs``,
  computed from each token's id with the image's tokens as padding; Falcon OCR's 2-D positions
  ``pos_hw``, which the text-only call omits: zeros there, ``ZERO_AT_TEXT``), travels as the
  embeddings do: the run's rows are kept with them (``encode`` appends them, flattened, at the
  widest dtype of the parts), the text's come from the text-only call, and the language model gets
  the whole batch's by name.
* both ways: a text model whose image blocks attend to themselves both ways
  (``use_bidirectional_attention="vision"``: Gemma 4; mlx-vlm overlays each block of vision
  tokens on its causal mask) gets each block's span in the prompt's ``MultiModalInput.both_ways``:
  the engine's masks let a query in a span see all its keys, the scheduler keeps a span in one
  prefill chunk, and a prefix-cache hit never ends inside one. A prefix LM (``True``: PaliGemma,
  whose mlx-vlm prefill is one maskless call) has its whole prompt as one span, text-only prompts
  too (``text_only_input``), and gets the engine's mask passed in (its own code builds none).
* image-token features: what ``get_input_embeddings`` returns for the image tokens alone
  (``VISUAL_FEATURES``): ``visual_pos_masks``, True at the image's feature tokens (not its
  markers), and ``deepstack_visual_embeds``, per text layer that takes them the rows to add at
  those tokens (Cohere Compass; Zaya1-VL's vision LoRA and MiniMax-M3-VL take the mask alone).
  ``encode`` appends them to the run's rows (a flag, then each layer's row, zeros at markers);
  ``hidden_states`` gives the text model, by name, the mask over the step's tokens and each
  layer's rows at its True positions in flat order (batch row, then position), as Qwen3-VL's
  hook does. A model that takes them as whole-prompt arrays, one row per prompt token, which it
  slices at the cache's offset (Granite 4 Vision), keeps the same rows (each layer's row at every
  run token), and gets each call's rows cut out per batch row for the positions the call computes,
  in ``StepWindow``s: its slice at the cache's offset (one per row) is the call's rows.
* positions: a text model with multi-axis rotary positions that it computes itself
  (``get_rope_index``: Qwen2-VL, GLM-4.1V, ...) gets them per prompt from that function, on the
  engine thread at the prompt's first step (``positions``), and passed with every call (mlx-vlm
  keeps them as state on the model, which the rows of a batch cannot share), in the layout that
  function gives (``[axes, batch, tokens]``, or ERNIE 4.5 VL's ``[batch, tokens, axes]``).
* token types: a text model that takes ``token_type_ids`` and answers otherwise with them (ERNIE
  4.5 VL's MoE sends image tokens to vision experts) gets them per step as its model's own call
  builds them (``TOKEN_TYPES``: 1 at an image's feature tokens, 0 at text, markers and decode
  steps), from the image runs the step computes: mlx-vlm's generation passes none (so its image
  tokens take the text experts, unlike its own model call), which makes the model call the oracle.

* images the model expands (``expands_in_model``): where ``get_input_embeddings`` gives an image
  another number of rows than the processor's run has tokens (LLaVA-NeXT and Granite Vision put a
  tile's features, and a block of newlines, per image token), the sequence mlx-vlm generates over
  is the model's, so the engine's is too: the image's run is as long as the model's rows for the
  processor's run, its rows are those rows, its ids one stand-in token repeated (the image's hash
  keys the prefix cache, as for every image), but for text tokens at the processor run's ends,
  which keep their ids as the model keeps their rows (Janus's BOS after the image: ``model_run_ids``).
  The length must be known when the prompt is prepared, on the caller's thread, where no MLX work
  may run (MLX streams are per thread, and a thread that used MLX must clear them before it ends).
  Of the ways to know it: (a) MLX's lazy shapes give the length without running the tower, but
  the models evaluate on the way (``np.where`` over the ids, ``.item()`` of counts), so it is MLX
  work all the same; (b) a formula per family from the config and the processor's outputs would
  copy each model's merge and drift from it silently; (c) the measurement runs on the engine
  thread: ``on_engine_thread`` (the engine's thread runs it between steps; direct where the caller
  is that thread) builds ``get_input_embeddings`` for the processor's run lazily and reads the
  shape, evaluating only what the model's own code evaluates (the ids), never the tower. (c) it
  is: exact by construction, general, at the cost of one round trip to the engine thread per image.

This holds where ``get_input_embeddings`` merges position by position and the text model needs
nothing but embeddings, those positions and the cache; ``check`` runs the pipeline once at load
on a small image and refuses, with the reason, a model that needs more (tokens attending both ways
by another rule, positions kept as state with no function to compute them, cross-attention states,
deepstack features in a form rows of a batch cannot share or that the text model uses only at
offset 0, an image its processor leaves as one mark for the model to splice its features in).
Family hooks (``vlm_families.py``) add what differs.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from vllm_mlx.core.multimodal import ImageInput, MultiModalInput
from vllm_mlx.executor.attention import UnsupportedModelError
from vllm_mlx.multimodal.images import ImageSource, load_image
from vllm_mlx.multimodal.media_policy import SERVER_MAX_IMAGES, MediaPolicy
from vllm_mlx.multimodal.vlm_models import ImageRows, VisionLanguageModel
from vllm_mlx.multimodal.vlm_placeholder import (
    LAYOUT_TEXT,
    PROBE_IMAGE_SIZE,
    ImageRun,
    SplicingPromptBuilder,
    drops_token_after_image,
    fails_on_two_images,
    find_placeholder,
    model_run_ids,
    numbered_placeholder,
    places_images_itself,
    replace_runs,
    stand_in_for_a_mark,
    stand_in_text,
    without_token_after_images,
)

__all__ = ["GenericVisionModel", "ImageRun", "LanguageSplit"]

PROCESSOR_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "labels"})
"""Processor outputs about the text, not the image (the run's own ids replace them)."""
PIXEL_KEYS = ("pixel_values", "images")
DECODER_START = "decoder_inputs_embeds"
"""What an encoder-decoder's ``get_input_embeddings`` gives beside the encoder's input: the decoder's start
token embedded (``encoder_decoder``)."""
"""Where a processor puts the pixels: DeepSeek-VL2's says ``images`` (mlx-vlm's ``prepare_inputs``
renames it to ``pixel_values``)."""
IGNORED_FEATURES = frozenset({"inputs_embeds", "attention_mask_4d", "attention_mask"})
"""``get_input_embeddings`` outputs the language model does without: mlx-vlm's generation drops
the masks too (the text model builds its causal masks from the cache)."""
POSITION_FEATURES = frozenset({"position_ids", "rope_deltas"})
"""``get_input_embeddings`` outputs the engine recomputes per request where the text model has a
``get_rope_index`` (its positions for the whole prompt, which one image's run cannot give)."""
TOKEN_FEATURES = frozenset({"per_layer_inputs", "deepstack_visual_embeds", "pos_hw"})
"""``get_input_embeddings`` outputs with one row per token that the language model takes by name
beside the embeddings, and that the text-only call gives for text tokens (module doc): Gemma's
per-layer inputs; Qwen3-Omni's deepstack residuals (``[batch, tokens, layers, hidden]``, zeros at
text tokens, added to the first layers' hidden states); Falcon OCR's 2-D positions (``ZERO_AT_TEXT``).
Only where they come one row per token (Qwen3-VL's and Cohere Compass's come per image token, with
a mask: ``VISUAL_FEATURES``)."""
BUDGET_PROBE_SIZE, BUDGET_PROBE_COUNT = (3072, 2048), SERVER_MAX_IMAGES
"""Large images (a 3:2 photo of 6 MP, the server's default count in one prompt) that a processor placing
images itself lays out at load, to see whether it shares a budget of tokens among a prompt's images
(``_large_images_laid_out_alone``): the small probe pair fits any real budget."""
ZERO_AT_TEXT = frozenset({"pos_hw"})
"""``TOKEN_FEATURES`` the text-only call omits, whose value at a text token is zero: Falcon OCR's 2-D
"golden" positions (mlx-vlm's ``compute_pos_hw`` gives 0, 0 to every token but an image's patches,
and its rotation at 0 is the identity, which is what its decode steps, given none, apply)."""
VISUAL_MASK, DEEPSTACK = "visual_pos_masks", "deepstack_visual_embeds"
VISUAL_FEATURES = frozenset({VISUAL_MASK, DEEPSTACK})
"""``get_input_embeddings`` outputs about the image tokens alone, which the language model takes by
name (module doc): the mask, and the deepstack rows at its True positions."""
TOKEN_FEATURE_MASKS = {VISUAL_MASK: DEEPSTACK}
"""Masks of where a per-token feature is non-zero, by the feature: nothing the text model needs
once that feature comes one row per token with zeros elsewhere (Qwen3-Omni's thinker adds its
deepstack rows at every position and leaves the mask unused); any other way, the check refuses them."""
STATE_CALLS = frozenset({"update_window", "update_recurrent"})
"""Calls some mlx-vlm recurrent layers make on their state cache that mlx-lm's ``ArraysCache`` (and
the engine's state pool, which implements it) lacks: only Qwen3.5's hook adds them
(``vlm_families.MlxVlmStateCache``); elsewhere the check at load refuses them, unless the engine holds
the model's own caches per request (GLM-5-Next's: ``held_caches``)."""
VISION_BLOCKS = "vision"
"""``use_bidirectional_attention`` for Gemma 4's rule: each block of vision tokens sees itself whole."""
WHOLE_PROMPT = True
"""``use_bidirectional_attention`` of a prefix LM (PaliGemma's default): mlx-vlm prefills the whole prompt
in one call without a mask, so every prompt token sees every other; decode steps see what precedes them."""
TOKEN_TYPES_KEY = "mm_token_type_ids"
VISION_TOKEN_TYPES = (1, 2)
"""Gemma 4's processor's token types of image and video soft tokens (mlx-vlm's overlay takes these)."""
TOKEN_TYPES = "token_type_ids"
"""Per-position token types the text model takes by name (module doc): 1 at an image's feature tokens
(``feature_token_id``), 0 elsewhere, as ERNIE 4.5 VL's ``Model._build_token_type_ids`` builds them."""
GRID_KEY = "image_grid_thw"
"""The processor output ``get_rope_index`` reads an image's patch grid from."""
PROMPT_POSITION_KEYS = frozenset({"image_bound"})
"""Processor outputs whose values are positions in the processor's prompt (MiniCPM's ``image_bound``:
where each image's features go): ``_encoder_inputs`` moves them to the run's coordinates, as
``encode`` gives the model the run alone."""
IMAGE_STATES = "cross_attention_states"
"""``get_input_embeddings``'s output of an image's states that the text model attends to beside the prompt
(mllama's cross-attention layers), not one row per token: ``encode`` keeps them, flattened, after the run's
embedding rows (so the MLLM cache keeps them per image content hash), and a request's calls get all its
images' states (``request_inputs``), each with its own, one row a call (the engine holds its caches)."""
STEP_MASKS = frozenset({"cross_attention_mask", "full_text_row_masked_out_mask"})
"""Per-token masks of which image states a prompt token sees: served where a family hook builds them for a
request's prompt (``builds_step_masks``), else refused by the check's list of extra features."""
PROCESSOR_RUN_KEY = "processor_run_ids"
"""Where an image the model expands keeps the processor's run (``encode`` gives it to the model)."""


class StepWindow:
    """A whole-prompt array as a text model that slices each call's positions out of it sees it,
    holding those positions only: the call's rows, ``[batch, width, ...]``, each batch row's own.

    mlx-vlm's Granite 4 Vision takes its deepstack features and their mask whole-prompt (one row per
    prompt token) and slices each call's positions at its cache's offset, ``[off : off + width]``:
    one slice for the batch, where the engine's rows are at different offsets (``offset`` is then an
    array, one per row). The engine cuts each row's positions out itself (``_step_windows``), so the
    model's slice of the positions, whatever its bounds, is exactly these rows: a no-op. ``leading``
    axes before the positions (a layer) are indexed by an integer, as on the whole array.
    """

    def __init__(self, rows: mx.array, leading: int = 0) -> None:
        self.rows = rows
        self.leading = leading

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if self.leading and len(key) == 1 and isinstance(key[0], int):
            return StepWindow(self.rows[key[0]], self.leading - 1)
        positions = key[1:] if key[:1] == (Ellipsis,) else key
        if not self.leading and len(positions) == 1 and isinstance(positions[0], slice):
            return self.rows
        raise TypeError(f"a whole-prompt array of the step's rows is indexed by layer, then positions: not {key!r}")


class LanguageSplit:
    """A language model as backbone (hidden states) and head (logits), where that split gives
    exactly the logits of the model's own call; else the call itself, whose logits the runner
    then takes whole (``head`` is the identity)."""

    def __init__(self, backbone, head) -> None:
        self.backbone = backbone
        self.head = head

    @classmethod
    def probe(cls, language, make_cache, embeds: mx.array, **features) -> LanguageSplit:
        """``features``: what the text model takes by name beside the embeddings (a backbone
        that does not take them by those names, Zaya1-VL's, leaves the whole call)."""
        inputs = mx.zeros(embeds.shape[:2], dtype=mx.int32)
        whole = _logits(language(inputs, inputs_embeds=embeds, cache=make_cache(), **features))
        backbone = getattr(language, "model", None)
        head = getattr(language, "lm_head", None)
        if head is None:
            head = getattr(getattr(backbone, "embed_tokens", None), "as_linear", None)
        if callable(backbone) and head is not None:
            try:
                split = head(backbone(inputs, inputs_embeds=embeds, cache=make_cache(), **features))
                if split.shape == whole.shape and mx.array_equal(split, whole).item():
                    return cls(backbone, head)
            except Exception:  # another signature or structure: the whole call it is
                pass
        return cls(lambda inputs, **kwargs: _logits(language(inputs, **kwargs)), lambda logits: logits)


def _logits(output) -> mx.array:
    """mlx-vlm language models return a ``LanguageModelOutput``; some return the array."""
    return getattr(output, "logits", output)


class GenericVisionModel(VisionLanguageModel):
    """An mlx-vlm model through ``get_input_embeddings`` and its language model (module doc).

    ``image_placeholder_text`` is what the processor expands for one image (``find_placeholder``);
    a bare prompt gets what the chat template writes for an image part where that holds it
    (``InputProcessor.image_text``).
    """

    placeholder_texts: tuple[str, ...] = ()
    """Placeholders a family hook knows its processor expands, tried before the ones it names
    (``_candidate_texts``): LocateAnything's numbered ``<image-1>``, which no attribute names."""

    places_images_itself = False
    """Its processor, not the prompt, decides where images go (``layout_prompt_ids``, module doc)."""

    image_alone = False
    """An encoder-decoder whose encoder reads the image alone and whose decoder the prompt's ids seed (NeMo
    Parse): its processor puts the image nowhere in the prompt; the engine's prompt is the image's run (one
    stand-in per encoder state, the model's rows: ``expands_in_model``) before the processor's ids, the run
    through the encoder, the ids after it through the decoder (``encoder_decoder_hidden_states``)."""

    def __init__(self, model, processor, config: dict, path) -> None:
        processor = SplicingPromptBuilder.around(model, processor)
        try:
            self.image_placeholder_text, self._plain_ids, self._run = self._find_placeholder(processor)
        except UnsupportedModelError as no_placeholder:
            # mlx-vlm serves a processor that places images itself (Molmo, Moondream, PLaMo 2 VL, GOT-OCR)
            # that way, whatever the prompt says: so does the engine, where one image's run can be found.
            # An encoder-decoder whose encoder reads the image alone puts it nowhere in the prompt (NeMo Parse).
            self.image_alone = not places_images_itself(processor) and _encodes_the_image_alone(model, processor)
            if not places_images_itself(processor) and not self.image_alone:
                raise
            try:
                layout = self._image_alone_layout if self.image_alone else self._processor_layout
                self.image_placeholder_text, self._plain_ids, self._run = layout(model, processor)
            except (ValueError, TypeError, KeyError, IndexError):  # its model cannot merge the probe: why not first
                raise no_placeholder from None
            self.places_images_itself = True
        if self._run.stand_in < 0:  # the processor's mark (-200) is no token: the run needs one that is
            self._run = replace(self._run, stand_in=stand_in_for_a_mark(processor, self._run.stand_in))
        several = len(self._run.placeholder(self._plain_ids)) > 1
        self._stand_in_text = (
            stand_in_text(processor, self.image_placeholder_text, self._run.stand_in) if several else None
        )
        self._drops_token_after_image = not self.places_images_itself and drops_token_after_image(
            processor, self.image_placeholder_text
        )
        """The processor drops the text's first token after an image (Phi-3-vision's): so does ``prepare``."""
        super().__init__(model, processor, config, path)
        # Multi-axis rotary positions, where the text model computes them itself from the prompt
        # and the images' grids (mlx-vlm keeps them as state on the model; here they are
        # computed per request, on the engine thread, and passed with every call).
        self.rope_index = getattr(self.language, "get_rope_index", None)
        self.uses_mrope = self.rope_index is not None
        self.sequential_positions = False
        self.one_axis_positions = False
        """Its ``get_rope_index`` gives one axis (``[B, T]``: MiniMax-M3-VL's token indices), which
        its text model takes as it is: ``positions`` keeps it on every axis, the call passes one."""
        """The model's own positions count every token, image tokens included, one each
        (``_grid_free_positions``): ``positions`` is then the token index on all three axes."""
        self.split: LanguageSplit | None = None
        self.token_features: dict[str, tuple[int, ...]] = {}
        """Per-token features the model gives beside its embeddings (``TOKEN_FEATURES``), by
        name: each row's shape (``encode`` flattens them after the embedding row)."""
        self.expands_in_model = False
        """The model, not the processor, decides an image's length (module doc)."""
        self.on_engine_thread = _call_here
        """Runs a function of MLX work on the engine thread and returns its result (module doc);
        ``AsyncEngineCore`` installs its own, where ``prepare`` runs on callers' threads."""
        self.deepstack_layers: int | None = None
        """With image-token features (``VISUAL_FEATURES``): how many text layers take deepstack
        rows (0: the mask alone); None without. ``encode`` puts them last: a flag, then the rows."""
        self.deepstack_width = 0
        self.token_types = False
        """The text model takes ``TOKEN_TYPES`` (module doc), and they change what it computes."""
        self.feature_token_id = self._run.stand_in
        """The id of an image's feature tokens in its run (the run's most frequent id; not its markers)."""
        self.positions_batch_first = False
        """``get_rope_index`` gives (and the text model takes) ``[batch, tokens, axes]`` positions."""
        self.image_states_shape: tuple[int, ...] | None = None
        """An image's ``IMAGE_STATES`` shape (``[states, width]``) where the model gives them; None without."""
        self.image_states_width = 0
        """Columns of each run row that hold the image's states (``_states_rows``), from the probe's run."""
        self.image_states_dtype = mx.float32
        self.deepstack_per_token = False
        """Deepstack rows at every run token (zeros at text), as whole-prompt arrays the text model slices
        at the cache's offset (Granite 4 Vision's), not at the image tokens alone: ``StepWindow``s."""
        self.check()

    builds_step_masks = False
    """A family hook builds ``STEP_MASKS`` per request (``request_inputs``), from its prompt's images."""

    @property
    def holds_request_inputs(self) -> bool:
        """Its text model takes per-request inputs beside the embeddings (``IMAGE_STATES``): the engine then
        holds its caches per request, one row a call, so each call gets its own request's
        (``attention.layer_specs``)."""
        return self.image_states_shape is not None

    def request_inputs(self, prompt_ids: list[int], images: list[ImageInput], features: list[mx.array]) -> dict:
        """What a request's every call takes beside the embeddings: its images' ``IMAGE_STATES``, in prompt
        order, from each image's ``encode`` rows (``features``); {} without images (the text model's own
        text-only path). A hook adds what depends on the whole prompt (mllama's masks)."""
        if not self.holds_request_inputs or not images:
            return {}
        states = [self._split_rows(rows)[IMAGE_STATES] for rows in features]
        size = int(np.prod(self.image_states_shape))
        each = [s.reshape(-1)[:size].reshape(self.image_states_shape).astype(self.image_states_dtype) for s in states]
        return {IMAGE_STATES: mx.concatenate(each)[None]}

    def step_inputs(self, request_inputs: dict, prompt_length: int, start: int, count: int) -> dict:
        """The part of ``request_inputs`` a call computing positions ``[start, start + count)`` takes: all of it
        (a hook cuts its per-token masks)."""
        return request_inputs

    def _find_placeholder(self, processor) -> tuple[str, list[int], ImageRun]:
        """The placeholder text, its ids and the image's run against them (``find_placeholder``); a
        hook's own where its processor writes the prompt itself (Falcon OCR's)."""
        return find_placeholder(processor, self.placeholder_texts)

    def _processor_layout(self, model, processor) -> tuple[str, list[int], ImageRun]:
        """Where a processor that places images itself puts one image's run, for the empty text
        (``LAYOUT_TEXT``): from its first to its last row that the pixels change (two probe images,
        ``get_input_embeddings`` at load), or from the prompt's start where the model needs what
        precedes the image to merge it (Moondream's BOS, Molmo's patch indices into the prompt).

        Raises:
            UnsupportedModelError: No start reproduces the model's rows for the run alone.
        """
        from PIL import Image

        probes = [Image.new("RGB", PROBE_IMAGE_SIZE, color) for color in ((96, 160, 32), (32, 96, 160))]
        outputs = [processor(text=[LAYOUT_TEXT], images=[probe], return_tensors="np") for probe in probes]
        ids = np.asarray(outputs[0]["input_ids"])[0].tolist()
        whole = ImageRun(0, 0, 0)
        rows = [_embeds(_merged_layout(model, ids, out, whole))[0] for out in outputs]
        changed = np.flatnonzero(np.array(mx.any(rows[0] != rows[1], axis=-1)))
        if not changed.size:
            raise UnsupportedModelError("its processor places images itself, and no row of its model depends on them")
        first, last = int(changed[0]), int(changed[-1])
        for start in dict.fromkeys([first, 0]):
            run = ids[start : last + 1]
            layout = ImageRun(start, len(ids) - 1 - last, max(run, key=run.count))
            alone = _embeds(_merged_layout(model, run, outputs[0], layout))[0]
            if alone.shape == rows[0][start : last + 1].shape and mx.allclose(alone, rows[0][start : last + 1]).item():
                self._layout_probe = (probes[0], run)
                return LAYOUT_TEXT, [*ids[:start], layout.stand_in, *ids[last + 1 :]], layout
        raise UnsupportedModelError(
            "its processor places images itself, and its model's rows for an image's run differ from its rows "
            "for the whole prompt"
        )

    def _image_alone_layout(self, model, processor) -> tuple[str, list[int], ImageRun]:
        """``_processor_layout`` for an encoder that reads the image alone (``image_alone``): the image's run is
        empty in the processor's ids (the model gives its length), put before the prompt's ids; its stand-in
        any token of the vocabulary (the model never embeds it: its rows are the encoder's)."""
        from PIL import Image

        ids = np.asarray(processor(text=[LAYOUT_TEXT], return_tensors="np")["input_ids"]).reshape(-1).tolist()
        stand_in = getattr(processor.tokenizer, "pad_token_id", None) or 0
        self._layout_probe = (Image.new("RGB", PROBE_IMAGE_SIZE), [])
        self.max_images_per_prompt = 1
        self.images_limit_reason = "its encoder reads one image"
        return LAYOUT_TEXT, [stand_in, *ids], ImageRun(0, len(ids), stand_in)

    def layout_prompt_ids(self, text: str, count: int) -> list[int]:
        """The ids of ``text`` with ``count`` images as its processor lays them out itself (only where
        ``places_images_itself``): the processor's own prompt for probe images, each image's run one
        stand-in token (``prepare`` expands it to the image's own run). The text goes to the processor as given, as
        mlx-vlm's generation gives it: a placeholder written in it is text to such a processor.

        Raises:
            ValueError: The processor's prompt holds another number of images than ``count``.
        """
        probe, run = self._layout_probe
        if self.image_alone:  # the image before the prompt's ids (``image_alone``); a text alone has no call
            if count != 1:
                raise ValueError("it needs an image: its encoder reads the image alone (one a prompt)")
            return [self._run.stand_in, *np.asarray(self.processor(text=[text])["input_ids"]).reshape(-1).tolist()]
        outputs = self.processor(text=[text], images=[probe] * count, return_tensors="np")
        prompts = np.asarray(outputs["input_ids"])
        ids = prompts[0].tolist() if prompts.shape[0] == 1 else []
        placed = replace_runs(ids, run, self._run.stand_in)
        if len(ids) == 0 or placed.count(self._run.stand_in) != count:
            raise ValueError(f"its processor places the images itself and does not place {count} in one prompt")
        return placed

    # ---- what mlx-vlm's models share ------------------------------------------------------

    @property
    def layers(self) -> list:
        layers = getattr(self.language, "layers", None)
        return layers if layers is not None else self.language.model.layers

    def embed(self, inputs: mx.array) -> mx.array:
        return _embeds(self.model.get_input_embeddings(inputs, None))

    def hidden_states(self, inputs, cache, position_ids, images, **request_inputs):
        """The base class's, with the per-token features: text rows from the text-only call,
        the images' rows (after the embedding in ``images.features``) over their positions; and
        the image-token features of the step's image rows (``_visual_inputs``). ``request_inputs``: the
        row's own (``step_inputs``), passed by name."""
        if self.encoder_decoder:  # a probe's text (the runner calls ``encoder_decoder_hidden_states`` itself)
            return self.encoder_decoder_hidden_states(
                inputs, cache, images, inputs.shape[1] * (cache[-1].outputs is None)
            )
        types = self._step_token_types(inputs, images)
        plain = not self.token_features and self.deepstack_layers is None and self.image_states_shape is None
        if plain and not types and not request_inputs:
            return super().hidden_states(inputs, cache, position_ids, images)
        merged = self.model.get_input_embeddings(inputs, None)
        text = _fields(merged)
        embeds = _embeds(merged)
        features = {name: _text_feature(text, name, embeds.shape[:2], shape)
                    for name, shape in self.token_features.items()}  # fmt: skip
        if images is not None:
            rows = self._split_rows(images.features)
            embeds = images.scatter(embeds, rows.pop(_EMBEDDING))
            for name, shape in self.token_features.items():
                flat = features[name].reshape(*features[name].shape[:2], -1)
                features[name] = images.scatter(flat, rows[name]).reshape(*flat.shape[:2], *shape)
            if self.deepstack_layers is not None:
                features.update(self._visual_inputs(images, rows[_VISUAL]))
        return self.language_hidden_states(embeds, inputs, cache, position_ids, **features, **types, **request_inputs)

    def _step_token_types(self, inputs: mx.array, images) -> dict:
        """``TOKEN_TYPES`` for the step's tokens (1 at image feature tokens: ``feature_token_id`` at
        image positions); {} where the model takes none or the step has no image row: all text,
        which is what the model's own call gives a decode step (it passes none there either)."""
        if not self.token_types or images is None:
            return {}
        is_feature = images.mask() & (inputs == self.feature_token_id)
        return {TOKEN_TYPES: is_feature.astype(mx.int32)}

    def _visual_inputs(self, images, rows: mx.array) -> dict:
        """The mask over the step's tokens (True where a row's flag is) and each deepstack layer's
        rows at its True positions, in flat order (``images.index`` ascends); {} where the step
        holds no image token (markers only: nothing to add, no LoRA to apply)."""
        flags = np.array(rows[:, 0].astype(mx.float32)) > 0.5
        if not flags.any():
            return {}
        mask = np.zeros(images.batch * images.width, dtype=bool)
        mask[np.asarray(images.index)[flags]] = True
        inputs = {VISUAL_MASK: mx.array(mask.reshape(images.batch, images.width))}
        if self.deepstack_per_token:
            return self._step_windows(images, rows, inputs[VISUAL_MASK])
        if self.deepstack_layers:
            picked = rows[mx.array(np.flatnonzero(flags))][:, 1:]
            inputs[DEEPSTACK] = mx.split(picked, self.deepstack_layers, axis=-1)
        return inputs

    def _step_windows(self, images, rows: mx.array, mask: mx.array) -> dict:
        """The mask and the deepstack rows of the step's tokens as whole-prompt arrays a text model slices
        at its cache's offset (``StepWindow``): ``[layers, batch, width, hidden]``, zeros off the images,
        in the embeddings' dtype (mlx-vlm's Granite 4 Vision casts its rows so before adding them)."""
        dtype = self.embed(mx.array([[0]])).dtype
        zeros = mx.zeros((images.batch, images.width, self.deepstack_layers * self.deepstack_width), dtype=dtype)
        dense = images.scatter(zeros, rows[:, 1:].astype(dtype))
        dense = dense.reshape(images.batch, images.width, self.deepstack_layers, self.deepstack_width)
        return {VISUAL_MASK: StepWindow(mask), DEEPSTACK: StepWindow(dense.transpose(2, 0, 1, 3), leading=1)}

    def language_hidden_states(self, embeds, inputs, cache, position_ids, **features):
        if position_ids is not None and self.positions_batch_first:  # [axes, B, T] -> the model's [B, T, axes]
            position_ids = position_ids.transpose(1, 2, 0)
        if position_ids is not None and self.one_axis_positions:  # its get_rope_index's own [B, T]
            position_ids = position_ids[0]
        extra = {"position_ids": position_ids} if position_ids is not None else {}
        if self.both_ways is WHOLE_PROMPT:
            # mlx-vlm's prefix LM builds no mask at all (its one-row prefill is the whole prompt): the
            # engine's rows are padded, chunked and decoding, so it gets the caches' mask (causal, the
            # prompt's span seen whole, padding hidden), which it then uses as given.
            extra["mask"] = _mask_of_the_caches(embeds, cache)
        return self.split.backbone(inputs, inputs_embeds=embeds, cache=cache, **extra, **features)

    def _split_rows(self, rows: mx.array) -> dict[str, mx.array]:
        """``encode``'s rows back into the embedding and each per-token feature (flattened)."""
        widths = [rows.shape[-1] - sum(int(np.prod(s)) for s in self.token_features.values())]
        widths += [int(np.prod(shape)) for shape in self.token_features.values()]
        names = [_EMBEDDING, *self.token_features]
        if self.image_states_shape is not None:  # after the embedding: the rest of the row's width
            width = self.image_states_width
            widths = [widths[0] - width, *widths[1:], width]
            names.append(IMAGE_STATES)
        if self.deepstack_layers is not None:
            visual = 1 + self.deepstack_layers * self.deepstack_width
            widths = [widths[0] - visual, *widths[1:], visual]
            names.append(_VISUAL)
        parts = mx.split(rows, list(np.cumsum(widths)[:-1]), axis=-1)
        return dict(zip(names, parts))

    def _states_rows(self, states: mx.array, run_length: int) -> mx.array:
        """An image's states (``[1, states, width]``) flattened over its run's rows, ``image_states_width``
        columns each (every row of a run is as wide), zero-padded.

        Raises:
            ValueError: Its run has fewer rows than the probe image's at load: its states do not fit.
        """
        flat = states.reshape(-1)
        room = self.image_states_width * run_length
        if flat.size > room:
            raise ValueError(f"an image of {run_length} tokens has no room for its {flat.size} state values")
        flat = mx.concatenate([flat, mx.zeros((room - flat.size,), dtype=flat.dtype)])
        return flat.reshape(run_length, self.image_states_width)

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, int]:
        """``(positions [3, len(token_ids)], rope_delta)``: the text model's own multi-axis
        positions for a prompt (``get_rope_index`` on its ids and its images' grids); engine thread."""
        if self.sequential_positions:
            return np.broadcast_to(np.arange(len(token_ids)), (3, len(token_ids))).astype(np.int64), 0
        positions, delta = self._rope_index(token_ids, images)
        self.one_axis_positions = positions.ndim == 2  # MiniMax-M3-VL's [B, T]: its text model takes them so
        positions = positions[0].T if self.positions_batch_first else _three_axes(positions)[:, 0, :]
        return positions.astype(np.int64), int(np.array(delta).reshape(-1)[0])

    def _rope_index(self, token_ids: list[int], images: list[ImageInput]) -> tuple[np.ndarray, mx.array]:
        """``get_rope_index`` on one prompt and its images' grids, in the function's own layout."""
        grids = [image.encoder_inputs[GRID_KEY] for image in images]
        grid = mx.array(np.concatenate(grids).astype(np.int32)) if grids else None
        positions, delta = self.rope_index(mx.array([token_ids]), image_grid_thw=grid)
        return np.array(positions), delta

    def logits(self, hidden: mx.array) -> mx.array:
        return self.split.head(hidden)

    def process(self, source: ImageSource, policy: MediaPolicy) -> ImageInput:
        rgb = load_image(source, policy)
        outputs = self.processor(text=[self.image_placeholder_text], images=[rgb], return_tensors="np")
        expanded = np.asarray(outputs["input_ids"])[0].tolist()
        run = self._run.tokens(expanded)
        encoder_inputs = _encoder_inputs(outputs, self._run, len(expanded))
        pixels = next(encoder_inputs.pop(key) for key in PIXEL_KEYS if key in encoder_inputs)
        if self.expands_in_model:
            encoder_inputs[PROCESSOR_RUN_KEY] = np.asarray(run)
            length = self.on_engine_thread(lambda: self._model_rows(run, pixels, encoder_inputs).shape[0])
            run = model_run_ids(run, length, self._run.stand_in)
        return ImageInput(self._hash(rgb), rgb, pixels, 0, len(run), token_ids=run, encoder_inputs=encoder_inputs)

    def encode(self, image: ImageInput) -> mx.array:
        merged = self._merged(image)
        fields = _fields(merged)
        rows = [_embeds(merged)[0], *(fields[name][0].reshape(image.num_tokens, -1) for name in self.token_features)]
        if self.image_states_shape is not None:
            if tuple(fields[IMAGE_STATES].shape[1:]) != self.image_states_shape:
                raise ValueError(f"image states of shape {fields[IMAGE_STATES].shape}, not {self.image_states_shape}")
            rows.append(self._states_rows(fields[IMAGE_STATES], image.num_tokens))
        if self.deepstack_layers is not None:
            rows.append(self._visual_rows(fields, image.num_tokens))
        if len(rows) == 1:
            return rows[0]
        # The widest dtype of the parts: float32 positions (Falcon's pos_hw) next to bfloat16
        # embeddings must not be rounded; the embeddings widen exactly (``scatter`` narrows them back).
        dtype = mx.float32 if any(r.dtype == mx.float32 for r in rows) else rows[0].dtype
        return mx.concatenate([r.astype(dtype) for r in rows], axis=-1)

    def _visual_rows(self, fields: dict, run_length: int) -> mx.array:
        """``[run_length, 1 + layers * width]``: per run token its flag (1 at an image token) and
        each deepstack layer's row there (zeros at markers, which the mask leaves out)."""
        mask = fields[VISUAL_MASK].reshape(run_length)
        flag = mask.astype(mx.float32)[:, None]
        if self.deepstack_per_token:  # each layer's row at every run token already
            layers = [fields[DEEPSTACK][layer].reshape(run_length, -1) for layer in range(self.deepstack_layers)]
            deepstack = [mx.where(mask[:, None], layer, 0) for layer in layers]
            return mx.concatenate([flag, *(d.astype(mx.float32) for d in deepstack)], axis=-1)
        layers = _deepstack_layers(fields.get(DEEPSTACK))
        if not layers:
            return flag
        # The k-th image token's rows go to its run position (cumsum - 1 counts the ones before).
        order = mx.maximum(mx.cumsum(mask.astype(mx.int32)) - 1, 0)
        deepstack = [mx.where(mask[:, None], layer[order], 0) for layer in layers]
        return mx.concatenate([flag, *(d.astype(mx.float32) for d in deepstack)], axis=-1)

    def image_tokens(self, image: ImageInput) -> list[int]:
        return list(image.token_ids)

    # ---- the check at load ------------------------------------------------------------------

    def check(self) -> None:
        """Run the pipeline once on a small image; refuse a model it cannot drive.

        Raises:
            UnsupportedModelError: What the model needs beyond embeddings and the cache.
        """
        from PIL import Image

        self.both_ways = _bidirectional_attention(self.model)
        if self.both_ways not in (None, False, VISION_BLOCKS, WHOLE_PROMPT):
            raise UnsupportedModelError(both_ways_reason(self.both_ways))
        probe = Image.new("RGB", PROBE_IMAGE_SIZE, (96, 160, 32))
        image = self.process(probe, MediaPolicy.operator())
        # A negative id (FastVLM's -200) is no token: a mark the model splices an image's rows in for,
        # served as an image the model expands (its run's ids in-vocabulary stand-ins, module doc).
        marks = sorted({token for token in image.token_ids if token < 0})
        outside = _positions_outside_the_run(image)
        if outside:  # mlx-vlm's MiniCPM models write features there unchecked: refuse, never corrupt memory
            raise UnsupportedModelError(f"its processor's {outside} points outside the image's run of tokens")
        merged = self._refusing_known_failures(self._merged, image)
        if marks and not self._splices_the_image(image, merged):
            what = f"its processor marks an image with the id {marks[0]}, outside the vocabulary, and its model"
            raise UnsupportedModelError(f"{what} splices no image features in for it")
        if not self.expands_in_model and (marks or _embeds(merged).shape[1] != image.num_tokens):
            self._expand_in_model()
            image = self.process(probe, MediaPolicy.operator())
            merged = self._merged(image)
            why_not = "" if self.image_alone else self._why_images_do_not_merge_alone(image, merged)
            if why_not:
                self.max_images_per_prompt = 1
                self.images_limit_reason = why_not
        self.token_features = self._token_features(merged, image.num_tokens)
        self._check_visual_features(_fields(merged), image.num_tokens)
        if self.deepstack_per_token and self.max_images_per_prompt is None and not self._deepstack_of_each_image(image):
            self.max_images_per_prompt = 1
            self.images_limit_reason = "mlx-vlm's model builds every image token's features from the first image"
        self._check_image_states(_fields(merged), image.num_tokens)
        visual = VISUAL_FEATURES if self.deepstack_layers is not None else frozenset()
        ignored = IGNORED_FEATURES | (POSITION_FEATURES if self.uses_mrope else frozenset()) | set(self.token_features)
        ignored |= visual
        if self.image_states_shape is not None:
            ignored |= {IMAGE_STATES} | (STEP_MASKS if self.builds_step_masks else frozenset())
        ignored |= {mask for mask, feature in TOKEN_FEATURE_MASKS.items() if feature in self.token_features}
        extra = sorted({name for name, value in _fields(merged).items() if value is not None} - ignored)
        # The decoder's start embedding beside the encoder's input: an encoder-decoder, served its own way.
        self.encoder_decoder = DECODER_START in extra
        extra = [name for name in extra if name != DECODER_START]
        if extra:
            raise UnsupportedModelError(
                f"its image embeddings come with {', '.join(extra)}, which its text model needs beside them "
                "(the generic path passes embeddings and the cache only)"
            )
        if self.encoder_decoder:
            # Its decoder's start token embedded (the same for every image): the image-alone encoder's text
            # has no call of its own to give it (its embeddings without pixels raise).
            self._decoder_start = _fields(merged)[DECODER_START]
            self._settle_encoder_decoder()
            return
        if self.uses_mrope and GRID_KEY not in image.encoder_inputs and not self._grid_free_positions(merged, image):
            raise UnsupportedModelError(
                f"its text model computes multi-axis positions, but its processor gives no {GRID_KEY}"
            )
        if self.uses_mrope and not self.sequential_positions:
            self.positions(list(image.token_ids), [image])  # learns whether they are one axis
        # Positions kept as state are refused unless computed per request: by get_rope_index, or by a
        # hook that sets ``uses_mrope`` and its own ``positions`` (Hunyuan-VL's, from its processor).
        if not self.uses_mrope and any(hasattr(self.language, name) for name in ("_position_ids", "_rope_deltas")):
            raise UnsupportedModelError("it keeps multi-axis rotary positions as state on its text model, with no "
                                        "get_rope_index to compute them per request")  # fmt: skip
        features = _embeds(merged)[0]
        visual_inputs = self._run_visual_inputs(image)
        self.split = self._refusing_known_failures(self.probe_split, features[None], **visual_inputs)
        # Other rows, not zeros: Granite 4 Vision's rows are zeros at image tokens (its images come as deepstack).
        if mx.array_equal(self._logits_of(features[None]), self._logits_of(features[None] + 1)).item():
            raise UnsupportedModelError("its text model ignores the embeddings it is given, so images cannot reach it")
        if DEEPSTACK in visual_inputs:
            self._check_deepstack_reaches(features[None], visual_inputs)
        if self.max_images_per_prompt is None and self.places_images_itself:
            self.images_limit_reason = self._layout_fails_on_two_images()
            self.max_images_per_prompt = 1 if self.images_limit_reason else None
        self.token_types = self._answers_to_token_types(features[None], image)
        if self.rope_index is not None and not self.sequential_positions and GRID_KEY in image.encoder_inputs:
            # The layout get_rope_index gives: batch first where its first axis is the one prompt's.
            own = self._rope_index(image.token_ids, [image])[0]
            self.positions_batch_first = own.ndim == 3 and own.shape[0] == 1
        if self.max_images_per_prompt is None:
            self.images_limit_reason = fails_on_two_images(self.processor, self.image_placeholder_text)
            self.max_images_per_prompt = 1 if self.images_limit_reason else None

    def _check_image_states(self, fields: dict, run_length: int) -> None:
        """Set ``image_states_shape`` where the model gives an image's ``IMAGE_STATES`` as one batch row
        (``[1, states, width]``); else leave them to the check's list of extra features."""
        states = fields.get(IMAGE_STATES)
        if isinstance(states, mx.array) and states.ndim == 3 and states.shape[0] == 1:
            self.image_states_shape = tuple(states.shape[1:])
            self.image_states_width = -(-states.size // run_length)
            self.image_states_dtype = states.dtype

    def _layout_fails_on_two_images(self) -> str:
        """Why a processor that places images itself takes one a prompt ("" where it takes two):
        Moondream's and GOT-OCR's write one image's tokens whatever the count, Molmo's one prompt an
        image, PLaMo 2 VL's shares one tile budget among a prompt's images (each image's run then
        depends on the others, where the engine processes and caches each alone), which two small
        probe images never fill: large ones do (``_large_images_laid_out_alone``)."""
        name = type(self.processor).__name__
        try:
            self.layout_prompt_ids(LAYOUT_TEXT, 2)
        except Exception:  # noqa: BLE001 -- any failure: the processor cannot place the pair
            return (f"its processor, {name}, places images itself and does not lay out two in one prompt as it lays "
                    "out each alone")  # fmt: skip
        if not self._large_images_laid_out_alone():
            return (f"its processor, {name}, places images itself and shares one budget of tokens among a prompt's "
                    "images: large ones get fewer tiles together than alone")  # fmt: skip
        return ""

    def _large_images_laid_out_alone(self) -> bool:
        """Whether ``BUDGET_PROBE_COUNT`` large images in one prompt each get the run one gets alone.
        PLaMo 2 VL's processor gives a prompt's images fewer tiles while their tokens exceed its
        ``tile_context_length``: at a real checkpoint's budget two probe images (64x48 px, a few tiles)
        fit, four large photos (24 tiles each) do not. A budget wider than these is not seen: a probe
        is no proof, but these are what the server takes by default (``SERVER_MAX_IMAGES``)."""
        from PIL import Image

        large = Image.new("RGB", BUDGET_PROBE_SIZE, (96, 160, 32))
        alone = self.processor(text=[LAYOUT_TEXT], images=[large], return_tensors="np")
        run = self._run.tokens(np.asarray(alone["input_ids"])[0].tolist())
        try:
            together = self.processor(text=[LAYOUT_TEXT], images=[large] * BUDGET_PROBE_COUNT, return_tensors="np")
        except Exception:  # noqa: BLE001 -- any failure: the processor cannot place them
            return False
        ids = np.asarray(together["input_ids"])[0].tolist()
        # Exactly one stand-in per image: a shorter run leaves its tokens (the stand-in's own id) unreplaced.
        return replace_runs(ids, run, self._run.stand_in).count(self._run.stand_in) == BUDGET_PROBE_COUNT

    def _expand_in_model(self) -> None:
        """Take each image's length from the model's rows (module doc), where the text model takes
        nothing per token that the run's stand-in ids would get wrong.

        Raises:
            UnsupportedModelError: Its text model computes positions from the prompt's ids.
        """
        if self.uses_mrope:
            raise UnsupportedModelError(
                "it expands an image inside the model, and its text model computes multi-axis positions from "
                "the processor's run, which the model's longer run of rows has no ids for"
            )
        self.expands_in_model = True

    def _splices_the_image(self, image: ImageInput, merged) -> bool:
        """Whether the model's rows for a run with a negative mark depend on the image (another
        image, the pixels negated, gives other rows): features spliced in, not the mark's lookup."""
        encoder_inputs = {k: v for k, v in image.encoder_inputs.items() if k != PROCESSOR_RUN_KEY}
        run = [int(token) for token in image.encoder_inputs.get(PROCESSOR_RUN_KEY, image.token_ids)]
        other = self._model_rows(run, -np.asarray(image.pixel_values), encoder_inputs)
        rows = _embeds(merged)[0]
        return other.shape != rows.shape or not mx.allclose(other, rows, atol=1e-6).item()

    def _why_images_do_not_merge_alone(self, image: ImageInput, merged) -> str:
        """Why the model's rows for two images are not each image's own rows where its run stands
        ("" where they are). mlx-vlm's LLaVA-NeXT merges the first image's tiles only and drops what
        follows its first run; mlx-vlm's FastVLM splits the text between images at the marks' indices
        in the prompt, not in the text without them, so each image after the first lands one token
        late per image before it: seen only with text after the second image, hence the second probe."""
        if not self._merges_each_image_alone(image, merged, around=False):
            return "mlx-vlm's model merges the first image's features only"
        if not self._merges_each_image_alone(image, merged, around=True):
            return "mlx-vlm's model places an image after the first off its run"
        return ""

    def _merges_each_image_alone(self, image: ImageInput, merged, *, around: bool) -> bool:
        """Whether the model's rows for two images with a token between (and, ``around``, one
        before and one after) are each image's own rows around those tokens' own rows."""
        encoder_inputs = dict(image.encoder_inputs)
        run = [int(token) for token in encoder_inputs.pop(PROCESSOR_RUN_KEY)]
        between = max(self._run.stand_in, 0)  # an id of the vocabulary
        pair = {name: np.concatenate([value, value]) for name, value in encoder_inputs.items()}
        pixels = np.concatenate([image.pixel_values, image.pixel_values])
        edge = [between] if around else []
        both = self._model_rows([*edge, *run, between, *run, *edge], pixels, pair)
        one = _embeds(merged)[0]
        text = self.embed(mx.array([[between]]))[0].astype(one.dtype)
        edge_rows = [text] if around else []
        expected = mx.concatenate([*edge_rows, one, text, one, *edge_rows])
        return both.shape == expected.shape and mx.allclose(both, expected, atol=1e-5).item()

    def _grid_free_positions(self, merged, image: ImageInput) -> bool:
        """Whether the positions the model sets itself for an image's run (returned, or kept as
        state on its text model) are plain 1-D ones, the same on all three axes: MiniCPM-o and
        MiniCPM-V 4.6 count an image token as one text position under Qwen3-VL's and Qwen3.5's
        text models, so ``positions`` needs no grid (it counts tokens; ``sequential_positions``)."""
        own = _fields(merged).get("position_ids")
        if own is None:
            own = getattr(self.language, "_position_ids", None)
        if own is None:
            return False
        own = _three_axes(own)
        plain = np.broadcast_to(np.arange(image.num_tokens), (3, 1, image.num_tokens))
        self.sequential_positions = own.shape == plain.shape and bool(np.array_equal(own, plain))
        return self.sequential_positions

    @staticmethod
    def _refusing_known_failures(call, *args, **kwargs):
        """``call(*args, **kwargs)``, refusing a model whose code fails in a way the engine knows:
        its recurrent layers make ``STATE_CALLS`` on a cache the engine pages (GLM-5-Next's caches are held)."""
        try:
            return call(*args, **kwargs)
        except AttributeError as exc:
            if exc.name not in STATE_CALLS:
                raise
            raise UnsupportedModelError(
                f"its recurrent layers call {exc.name}() on their state cache, a protocol of mlx-vlm's own that "
                "the engine's state pool keeps for Qwen3.5 alone"
            ) from None

    def _token_features(self, merged, run_length: int) -> dict[str, tuple[int, ...]]:
        """The ``TOKEN_FEATURES`` the model gives with an image, one row per run token, that its
        text-only call gives too (so text tokens have theirs): name -> a row's shape."""
        # Arrays only: Qwen3-VL's deepstack features come as a list, one array per layer (its hook's).
        fields = _fields(merged).items()
        given = {name: value for name, value in fields if name in TOKEN_FEATURES and isinstance(value, mx.array)}
        if not given:
            return {}
        text = _fields(self.model.get_input_embeddings(mx.array([[0]]), None))
        return {
            name: tuple(value.shape[2:]) for name, value in given.items()
            if value.shape[:2] == (1, run_length) and (text.get(name) is not None or name in ZERO_AT_TEXT)
        }  # fmt: skip

    def _check_visual_features(self, fields: dict, run_length: int) -> None:
        """Set ``deepstack_layers`` where the model gives image-token features in a form the
        batch can give its text model (module doc); leave it None where it gives none.

        Leaves deepstack features in another form to the check's list of extra features.
        """
        mask, deepstack = fields.get(VISUAL_MASK), fields.get(DEEPSTACK)
        if DEEPSTACK in self.token_features:  # one row per token (Qwen3-Omni's): per-token features
            return
        if mask is None or mask.shape != (1, run_length):
            return  # none, or not one per run token: the check's list of extra features names them
        layers = _deepstack_layers(deepstack)
        if layers is None:
            self._check_whole_prompt_deepstack(deepstack, run_length)
            return
        count = int(mask.astype(mx.int32).sum().item())
        if any(layer.shape[0] != count for layer in layers):
            return  # rows that do not match the mask's image tokens: left to the list of extra features
        self.deepstack_layers = len(layers)
        self.deepstack_width = layers[0].shape[-1] if layers else 0

    def _check_whole_prompt_deepstack(self, deepstack, run_length: int) -> None:
        """Deepstack features as one whole-prompt array, ``[layers, run tokens, width]`` (Granite 4
        Vision's): served per token (``deepstack_per_token``); another shape stays unset (refused
        by the check's list of extra features)."""
        if isinstance(deepstack, mx.array) and deepstack.ndim == 3 and deepstack.shape[1] == run_length:
            self.deepstack_per_token = True
            self.deepstack_layers, self.deepstack_width = deepstack.shape[0], deepstack.shape[-1]

    def _deepstack_of_each_image(self, image: ImageInput) -> bool:
        """Whether whole-prompt deepstack rows for two images with a token between are each image's own
        rows around that token's zeros: mlx-vlm's Granite 4 Vision builds them from the first image's
        pixels alone (its embeddings are zeros at every image token, so they cannot tell)."""
        run = [int(token) for token in image.token_ids]
        between = max(self._run.stand_in, 0)
        pair = {name: np.concatenate([value, value]) for name, value in image.encoder_inputs.items()}
        pixels = np.concatenate([image.pixel_values, image.pixel_values])
        both = self._visual_rows(_fields(self._merged_run([*run, between, *run], pixels, pair)), 2 * len(run) + 1)
        one = self._visual_rows(_fields(self._merged(image)), len(run))
        expected = mx.concatenate([one, mx.zeros((1, one.shape[-1]), dtype=one.dtype), one])
        return both.shape == expected.shape and mx.allclose(both, expected, atol=1e-5).item()

    def _run_visual_inputs(self, image: ImageInput) -> dict:
        """The image-token features of one image's run as a one-row step gives them."""
        if self.deepstack_layers is None:
            return {}
        rows = self._split_rows(self.encode(image))[_VISUAL]
        from vllm_mlx.multimodal.vlm_models import ImageRows

        return self._visual_inputs(ImageRows(list(range(image.num_tokens)), rows, 1, image.num_tokens), rows)

    def _check_deepstack_reaches(self, embeds: mx.array, visual_inputs: dict) -> None:
        """Refuse a text model that uses deepstack rows only in a prompt's first call (cache at
        offset 0): the engine's chunked prefill and prefix reuse give them later too.

        Raises:
            UnsupportedModelError: The rows change nothing past offset 0.
        """
        deepstack = visual_inputs[DEEPSTACK]
        if isinstance(deepstack, StepWindow):
            zeroed = StepWindow(mx.zeros_like(deepstack.rows), deepstack.leading)
        else:
            zeroed = [mx.zeros_like(layer) for layer in deepstack]
        zeros = {**visual_inputs, DEEPSTACK: zeroed}
        outputs = []
        for inputs in (visual_inputs, zeros):
            cache = self.probe_cache()
            self._logits_of(embeds[:, :1], cache)  # one token first: the cache past offset 0
            outputs.append(self._logits_of(embeds, cache, **inputs))
        if mx.array_equal(*outputs).item():
            raise UnsupportedModelError(
                "its text model adds deepstack features only in a prompt's first forward call (cache at offset 0), "
                "where the engine's chunked prefill and prefix cache need them in any call"
            )

    def _answers_to_token_types(self, embeds: mx.array, image: ImageInput) -> bool:
        """Whether the text model takes ``TOKEN_TYPES`` by name and its logits for the probe's run
        change with the image's tokens typed (ERNIE 4.5 VL's vision experts). Not where image blocks
        attend both ways: Gemma 4's text model reads token types as that rule's blocks, which the
        engine's spans already serve (``both_ways``)."""
        import inspect

        if self.both_ways or self.expands_in_model:
            return False
        try:
            takes = TOKEN_TYPES in inspect.signature(self.split.backbone).parameters
        except (TypeError, ValueError):  # no signature to read: a builtin
            return False
        if not takes:
            return False
        run = list(image.token_ids)
        self.feature_token_id = max(run, key=run.count)
        types = mx.array([[int(token == self.feature_token_id) for token in run]], dtype=mx.int32)
        typed = self._logits_of(embeds, **{TOKEN_TYPES: types})
        return not mx.array_equal(typed, self._logits_of(embeds)).item()

    def _settle_encoder_decoder(self) -> None:
        """``check``'s end for an encoder-decoder (``encoder_decoder``): its encoder reads the whole prompt
        at once (one both-ways span, which the scheduler keeps in one chunk), and its text model's call gives
        the logits (``encoder_decoder_hidden_states``: the head is that call's)."""
        self.both_ways = WHOLE_PROMPT
        self.split = LanguageSplit(None, lambda logits: logits)
        if self.max_images_per_prompt is None and self.places_images_itself:
            self.images_limit_reason = self._layout_fails_on_two_images()
        if self.max_images_per_prompt is None and not self.images_limit_reason:
            self.images_limit_reason = fails_on_two_images(self.processor, self.image_placeholder_text)
        self.max_images_per_prompt = 1 if self.images_limit_reason else self.max_images_per_prompt

    def encoder_decoder_hidden_states(self, inputs: mx.array, caches: list, images, encoder_tokens: int) -> mx.array:
        """An encoder-decoder's logits for one row (``encoder_decoder``), as mlx-vlm's generation drives it: the
        row's first ``encoder_tokens`` (a prompt's, at its first row; else 0) go through the encoder, images over
        their tokens, with the decoder on its start token (``DECODER_START``); the row's other tokens are the
        decoder's (the tokens it generated), which attend to the encoder's outputs kept in ``caches[-1]``."""
        *decoder_caches, encoder = caches
        logits = []
        if encoder_tokens and self.image_alone:
            if images is None:  # a text alone is refused (``text_only_input``): the probes at load, as an image
                states = mx.zeros((encoder_tokens, self._decoder_start.shape[-1]))
                images = ImageRows(list(range(encoder_tokens)), states, 1, inputs.shape[1])
            logits.append(self._image_alone_prefill(inputs[:, :encoder_tokens], decoder_caches, images, encoder))
            inputs = inputs[:, encoder_tokens:]
        elif encoder_tokens:
            # Image tokens' ids as 0: their rows are the features (Florence-2's embedding drops its image ids).
            merged = self.model.get_input_embeddings(inputs if images is None else mx.where(images.mask(), 0, inputs))
            embeds = _embeds(merged) if images is None else images.scatter(_embeds(merged), images.features)
            embeds = embeds[:, :encoder_tokens]
            # mlx-vlm's call masks nothing: the all-ones mask its model gives with an image, as given.
            mask = {"attention_mask": mx.ones(embeds.shape[:2])} if images is not None else {}
            start = _fields(merged)[DECODER_START]
            out = self.language(None, inputs_embeds=embeds, decoder_inputs_embeds=start, cache=decoder_caches, **mask)
            encoder.outputs = out.encoder_outputs
            logits.append(_logits(out))
            inputs = inputs[:, encoder_tokens:]
        if inputs.shape[1]:
            out = self.language(None, decoder_input_ids=inputs, encoder_outputs=encoder.outputs, cache=decoder_caches)
            logits.append(_logits(out))
        return mx.concatenate(logits, axis=1)

    def _image_alone_prefill(self, prompt: mx.array, decoder_caches: list, images, encoder) -> mx.array:
        """The prompt's logits for an encoder that reads the image alone (``image_alone``): its image's rows
        through the encoder, the ids after them to mlx-vlm's text model as its generation passes the prompt
        (its own code seeds the decoder with them, or with its start token for one id), at the image's rows
        the start token's logits (never sampled)."""
        length = int(images.features.shape[0])
        embeds = images.features[None].astype(self._decoder_start.dtype)
        ids = prompt[:, length:]
        out = self.language(ids, inputs_embeds=embeds, decoder_inputs_embeds=self._decoder_start,
                            attention_mask=mx.ones(embeds.shape[:2]), cache=decoder_caches)  # fmt: skip
        encoder.outputs = out.encoder_outputs
        logits = _logits(out)
        pad = mx.broadcast_to(logits[:, :1], (1, prompt.shape[1] - logits.shape[1], logits.shape[2]))
        return mx.concatenate([pad, logits], axis=1)

    def probe_split(self, embeds: mx.array, **features) -> LanguageSplit:
        """The text model as backbone and head (``LanguageSplit.probe`` on the check's image rows);
        a hook whose text model needs another call (Hunyuan-VL's) gives its own."""
        return LanguageSplit.probe(self.language, self.probe_cache, embeds, **features)

    def _logits_of(self, embeds: mx.array, cache: list | None = None, **features) -> mx.array:
        inputs = mx.zeros(embeds.shape[:2], dtype=mx.int32)
        cache = self.probe_cache() if cache is None else cache
        return self.split.head(self.split.backbone(inputs, inputs_embeds=embeds, cache=cache, **features))

    def probe_cache(self) -> list:
        """The caches ``check`` runs the text model over: ``make_cache``'s, as a hook's
        ``language_hidden_states`` would pass them (MiniCPM-V's wraps its recurrent ones); the text
        model's own (``held_caches``) where the engine will hold them per request (a cache it does not
        page: GLM-5-Next's state caches, whose calls mlx-lm's ``ArraysCache`` lacks)."""
        from vllm_mlx.core.kv.spec import is_held
        from vllm_mlx.executor.attention import layer_specs

        return self.held_caches() if is_held(layer_specs(self, self.model_type)) else self.make_cache()

    def _merged(self, image: ImageInput):
        """``get_input_embeddings`` on the image's run: the processor's, where the model expands it."""
        encoder_inputs = dict(image.encoder_inputs)
        run = encoder_inputs.pop(PROCESSOR_RUN_KEY, image.token_ids)
        return self._merged_run([int(token) for token in run], image.pixel_values, encoder_inputs)

    def _merged_run(self, run: list[int], pixels: np.ndarray, encoder_inputs: dict[str, np.ndarray]):
        ids = mx.array([run])
        inputs = {name: _model_input(value) for name, value in encoder_inputs.items() if name != PROCESSOR_RUN_KEY}
        # An integer mask, as mlx-vlm's prepare_inputs gives: FastVLM slices the ids by its sums.
        mask = mx.ones(ids.shape, dtype=mx.int32)
        return self.model.get_input_embeddings(ids, _model_input(pixels), mask=mask, **inputs)

    def _model_rows(self, run: list[int], pixels: np.ndarray, encoder_inputs: dict[str, np.ndarray]) -> mx.array:
        """The model's rows for the processor's run, unevaluated (their shape is the run's length)."""
        return _embeds(self._merged_run(run, pixels, encoder_inputs))[0]

    def _image_token_id(self) -> int:
        return self._run.stand_in

    def multimodal_input(self, num_tokens: int, images: list[ImageInput]) -> MultiModalInput:
        """The base class's, with the spans whose tokens attend both ways (``_both_ways_spans``)."""
        mm = super().multimodal_input(num_tokens, images)
        mm.both_ways = self._both_ways_spans(num_tokens, images)
        return mm

    def text_only_input(self, num_tokens: int) -> MultiModalInput | None:
        """A prefix LM's text prompt: no image, its whole prompt one both-ways span (``WHOLE_PROMPT``)."""
        if self.image_alone:  # mlx-vlm's model has no call for a text alone (its embeddings without pixels raise)
            raise ValueError("it needs an image: its encoder reads the image alone, the text seeds its decoder")
        if self.both_ways is not WHOLE_PROMPT:
            return None
        return MultiModalInput(both_ways=self._both_ways_spans(num_tokens, []))

    def _both_ways_spans(self, num_tokens: int, images: list[ImageInput]) -> list[tuple[int, int]]:
        """mlx-vlm's ``"vision"`` rule (Gemma 4): each contiguous block of an image's vision tokens
        (``mm_token_type_ids`` 1 or 2; the run's stand-in tokens where the processor gives none)
        sees itself whole, on top of the causal mask; its markers stay causal. A prefix LM's rule
        (``WHOLE_PROMPT``): the whole prompt, images or not, is one span (generated tokens follow it)."""
        if self.both_ways is WHOLE_PROMPT:
            return [(0, num_tokens)] if num_tokens else []
        if self.both_ways != VISION_BLOCKS:
            return []
        spans = []
        for image in images:
            types = image.encoder_inputs.get(TOKEN_TYPES_KEY)
            vision = np.isin(types[0], VISION_TOKEN_TYPES) if types is not None else None
            if vision is None or vision.shape != (image.num_tokens,):
                vision = np.asarray(image.token_ids) == self._run.stand_in
            spans += [(image.offset + s, image.offset + e) for s, e in true_runs(vision)]
        return spans

    def prepare(self, token_ids: list[int], images: list, policy: MediaPolicy):
        """The base class's, after the processor's own rewriting where text follows an image: the text's first
        token dropped there, where the processor drops it (``drops_token_after_image``), as mlx-vlm's prompt has."""
        if self._drops_token_after_image:
            token_ids = without_token_after_images(token_ids, self.placeholder_token_id)
        return super().prepare(token_ids, images, policy)

    def prompt_text(self, text: str) -> str:
        """``text`` with the stand-in token's text for each placeholder of several tokens
        (``ImageRun.stand_in``; the text as it is where the placeholder is one token); a numbered
        placeholder's every number (``numbered_placeholder``: Phi-3-vision's ``<|image_2|>`` too)."""
        if self._stand_in_text is None:
            return text
        numbered = numbered_placeholder(self.image_placeholder_text)
        if numbered is not None:
            return numbered.sub(lambda _: self._stand_in_text, text)
        return text.replace(self.image_placeholder_text, self._stand_in_text)


def _merged_layout(model, run: list[int], outputs, layout: ImageRun):
    """``get_input_embeddings`` on ``run``, the ids of ``outputs`` (a processor's) between ``layout``'s ends."""
    encoder_inputs = _encoder_inputs(outputs, layout, np.asarray(outputs["input_ids"]).shape[-1])
    pixels = next(encoder_inputs.pop(key) for key in PIXEL_KEYS if key in encoder_inputs)
    inputs = {name: _model_input(value) for name, value in encoder_inputs.items()}
    ids = mx.array([run])
    return model.get_input_embeddings(ids, _model_input(pixels), mask=mx.ones(ids.shape, dtype=mx.int32), **inputs)


def _encodes_the_image_alone(model, processor) -> bool:
    """Whether ``model`` is an encoder-decoder whose encoder input is the image alone (``image_alone``): its
    embeddings for a probe image come with the decoder's start (``DECODER_START``) and as many rows for two
    texts of different lengths."""
    from PIL import Image

    probe = Image.new("RGB", PROBE_IMAGE_SIZE)
    try:
        rows = []
        for text in ("a", "a longer text"):
            out = processor(text=[text], images=[probe], return_tensors="np")
            merged = model.get_input_embeddings(mx.array(out["input_ids"]), mx.array(out["pixel_values"]))
            if _fields(merged).get(DECODER_START) is None:
                return False
            rows.append(_embeds(merged).shape[1])
    except Exception:  # noqa: BLE001 -- a processor or model of another kind refuses the probe its own way
        return False
    return rows[0] == rows[1]


def _call_here(fn):
    """``on_engine_thread`` where the caller is the engine thread (``EngineCore`` used directly)."""
    return fn()


def _encoder_inputs(outputs, run: ImageRun, length: int) -> dict[str, np.ndarray]:
    """The processor's outputs about the image, as arrays: not the text's, not strings or lists
    of them (DeepSeek-VL2's ``sft_format``). An output with one entry per prompt token (a
    ``[1, length]`` mask: DeepSeek-VL2's ``images_seq_mask``, which counts the BOS) is cut to the
    run, as the run's ids are: ``encode`` gives the model the run alone. A list of Python numbers stays
    the list (``_plain_list``), where nothing is cut or moved in it."""
    inputs = {}
    for name, value in outputs.items():
        if name in PIXEL_KEYS and _is_array_list(value):  # arrays of several sizes, kept as the model takes them
            inputs[name] = list(value)
            continue
        array = _as_array(value)
        if name in PROCESSOR_TEXT_KEYS or array.dtype.kind not in "biuf":
            continue
        kept = name not in PIXEL_KEYS and array.shape != (1, length) and name not in PROMPT_POSITION_KEYS
        if array.shape == (1, length):
            array = array[:, run.prefix : length - run.suffix]
        if name in PROMPT_POSITION_KEYS:
            array = array - run.prefix
        inputs[name] = value if kept and _plain_list(value) else array
    return inputs


def _as_array(value) -> np.ndarray:
    """A processor output as a NumPy array; an mlx array of bfloat16 (DeepSeek-OCR's processor makes its
    outputs mlx arrays; NumPy has no such type) widened to float32, exactly."""
    if isinstance(value, mx.array) and value.dtype == mx.bfloat16:
        return np.array(value.astype(mx.float32))
    return np.asarray(value)


def _is_array_list(value) -> bool:
    """Whether a processor output is a list of mlx arrays: DeepSeek-OCR's pixels, its local crops then its
    global view, whose sizes differ (a 1024 px placeholder where an image has no crops, in a batch). Its
    model takes them as that list (``_model_input``), in their dtype (bfloat16: its SAM runs at its weights'
    precision)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, mx.array) for v in value)


def _plain_list(value) -> bool:
    """Whether ``value`` is a list of Python numbers, or of tuples or lists of them: what mlx-vlm's
    ``prepare_inputs`` hands the model as it is (arrays it converts to ``mx.array``), and some models read
    as Python values: Moondream's tower tests ``crop_layouts``' truth (an array of several raises) and
    counts crops from ``num_crops``' entries. So the engine keeps them lists (``_model_input``)."""

    def plain(item) -> bool:
        if isinstance(item, (tuple, list)):
            return all(plain(inner) for inner in item)
        return isinstance(item, (int, float)) and not isinstance(item, bool)

    return isinstance(value, list) and plain(value)


def _model_input(value):
    """An encoder input as mlx-vlm's ``prepare_inputs`` gives it to the model: a list as it is (plain numbers,
    ``_plain_list``; DeepSeek-OCR's pixels, ``_is_array_list``), else an array."""
    return value if isinstance(value, list) else mx.array(value)


def _positions_outside_the_run(image: ImageInput) -> str | None:
    """The first ``PROMPT_POSITION_KEYS`` output of ``image`` with a position outside its run (None: none)."""
    for name in sorted(PROMPT_POSITION_KEYS & set(image.encoder_inputs)):
        positions = image.encoder_inputs[name]
        if np.any((positions < 0) | (positions > image.num_tokens)):
            return name
    return None


def _three_axes(positions) -> np.ndarray:
    """``[3, batch, length]`` positions: 1-D ones (``[batch, length]``) on all three axes."""
    positions = np.array(positions)
    return np.broadcast_to(positions, (3, *positions.shape)) if positions.ndim == 2 else positions


def true_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in ``flags``."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _mask_of_the_caches(embeds: mx.array, cache) -> mx.array | None:
    """The mask the first cache makes for this call's tokens (the engine's paged caches: its layout's)."""
    from mlx_vlm.models.base import create_attention_mask

    return create_attention_mask(embeds, cache, return_array=True) if cache is not None else None


def both_ways_reason(value: object) -> str:
    """Why a text model whose tokens attend both ways by a rule other than ``"vision"``'s image
    blocks and a prefix LM's whole prompt (``True``) is refused: the engine keeps those spans only."""
    return (f"its text model lets tokens attend both ways by a rule the engine does not know "
            f"(use_bidirectional_attention={value!r}), where it serves an image's block of tokens "
            "(\"vision\") and a prefix LM's whole prompt (True)")  # fmt: skip


def _bidirectional_attention(model) -> object:
    """The text config's ``use_bidirectional_attention`` (PaliGemma's prefix, ``WHOLE_PROMPT``; Gemma 4's
    ``"vision"``: image tokens see each other both ways in mlx-vlm), None where unset."""
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    return getattr(text_config, "use_bidirectional_attention", None)


_EMBEDDING = "inputs_embeds"
_VISUAL = "image-token features"
"""``_split_rows``'s name for the flag and deepstack columns ``encode`` appends (``_visual_rows``)."""


def _deepstack_layers(value) -> list[mx.array] | None:
    """Deepstack features as one ``[image tokens, width]`` array per text layer ([] where there
    are none): a list (Qwen3-VL's form), or one inside mlx-vlm's ``DeepstackVisualFeatures``
    (Cohere Compass's ``.embeddings``). None for another form: one row per prompt token
    (Granite 4 Vision's ``[layers, tokens, width]``, ``deepstack_per_token``)."""
    if value is None:
        return []
    value = getattr(value, "embeddings", value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, mx.array) and v.ndim == 2 for v in value):
        return list(value)
    return None


def _text_feature(text: dict, name: str, batch_shape: tuple[int, ...], shape: tuple[int, ...]) -> mx.array:
    """A per-token feature of the text-only call (``text``): its own, or zeros (``ZERO_AT_TEXT``)."""
    value = text.get(name)
    return value if value is not None else mx.zeros((*batch_shape, *shape), dtype=mx.float32)


def _embeds(merged) -> mx.array:
    return getattr(merged, "inputs_embeds", merged)


def _fields(merged) -> dict:
    return merged.to_dict() if hasattr(merged, "to_dict") else {}

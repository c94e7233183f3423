"""MLXModelRunner: executes a ``SchedulerOutput`` with batched MLX forwards, then samples.

Runs on the engine thread only (MLX streams are thread-local). Rows of one step are grouped into
forward calls by estimated cost: a call reads every weight once however few rows it has, and a
padded row computes its padding too, so rows share a call when padding them costs less than a
call of their own (all decodes share one; a short prefill chunk is not padded to a long one). A
model with recurrent layers whose code ignores padding (``RecurrentStateSpec.pads``) is never
padded: only rows of equal length share a call.

Recurrent state (``state_pool.py``) computed by a step is written to the state pool only after
the whole step (every forward call and the sampling) succeeded, so a failed step can be re-run
request by request from the state before it.

With a vision-language model, a row whose tokens include image placeholders gets the image's
features written over the placeholders' embeddings; the features come from the MLLM cache or
from one vision-encoder run per image, and are dropped once the prompt's images are in the KV
cache (a prefix-cache hit past an image skips the encoder altogether).

Rows whose request has a structured-output constraint get their logits masked (one MLX
expression for the batch, ``structured/bitmask.py``) before sampling; a request whose sampled
token the constraint cannot accept is reported in ``ModelRunnerOutput.errors``.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import replace

import mlx.core as mx
import numpy as np

from vllm_mlx.core.canonical import canonical_bytes
from vllm_mlx.core.kv.spec import BlockGroups, GroupLayout, HeldCacheSpec, KVLayout, group_layers, is_held, is_recurrent
from vllm_mlx.core.multimodal import ImageInput
from vllm_mlx.core.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, StepRecord
from vllm_mlx.core.request import Request, SamplingParams
from vllm_mlx.executor.attention import (
    FRESH_ROWS_APART,
    ONE_ROW_PER_CALL,
    KVPool,
    MLXAttentionBackend,
    PagedLayerCache,
    RowSpec,
    chunk_sizes,
    layer_specs,
    model_type_of,
)
from vllm_mlx.executor.bitmask import StepMasks
from vllm_mlx.executor.cache_list import CacheNesting
from vllm_mlx.executor.cpu_kernels import CPUKernels
from vllm_mlx.executor.held_caches import HeldCaches, cache_arrays, measure_held
from vllm_mlx.executor.sampling import sample, sampling_row
from vllm_mlx.executor.state_pool import RecurrentLayerCache, StateLayout, StatePool, StateWrite, probe_state_layout
from vllm_mlx.executor.verification import VerificationPlan, verify_proposals
from vllm_mlx.lora.batched import LoRASlots
from vllm_mlx.multimodal.cache import MLLMCacheManager

# What a forward call costs besides its tokens, in tokens of compute: every weight is read once
# per call however few rows it has. ~20 measured on a 2-core x86_64 CPU with a 2B-class float32
# hybrid (backbone: 0.19 s for one token, 9 ms per token in large calls); a GPU computes tokens
# relatively faster, so a call weighs more there. Padding a row costs its padded tokens.
CALL_COST_TOKENS = 32
NULL_BLOCK = 0  # reserved: never allocated to a request (padding writes land there)


def group_for_padding(scheduled: list[ScheduledRequest], pad: bool = True) -> list[list[ScheduledRequest]]:
    """Split rows into forward calls, longest first, at the least estimated cost: the padded
    tokens of every call plus ``CALL_COST_TOKENS`` per call. With ``pad=False`` only rows of
    equal length share a call.

    Calls hold runs of the rows sorted by length (a row never pads to more than the call's
    longest row needs), and rows of equal length always share one, so the search is over where
    to cut the list of distinct lengths: a small dynamic program. Decode rows count as long as
    the longest of them (speculative decoding's rows verify proposals of different lengths), so
    they always share one call.
    """
    decoding = [s.num_new_tokens for s in scheduled if s.num_known_tokens == 1]
    decode_width = max(decoding, default=1) if pad else None

    def width(item: ScheduledRequest) -> int:
        """A decode row (one known token, and any proposals it verifies) shares the widest
        decode row's call: the speculation policy prices a step as rows x that width."""
        return decode_width if decode_width is not None and item.num_known_tokens == 1 else item.num_new_tokens

    runs: dict[int, list[ScheduledRequest]] = {}
    for item in sorted(scheduled, key=width, reverse=True):
        runs.setdefault(width(item), []).append(item)
    widths, rows = list(runs), list(runs.values())
    if not pad or len(rows) <= 1:
        return rows
    best, cut = [0], [0]  # best[j]: least cost of the first j runs; cut[j]: where its last call starts
    for j in range(1, len(rows) + 1):
        count, options = 0, []
        for i in range(j - 1, -1, -1):
            count += len(rows[i])
            options.append((best[i] + CALL_COST_TOKENS + count * widths[i], i))
        cost, start = min(options)
        best.append(cost)
        cut.append(start)
    groups, j = [], len(rows)
    while j:
        groups.append([item for run in rows[cut[j] : j] for item in run])
        j = cut[j]
    return groups[::-1]


def _fresh_rows_apart(group: list[ScheduledRequest]) -> list[list[ScheduledRequest]]:
    """``group`` as the calls of its rows that start a sequence and of those that continue one
    (``FRESH_ROWS_APART``; either may be empty, and is then left out)."""
    fresh = [s for s in group if s.num_computed_tokens == 0]
    going = [s for s in group if s.num_computed_tokens != 0]
    return [part for part in (fresh, going) if part]


class SplitModel:
    """A model as backbone (hidden states) + head (logits), when that split is exact.

    A prefill chunk needs logits at one position only; projecting every position onto the
    vocabulary wastes ~15% of a prefill step. mlx-lm models keep their transformer in ``.model``
    and their head in ``lm_head`` (or tie it to the embedding); some scale or cap logits in
    ``__call__``. So the split is probed once against the model's own ``__call__`` and used only
    if it reproduces the logits exactly.
    """

    def __init__(self, backbone, head) -> None:
        self.backbone = backbone
        self.head = head

    @classmethod
    def probe(cls, model) -> SplitModel | None:
        backbone = getattr(model, "model", None)
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(backbone, "embed_tokens", None)
        head = lm_head if lm_head is not None else getattr(embed, "as_linear", None)
        if not callable(backbone) or head is None:
            return None
        tokens = mx.array([[1, 2, 3, 4]])
        try:
            # One forward at a time: a pipeline stage's forward holds point-to-point sends and
            # receives, and two in one graph could run in different orders on different ranks.
            whole = model(tokens)
            mx.eval(whole)
            same = mx.array_equal(whole, head(backbone(tokens))).item()
        except Exception:  # any other signature or structure: use the model as it is
            return None
        return cls(backbone, head) if same else None


class MLXModelRunner:
    """Owns the model and the KV pool; turns scheduled work into sampled tokens.

    ``model`` is an mlx-lm model, or a ``VisionLanguageModel`` adapter; ``mllm_cache`` (vision
    models only; None = no caching) keeps encoder outputs across requests. A model with
    recurrent layers gets a state pool of ``num_state_slots`` slots (the null slot included;
    ``state_layout``: its probed shapes, probed here when not given). ``block_groups``: which
    layers share a block table and KV arrays (None: one group, one array per layer).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        mllm_cache: MLLMCacheManager | None = None,
        num_state_slots: int = 0,
        state_layout: StateLayout | None = None,
        *,
        split_head: bool = True,
        block_groups: BlockGroups | None = None,
    ) -> None:
        from vllm_mlx.multimodal.vlm_models import VisionLanguageModel

        self.model = model
        self.vision = model if isinstance(model, VisionLanguageModel) else None
        # split_head=False skips the split's probe forward (a throwaway runner needs no speed).
        self.split = SplitModel.probe(model) if split_head and not self.vision else None
        self.kernels = CPUKernels.for_model(model)  # None: stock kernels (not the CPU backend, ...)
        self.mllm_cache = mllm_cache
        self.specs = layer_specs(model, getattr(model, "model_type", None))
        self.num_layers = len(self.specs)  # one cache per spec (make_cache may differ from layers)
        self.nesting = CacheNesting.of(model)  # the specs' caches as the model's layers take them
        self.block_groups = block_groups or BlockGroups.single(self.specs)
        used = set(self.block_groups.array_of_layer.values())  # a recurrent layer writes no KV
        self.pool = KVPool(self.block_groups.num_arrays, num_blocks, block_size, used=used)
        self.state_pool = self._make_state_pool(num_state_slots, state_layout)
        self.pads = all(s.pads for s in self.specs if is_recurrent(s))
        chunks = chunk_sizes(model)
        self.held = HeldCaches(model) if is_held(self.specs) else None
        """A model that keeps its own caches per request (``held_caches.py``); else None."""
        # Code that takes one position for the whole batch (a chunk mask built from host ints
        # too), and held caches (each row's own).
        self.one_row_per_call = model_type_of(model) in ONE_ROW_PER_CALL or bool(chunks) or self.held is not None
        self.fresh_rows_apart = model_type_of(model) in FRESH_ROWS_APART
        self.attention = MLXAttentionBackend(
            self.pool, self.specs, self.state_pool, self.block_groups, chunks, host_offsets=self.one_row_per_call
        )
        self.last_step: StepRecord | None = None
        self.vision_encoder_runs = 0
        self.lora: LoRASlots | None = None
        """With ``enable_lora``: the adapter slots; each row's update follows ``Request.lora_slot``."""

    def _make_state_pool(self, num_slots: int, layout: StateLayout | None) -> StatePool | None:
        if not any(is_recurrent(s) for s in self.specs):
            return None
        if num_slots < 2:
            raise ValueError("a model with recurrent layers needs num_state_slots >= 2 (slot 0 is reserved)")
        return StatePool(layout or probe_state_layout(self.model, self.specs), num_slots)

    def release(self) -> None:
        """Drop the model and the KV pool (MLX arrays), on the thread that made them. MLX
        arrays still alive at interpreter exit after being used on another thread abort the
        process ("terminate called without an active exception")."""
        self.model = self.split = self.vision = self.state_pool = None
        if self.attention is not None:
            self.attention.state_pool = None
        self.pool.keys = [None] * len(self.pool.keys)
        self.pool.values = [None] * len(self.pool.values)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput()
        if self.held is not None:
            for request_id in scheduler_output.preempted_ids:
                self.held.drop(request_id)
        runnable = [s for s in scheduler_output.scheduled if self._images_ready(s, output.errors)]
        groups = [[s] for s in runnable] if self.one_row_per_call else group_for_padding(runnable, self.pads)
        if self.fresh_rows_apart:
            groups = [part for group in groups for part in _fresh_rows_apart(group)]
        sampled: list[ScheduledRequest] = []
        picked: list[mx.array] = []
        states: list[StateWrite] = []  # written only if the whole step succeeds
        for group in groups:
            for item, rows in zip(group, self._forward(group, states)):
                if rows is not None:
                    sampled.append(item)
                    picked.append(rows)
        self.last_step = StepRecord(
            scheduler_output.step_id,
            [s.request_id for s in scheduler_output.scheduled],
            [s.num_new_tokens for s in scheduler_output.scheduled],
            len(groups),
        )
        self._drop_finished_image_features(runnable)
        if sampled:
            self._sample(sampled, self._head(mx.concatenate(picked)), output)
        if self.state_pool is not None:
            self.state_pool.commit(states, skip_slots=self._rolled_back_slots(sampled, output))
        return output

    def _sample(self, sampled: list[ScheduledRequest], logits: mx.array, output: ModelRunnerOutput) -> None:
        """Sample every position that needs a token (one per row; ``k + 1`` for a row verifying
        ``k`` proposed tokens: ``verification.py``) and record the rows' tokens in ``output``."""
        plan = VerificationPlan.of(sampled)
        masks = StepMasks.build(plan.requests)  # None when no row has a structured-output constraint
        batch = logits if masks is None else masks.apply(logits)
        result = sample(batch, plan.sampling_rows)
        if masks is not None:  # fail closed: such a request ends with an error, alone
            output.errors.update(masks.rejected(plan.requests, result.token_ids))
        for item, tokens, logprobs in plan.per_request(result):
            if item.request_id in output.errors:
                continue
            verdict = verify_proposals(item.spec_token_ids, tokens, logprobs) if item.spec_token_ids else None
            last = len(verdict.accepted_token_ids) if verdict is not None else 0
            output.sampled_token_ids[item.request_id] = tokens[last]
            if logprobs[last] is not None:
                output.logprobs[item.request_id] = logprobs[last]
            if verdict is not None:
                output.drafts[item.request_id] = verdict

    def _rolled_back_slots(self, sampled: list[ScheduledRequest], output: ModelRunnerOutput) -> set[int]:
        """State slots whose new state must not be written: rows that rejected a proposed token
        (their state saw it; the request recomputes from the step's start instead)."""
        return {s.state_slot for s in sampled if (v := output.drafts.get(s.request_id)) is not None and v.num_rejected}

    def probe(self) -> None:
        """Run one token through the model and the sampler; raise if that fails.

        Tells a broken engine from a bad request: when every request of a step failed alone,
        a probe that fails too means the fault is the engine's. Its KV goes to the null block
        (padding's sink, owned by no request) and its recurrent state is never written, so it
        disturbs nothing.
        """
        probe = Request("engine-probe", [0], SamplingParams(temperature=0, seed=0))
        item = ScheduledRequest(probe, num_computed_tokens=0, num_new_tokens=1, block_ids=[NULL_BLOCK])
        try:
            [rows] = self._forward([item], [])
            sample(self._head(rows), [sampling_row(item)])
        finally:
            if self.held is not None:
                self.held.drop(probe.request_id)

    def keep_held(self, request_ids) -> None:
        """Drop the held caches of requests not in ``request_ids`` (the running ones): finished,
        aborted or preempted requests' memory goes at once. Nothing without held caches."""
        if self.held is not None:
            self.held.keep_only(request_ids)

    def _forward(self, group: list[ScheduledRequest], states: list[StateWrite]) -> list[mx.array | None]:
        """One padded forward; for each sampling row (else None) the hidden states of the
        positions it samples (its last, and before it one per proposed token it verifies), or
        their logits when the model has no separate head (``_head`` finishes them). The
        recurrent states it computed are appended to ``states`` (not yet written)."""
        if self.held is not None:
            return [self._held_forward(item) for item in group]
        rows = [row_spec(s) for s in group]
        width = max(len(r.tokens) for r in rows)
        inputs = mx.array([r.tokens + [0] * (width - len(r.tokens)) for r in rows])
        caches = self.attention.make_caches(rows)
        wanted = [i for i, s in enumerate(group) if s.samples]
        counts = [len(group[i].spec_token_ids) + 1 for i in wanted]
        row_index = [i for i, n in zip(wanted, counts) for _ in range(n)]
        positions = [len(rows[i].tokens) - n + j for i, n in zip(wanted, counts) for j in range(n)]
        kernels = self.kernels.active(_key_ranges(caches), inputs.size) if self.kernels is not None else nullcontext()
        adapters = self.lora.rows([s.request.lora_slot for s in group]) if self.lora is not None else nullcontext()
        with kernels, adapters:
            layer_caches = self.nesting.nest(caches)
            if self.vision is not None:
                out = self._vision_hidden_states(group, inputs, layer_caches)
            elif self.split is not None:
                out = self.split.backbone(inputs, cache=layer_caches)
            else:
                out = self.model(inputs, cache=layer_caches)
        picked = out[mx.array(row_index), mx.array(positions)] if wanted else None
        new_states = [w for c in caches if isinstance(c, RecurrentLayerCache) for w in c.writes()]
        # Evaluate now (asynchronously: sampling's graph is built meanwhile): the pool's next
        # scatter can then update its buffers in place (the stream runs in order).
        mx.async_eval([picked] if picked is not None else [], self.pool.arrays(), [w.value for w in new_states])
        states.extend(new_states)
        per_row: list[mx.array | None] = [None] * len(group)
        first = 0
        for i, n in zip(wanted, counts):
            per_row[i] = picked[first : first + n]
            first += n
        return per_row

    def _held_forward(self, item: ScheduledRequest) -> mx.array | None:
        """One row through the model on the request's own caches (``held_caches.py``): what
        ``_forward`` returns for it. A rebuilt cache's earlier tokens go first in the same call."""
        row = self.held.row(item.request_id, item.request.all_token_ids, item.num_computed_tokens, item.token_ids)
        inputs = mx.array([row.tokens])
        adapters = self.lora.rows([item.request.lora_slot]) if self.lora is not None else nullcontext()
        self.held.feeding(item.request_id)
        with adapters:
            if self.vision is not None:
                out = self._held_vision_row(item, row, inputs)
            else:
                model = self.split.backbone if self.split is not None else self.model
                out = model(inputs, cache=row.caches)
        self.held.fed(item.request_id, item.num_computed_tokens + item.num_new_tokens)
        picked = out[0, -(len(item.spec_token_ids) + 1) :] if item.samples else None
        mx.async_eval([picked] if picked is not None else [], cache_arrays(row.caches))
        return picked

    def _held_vision_row(self, item: ScheduledRequest, row, inputs: mx.array) -> mx.array:
        """A held vision row's hidden states, with the state its model keeps per request (its
        ``request_state``) on the model for the call: the request's own, or a fresh one with fresh caches."""
        if not self.vision.request_state:
            return self._held_vision_hidden_states(item, row.num_recomputed, inputs, row.caches)
        self.vision.put_request_state(row.held.model_state, item.request)
        try:
            return self._held_vision_hidden_states(item, row.num_recomputed, inputs, row.caches)
        finally:
            row.held.model_state = self.vision.take_request_state()

    def _held_vision_hidden_states(self, item: ScheduledRequest, recomputed: int, inputs: mx.array, caches):
        """``_vision_hidden_states`` of a held row that also feeds ``recomputed`` earlier tokens: the
        row as if scheduled from there, its images' features at hand for all of it."""
        if recomputed:
            start = item.num_computed_tokens - recomputed
            item = replace(item, num_computed_tokens=start, num_new_tokens=item.num_new_tokens + recomputed)
            errors: dict[str, str] = {}
            if not self._images_ready(item, errors):
                raise RuntimeError(errors[item.request_id])
        if self.vision.encoder_decoder:
            # Its prompt goes through the encoder at the request's first row (held whole: one both-ways
            # span), every later token through the decoder alone (``encoder_decoder_hidden_states``).
            encoder_tokens = item.request.num_prompt_tokens if item.num_computed_tokens == 0 else 0
            images = self._image_rows([item], inputs.shape[1]) if encoder_tokens else None
            return self.vision.encoder_decoder_hidden_states(inputs, caches, images, encoder_tokens)
        return self._vision_hidden_states([item], inputs, caches, self._held_request_inputs(item))

    def _held_request_inputs(self, item: ScheduledRequest) -> dict:
        """What the row's call takes beside the embeddings (``GenericVisionModel.step_inputs``): its request's
        inputs (mllama's cross-attention states of every image of its prompt, and masks), built at its first
        row from its images' features (from the MLLM cache, as any row's) and kept with its held caches, so
        later calls (decode steps, long after the images' rows) need no image again."""
        if not getattr(self.vision, "holds_request_inputs", False):
            return {}
        held = self.held.entry(item.request_id)
        request = item.request
        if held.inputs is None:
            images = request.mm_input.images if request.mm_input is not None else []
            features = [self._image_features(image, request.cache_salt) for image in images]
            held.inputs = self.vision.request_inputs(request.prompt_token_ids, images, features)
        if not held.inputs:
            return {}
        return self.vision.step_inputs(held.inputs, len(request.prompt_token_ids), item.num_computed_tokens,
                                       item.num_new_tokens)  # fmt: skip

    def _head(self, picked: mx.array) -> mx.array:
        """Logits of the sampling rows' hidden states, all forward calls of the step at once:
        the head's weights (the vocabulary times the hidden size, 1.2 GB in float32 for
        Gemma 3's 262k tokens) are read once per step, not once per call."""
        if self.vision is not None:
            return self.vision.logits(picked)
        if self.split is not None:
            return self.split.head(picked)
        return picked  # the model's own output: logits already

    # ---- images ------------------------------------------------------------------------------

    def _images_ready(self, item: ScheduledRequest, errors: dict[str, str]) -> bool:
        """Make sure the features of every image this step's tokens cover are at hand; a
        request whose image cannot be encoded fails alone (recorded in ``errors``)."""
        mm = item.request.mm_input
        if mm is None:
            return True
        try:
            for image, _, _ in mm.overlaps(item.num_computed_tokens, item.num_new_tokens):
                self._image_features(image, item.request.cache_salt)
        except Exception as exc:  # the encoder's failure is this request's, not the batch's
            errors[item.request_id] = f"the vision encoder failed on an image: {exc}".splitlines()[0]
            return False
        return True

    def _image_features(self, image: ImageInput, cache_salt: str | None) -> mx.array:
        if image.features is not None:
            return image.features
        key = mllm_cache_key(image.image_hash, cache_salt)
        entry = self.mllm_cache.get(key) if self.mllm_cache is not None else None
        if entry is not None:
            features = entry.features
        else:
            features = self.vision.encode(image)
            mx.eval(features)
            self.vision_encoder_runs += 1
            if features.shape[0] != image.num_tokens:
                raise ValueError(f"{features.shape[0]} image features for {image.num_tokens} placeholders")
            if self.mllm_cache is not None:
                self.mllm_cache.put(key, features, image.num_tokens, image=image.image)
        image.features = features
        return features

    def _vision_hidden_states(
        self, group: list[ScheduledRequest], inputs: mx.array, caches, row_inputs: dict | None = None
    ) -> mx.array:
        """The language model's hidden states, images' features over their placeholders; ``row_inputs``: a
        held row's own inputs beside the embeddings (``_held_request_inputs``), passed by name."""
        images = self._image_rows(group, inputs.shape[1])
        positions = self._position_ids(group, inputs.shape[1]) if self.vision.uses_mrope else None
        return self.vision.hidden_states(inputs, caches, positions, images, **(row_inputs or {}))

    def _image_rows(self, group: list[ScheduledRequest], width: int):
        """The images' features the rows' tokens cover, at their positions in the batch (None: no image)."""
        from vllm_mlx.multimodal.vlm_models import ImageRows

        batch = len(group)
        index: list[int] = []
        pieces: list[mx.array] = []
        for row, item in enumerate(group):
            mm = item.request.mm_input
            if mm is None:
                continue
            start = item.num_computed_tokens
            for image, lo, hi in mm.overlaps(start, item.num_new_tokens):
                pieces.append(image.features[lo - image.offset : hi - image.offset])
                first = row * width + lo - start
                index.extend(range(first, first + hi - lo))
        return ImageRows(index, mx.concatenate(pieces), batch, width) if pieces else None

    def _position_ids(self, group: list[ScheduledRequest], width: int) -> mx.array:
        """``[axes, B, T]`` multi-axis rotary positions (padding positions are never seen). A prompt
        whose positions the model computes itself (``positions``) gets them at its first step.
        ``axes``: the model's (``position_axes``: 3 for Qwen2-VL's layout, 4 for Hunyuan-VL's)."""
        positions = np.zeros((self.vision.position_axes, len(group), width), dtype=np.int32)
        for row, item in enumerate(group):
            start, count = item.num_computed_tokens, item.num_new_tokens
            mm = item.request.mm_input
            if mm is not None and mm.positions is None:
                mm.positions, mm.rope_delta = self.vision.positions(item.request.prompt_token_ids, mm.images)
            if mm is not None:
                positions[:, row, :count] = mm.position_ids(start, count)
            else:
                positions[:, row, :count] = np.arange(start, start + count)
        return mx.array(positions)

    @staticmethod
    def _drop_finished_image_features(scheduled: list[ScheduledRequest]) -> None:
        """Forget features once a prompt's images are in the KV cache (the MLLM cache keeps its
        own reference); a preempted request fetches them again."""
        for item in scheduled:
            mm = item.request.mm_input
            if mm is not None and mm.done_with_images(item.num_computed_tokens + item.num_new_tokens):
                for image in mm.images:
                    image.features = None


def measure_kv_layout(model, state_layout: StateLayout | None = None) -> KVLayout:
    """The KV pool's real layout for ``model``: one token through the engine's own forward path
    into a one-slot pool, then the bytes each layer's slot took.

    Exact where reading configs is not: the dtype is what the model produces (bfloat16 weights
    give bfloat16 keys; weights dequantized to float32 on the CPU backend give float32), and KV
    heads, key and value sizes (MLA's differ) are the arrays' own. Layers that write nothing
    (they reuse another layer's keys) cost nothing. Recurrent groups cost ``bytes_per_request``
    (``state_layout``, probed when not given). The scratch runner and its pools are dropped.
    """
    specs = layer_specs(model, getattr(model, "model_type", None))
    if is_held(specs):
        held = measure_held(model)
        return KVLayout((GroupLayout(HeldCacheSpec(), (0,), held.bytes_per_token),), held.dtype)
    if state_layout is None and any(map(is_recurrent, specs)):
        state_layout = probe_state_layout(model, specs)
    slots = 2 if state_layout is not None else 0  # the null slot + one
    runner = MLXModelRunner(model, 1, 1, None, slots, state_layout, split_head=False)
    try:
        runner.probe()
        per_token = [runner.pool.layer_bytes_per_slot(i) for i in range(runner.num_layers)]
        per_request = _state_bytes(state_layout, len(specs))
        groups = tuple(
            GroupLayout(group.spec, group.layers, sum(per_token[i] for i in group.layers),
                        sum(per_request[i] for i in group.layers))  # fmt: skip
            for group in group_layers(runner.specs)
        )
        return KVLayout(groups, runner.pool.dtype or "float32", _uniform_layers(runner.pool, specs))
    finally:
        runner.release()


def _uniform_layers(pool: KVPool, specs) -> bool:
    """Whether every attention layer wrote keys and values of one shape and dtype (so layers of
    different block groups can share KV arrays)."""
    attention = [i for i, spec in enumerate(specs) if not is_recurrent(spec)]
    shapes = set()
    for i in attention:
        keys, values = pool.keys[i], pool.values[i]
        if keys is None:  # writes nothing (reuses another layer's keys): keep it simple
            return False
        shapes.add((keys.shape[0], keys.shape[2], keys.dtype, values.shape[0], values.shape[2], values.dtype))
    return len(shapes) == 1


def _state_bytes(layout: StateLayout | None, num_layers: int) -> list[int]:
    """Each layer's recurrent-state bytes per request (0 for attention layers)."""
    arrays = layout.layers if layout is not None else {}
    return [sum(a.nbytes for a in arrays.get(i, ()) if a is not None) for i in range(num_layers)]


def mllm_cache_key(image_hash: str, cache_salt: str | None) -> str:
    """The MLLM cache key of an image for a request: its content hash, bound to the request's
    ``cache_salt`` when it has one, so salted tenants never share encoder outputs (nor learn,
    from timing or stats, which images others sent)."""
    if cache_salt is None:
        return image_hash
    return hashlib.sha256(canonical_bytes(("mllm", image_hash, cache_salt))).hexdigest()


def _key_ranges(caches):
    """The lookup of the forward's masks' key ranges (the caches share one batch layout)."""
    layout = next((c.layout for c in caches if isinstance(c, PagedLayerCache)), None)
    return layout.key_ranges if layout is not None else None


def row_spec(item: ScheduledRequest) -> RowSpec:
    return RowSpec(
        tokens=item.token_ids,
        num_computed=item.num_computed_tokens,
        block_ids=item.block_ids,
        state_slot=item.state_slot,
        state_read_slot=item.state_read_slot,
        checkpoint_slot=item.checkpoint_slot,
        block_tables=item.block_tables,
        both_ways=_both_ways(item),
    )


def _both_ways(item: ScheduledRequest) -> list[tuple[int, int]]:
    """The both-ways spans (``MultiModalInput.both_ways``) this step's tokens of ``item`` touch."""
    mm = item.request.mm_input
    return [] if mm is None else mm.spans_in(item.num_computed_tokens, item.num_new_tokens)

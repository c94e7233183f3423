"""EngineCore: schedule -> execute -> update, on the thread that owns the model.

``EngineCore`` is synchronous and single-threaded: whoever calls ``step()`` must be the thread
that created it (MLX streams are thread-local). ``AsyncEngineCore`` (``async_engine.py``) runs
one on a dedicated thread and serves callers from any thread or asyncio loop.

The engine is split as vLLM v1's is. ``InputProcessor`` (``input_processor.py``) turns a
caller's prompt and ``SamplingParams`` into ``Request``s: tokenizing, images, constraints,
validation, ``n > 1`` siblings; its ``prepare_prompt`` and ``compile_constraint`` run on any
thread. ``EngineCore`` (this module) owns the model, the scheduler, the KV cache and the runner,
and each ``step()`` is schedule -> execute -> update. ``OutputProcessor``
(``output_processor.py``) turns the requests a step advanced into ``RequestOutput``s:
detokenizing, stop strings, logprobs, fanning ``n`` completions back into one output. The types
that cross these layers live in ``outputs.py``; memory sizing lives in ``core/kv/sizing.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_mlx.config import DEFAULT_MLLM_CACHE_MEMORY, EngineConfig  # noqa: F401 (re-exported: public API here)
from vllm_mlx.config.options import apply_options
from vllm_mlx.core.kv.paged_cache import PagedCacheManager
from vllm_mlx.core.kv.sizing import (  # noqa: F401 (re-exported: imported from here by callers)
    KVShape,
    MemoryNeeds,
    StateBudget,
    available_memory,
    kv_budget_bytes,
    kv_bytes_per_token,
    kv_shape,
)
from vllm_mlx.core.kv.spec import blocks_for_bytes
from vllm_mlx.core.outputs import ModelRunnerOutput, SchedulerOutput, StepRecord, recent_step_records
from vllm_mlx.core.request import Request, RequestOutput, RequestStatus, SamplingParams
from vllm_mlx.core.sched.scheduler import Scheduler
from vllm_mlx.core.snapshot import CacheSnapshot, CacheSnapshotter, MLLMSnapshot, MLLMStats
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.core.spec_decode.speculator import Speculator
from vllm_mlx.distributed.liveness import LivenessMonitor
from vllm_mlx.distributed.watchdog import (
    STARTUP,
    CollectiveWatchdog,
    RankLostError,
    exit_hung_process,
    is_collective_failure,
    startup_deadline,
)
from vllm_mlx.engine.input_processor import InputProcessor, PreparedPrompt
from vllm_mlx.engine.observation import EngineStats
from vllm_mlx.engine.output_processor import OutputProcessor
from vllm_mlx.engine.prefix_transfer import PrefixTransfer
from vllm_mlx.models.registry import get_registry
from vllm_mlx.multimodal.cache import MLLMCacheManager, MLLMCacheStats
from vllm_mlx.multimodal.images import ImageSource
from vllm_mlx.multimodal.media_policy import MediaPolicy
from vllm_mlx.platform.errors import VllmMlxError, internal_error_message
from vllm_mlx.structured.grammar import CompiledGrammar

if TYPE_CHECKING:
    from vllm_mlx.core.kv.spec import BlockGroups, KVLayout
    from vllm_mlx.engine.disk_offload import DiskOffload
    from vllm_mlx.engine.draft_model import DraftModel, LoadedDraft
    from vllm_mlx.engine.lora_slots import LoRASlotTable
    from vllm_mlx.lora.adapter import AdapterFiles
    from vllm_mlx.lora.request import LoRARequest
    from vllm_mlx.engine.weight_plan import WeightPlan
    from vllm_mlx.executor.state_pool import StateLayout
    from vllm_mlx.models import LoadedModel

logger = logging.getLogger(__name__)

def _rank_zero_group():
    """The distributed group, checked: this process must be its rank 0 (the engine)."""
    from vllm_mlx.distributed.group import TensorParallelError, init_group

    group = init_group()
    if group.rank() != 0:
        raise TensorParallelError(
            f"this is rank {group.rank()}: only rank 0 runs the engine; run vllm_mlx.engine.rank_worker.worker_loop here"
        )
    return group


@dataclass
class PreparedModel:
    """A model as the engine runs it: weights in their final format (sharded with tensor
    parallelism, a stage with pipeline parallelism), its layer specs, its recurrent-state and KV
    layouts as measured, and what sizing its pools must allow for (over all ranks)."""

    loaded: LoadedModel
    specs: list
    weight_format: str
    state_layout: StateLayout | None
    kv_layout: KVLayout
    block_groups: BlockGroups
    memory: MemoryNeeds
    plan: WeightPlan | None = None
    """The weight format's choice by memory, made before loading (``engine/weight_plan.py``)."""


def prepare_engine_model(config: EngineConfig, group=None) -> PreparedModel:
    """Load ``config.model`` and prepare it for a runner. With a distributed ``group`` every
    rank calls this (rank 0 from ``EngineCore``, the others from ``worker_loop``): the shard
    checks and the measuring forwards are collectives, issued here in the same order on all."""
    from vllm_mlx.core.kv.spec import is_held, is_recurrent
    from vllm_mlx.engine.weight_plan import log_plan, plan_weight_format
    from vllm_mlx.executor.attention import UnsupportedModelError, check_supported
    from vllm_mlx.executor.model_runner import measure_kv_layout
    from vllm_mlx.executor.state_pool import probe_state_layout
    from vllm_mlx.models import load_model, resolve_model
    from vllm_mlx.platform.cpu_backend import prepare_model_weights

    path = resolve_model(config.model, config.trust_remote_code)
    # Before the weights load: a format that cannot fit is refused here, not by the OOM killer.
    plan = plan_weight_format(config, path, group=group)
    log_plan(plan)
    loaded = load_model(path, trust_remote_code=config.trust_remote_code)
    specs = check_supported(loaded.model, loaded.config.get("model_type", "?"))
    # The whole vision-language model (tower, projector, language model), as the plan counted it.
    weights = loaded.vision.model if loaded.vision else loaded.model
    weight_format = prepare_model_weights(weights, plan.weight_format)
    # Decided on the whole model, so that every rank probes (a forward: collectives) or none does.
    recurrent = any(map(is_recurrent, specs))
    if group is not None and is_held(specs):
        raise UnsupportedModelError(
            f"{loaded.config.get('model_type', '?')!r} keeps a cache of its own per request, which tensor and "
            "pipeline parallelism do not split: run it on one process"
        )
    if group is not None:
        specs = _split_model(config, loaded, specs, group)
    state_layout = probe_state_layout(loaded.model, specs) if recurrent else None
    # After the weights are in their final format: the KV dtype follows the activations'.
    kv_layout = measure_kv_layout(loaded.model, state_layout)
    block_groups = kv_layout.block_groups(specs)
    memory = MemoryNeeds(
        kv_layout.bytes_per_block_token(block_groups),
        state_layout.bytes_per_request if state_layout else 0,
        _memory_left(config, plan),
    )
    if group is not None:
        from vllm_mlx.distributed.group import combine_memory_needs

        memory = combine_memory_needs(group, memory)
    return PreparedModel(loaded, specs, weight_format, state_layout, kv_layout, block_groups, memory, plan)


HELD_NO_SPECULATION = (
    "this model keeps a cache of its own per request, which cannot take back the rejected tokens of a "
    "verification (it runs without speculative decoding)"
)


def _settle_held_caches(config: EngineConfig, prepared: PreparedModel) -> None:
    """A model that keeps its own caches per request (``executor/held_caches.py``) shares nothing
    between requests: prefix caching is turned off (said at INFO: asked for or by default, it is
    not an error), and speculative decoding is refused.

    Raises:
        ValueError: ``speculative_config`` is set.
    """
    from vllm_mlx.core.kv.spec import is_held

    if not is_held(prepared.specs):
        return
    model_type = prepared.loaded.config.get("model_type", "?")
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config: {model_type!r}: {HELD_NO_SPECULATION}")
    if config.enable_prefix_caching:
        logger.info("prefix caching is off: %r keeps a cache of its own per request, which no other request "
                    "can share (its KV blocks only count tokens)", model_type)  # fmt: skip
        config.enable_prefix_caching = False


def _memory_left(config: EngineConfig, plan: WeightPlan) -> int:
    """The memory available now that the weights are in (what a fractional ``kv_cache_memory``
    takes its share of): within ``memory_limit`` when set, what the weights leave of it."""
    available = available_memory()
    if config.memory_limit is None:
        return available
    return max(min(available, config.memory_limit - plan.need(plan.weight_format).weights), 0)


def _split_model(config: EngineConfig, loaded: LoadedModel, specs: list, group) -> list:
    """Keep this rank's part of the model (a shard of every layer, or a pipeline stage); returns
    the layer specs of what this rank now runs."""
    from vllm_mlx.distributed.group import TensorParallelError, check_same_mode
    from vllm_mlx.distributed.pipeline import pipeline_model
    from vllm_mlx.distributed.sharding import shard_model
    from vllm_mlx.executor.attention import layer_specs

    mode = "pipeline" if config.pipeline_parallel else "tensor"
    if loaded.vision is not None:
        raise TensorParallelError(f"{mode} parallelism does not support vision-language models yet")
    check_same_mode(group, mode)
    if mode == "tensor":
        shard_model(loaded.model, loaded.config, loaded.path, group)
        return specs
    pipeline_model(loaded.model, loaded.config, specs, loaded.path, group)
    return layer_specs(loaded.model, loaded.config.get("model_type"))


@dataclass
class _Siblings:
    """The ``n > 1`` completions held back until their leader has prefilled the shared prompt
    (so they hit its blocks instead of computing the prompt again)."""

    leader: Request
    waiting: list[Request]

    @property
    def ready(self) -> bool:
        return self.leader.num_output_tokens > 0 or self.leader.is_finished


class EngineCore:
    """The synchronous engine: owns the model, the scheduler, the KV cache and the runner.

    Single-threaded: create it, and call every method, on the thread that owns the model.

    Args:
        config: The engine's settings; None for the defaults (the built-in default model).
        **overrides: ``EngineConfig`` fields that replace ``config``'s (``config`` is updated).

    Raises:
        ModelSourceError: The model cannot be found, downloaded, converted or loaded.
        ModelMemoryError: The weights in ``weight_format`` plus the KV pool cannot fit the
            memory the engine may use (``memory_limit``); raised before loading, with figures.
        ModelOwnershipError: Another live engine owns the model and
            ``force_model_takeover`` is False.
        UnsupportedModelError: The architecture needs caches we do not support (chunked
            attention, recurrent layers of an unchecked architecture).
        TypeError: An unknown option in ``overrides``.
        ValueError: A bad option value (e.g. a KV budget that holds no block).
        TensorParallelError: With ``tensor_parallel``: not launched as rank 0 of several, or a
            model that cannot be split over the ranks (a ``ValueError``; ``distributed/sharding.py``).
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        from vllm_mlx.executor.model_runner import MLXModelRunner

        config = config or EngineConfig()
        apply_options(config, overrides)
        config.normalize()
        self.config = config
        self.tp_group = _rank_zero_group() if config.tensor_parallel or config.pipeline_parallel else None
        self.on_rank_lost: Callable[[RankLostError], None] | None = None
        """With tensor parallelism: called from the watchdog's thread when a rank hangs (the
        thread in the collective stays blocked). None: log it and exit the process, since the
        blocked caller can never return (``AsyncEngineCore`` sets it to fail its requests)."""
        self.watchdog = None
        self.liveness: LivenessMonitor | None = None
        """With tensor parallelism: finds a rank whose process ended at once (``distributed/liveness.py``)."""
        self._rank_failure_lock = threading.Lock()
        self.rank_failure: RankLostError | None = None
        """Why the ranks are out of reach (set once; no collective is issued after it)."""
        with startup_deadline(self.tp_group, config.distributed_startup_timeout_s, STARTUP):
            prepared = prepare_engine_model(config, self.tp_group)
        loaded, state_layout = prepared.loaded, prepared.state_layout
        self.vision = loaded.vision
        self.weight_format = prepared.weight_format
        self.weight_plan = prepared.plan  # why weight_format: every format's need, the memory they were held to
        self.model_path: Path = loaded.path
        get_registry().claim(str(self.model_path), self, force=config.force_model_takeover)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.kv_layout = prepared.kv_layout
        _settle_held_caches(config, prepared)
        draft = self._load_draft(loaded)
        # Sized for every rank: every rank allocates these counts for its own layers. A draft
        # model's weights come out of the memory left, and its pool has as many blocks.
        memory = prepared.memory
        budget = kv_budget_bytes(config.kv_cache_memory, memory.available_bytes - (draft.weight_bytes if draft else 0))
        states = StateBudget.plan(config, budget, memory.state_bytes_per_request)
        block_groups = prepared.block_groups
        num_blocks = config.num_kv_blocks or blocks_for_bytes(
            states.kv_bytes_left, config.block_size, memory.kv_bytes_per_token + (draft.kv_bytes_per_token if draft else 0)
        )
        self.kv_cache = PagedCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, states.num_running_slots,
            states.num_checkpoints, block_groups.windows,
        )  # fmt: skip
        text_config = loaded.config.get("text_config", loaded.config)
        context_len = text_config.get("max_position_embeddings") or loaded.config.get("max_position_embeddings")
        self.scheduler = Scheduler(
            config.scheduler_config(num_blocks, context_len), self.kv_cache, cache_namespace=str(self.model_path)
        )
        self.mllm_cache = (
            MLLMCacheManager(config.mllm_cache_memory) if self.vision and config.enable_mllm_cache else None
        )
        self.step_encoder = None
        if self.tp_group is not None:
            from vllm_mlx.distributed.protocol import StepEncoder, StepMessage, send_message

            self.liveness = LivenessMonitor.start(self.tp_group.size(), self._rank_hung)
            sizing = {"num_blocks": num_blocks, "block_size": config.block_size, "num_state_slots": states.num_slots,
                      "liveness": self.liveness.address.to_dict() if self.liveness is not None else None}  # fmt: skip
            with startup_deadline(self.tp_group, config.distributed_startup_timeout_s, "the start message"):
                send_message(self.tp_group, StepMessage("start", start=sizing))
            self.step_encoder = StepEncoder()
            self.watchdog = CollectiveWatchdog(config.distributed_timeout_s, self._rank_hung, self.tp_group.size())
        self.lora = self._lora_slots(loaded)
        """With ``enable_lora``: the adapters and their slots (``engine/lora_slots.py``); else None."""
        self.runner = MLXModelRunner(
            loaded.model, num_blocks, config.block_size, self.mllm_cache, states.num_slots, state_layout,
            block_groups=block_groups,
        )  # fmt: skip
        if self.lora is not None:
            self.runner.lora = self.lora.slots
            self.scheduler.admission_check = self.lora.admit
        self.input_processor = InputProcessor(config, self.tokenizer, self.model_config, self.vision)
        self.eos_token_ids = self.input_processor.eos_token_ids
        self.grammars = self.input_processor.grammars
        self.think_tokens = self.input_processor.think_tokens
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_request)
        self.snapshotter = CacheSnapshotter(
            self.scheduler,
            self.tokenizer,
            self._mllm_snapshot,
            self.kv_layout.views(num_blocks, max(states.num_running_slots - 1, 0), states.num_checkpoints),
        )
        self.speculator = (
            Speculator(config.speculative_config, self._drafter(draft, loaded, num_blocks))
            if config.speculative_config is not None
            else None
        )
        """Speculative decoding's proposals and acceptance estimates (None: off)."""
        self.disk = self._disk_offload()
        """The KV disk tier's traffic with the pool (``kv_disk_path``; None: no tier)."""
        self.step_records: deque[StepRecord] = deque(maxlen=4096)
        """The last steps run (plain data; the notebook timeline reads them)."""
        self._deferred: dict[str, _Siblings] = {}  # by the caller's request id
        self._ids = itertools.count()

    def _load_draft(self, loaded: LoadedModel) -> LoadedDraft | None:
        """The draft model of ``speculative_config`` (method ``draft_model``), else None."""
        spec = self.config.speculative_config
        if spec is None or spec.model is None:
            return None
        from vllm_mlx.engine.draft_model import load_draft

        fmt = self.weight_plan.weight_format if self.weight_plan is not None else self.config.weight_format
        return load_draft(spec.model, loaded, fmt, self.config.trust_remote_code)

    def _drafter(self, draft: LoadedDraft | None, loaded: LoadedModel, num_blocks: int) -> DraftModel | None:
        if draft is None:
            return None
        from vllm_mlx.engine.draft_model import DraftModel, parameter_bytes

        target_bytes = parameter_bytes(loaded.vision.model if loaded.vision else loaded.model)
        ratio = draft.weight_bytes / max(target_bytes, 1)
        return DraftModel(draft, num_blocks, self.config.block_size, ratio, self.config.enable_prefix_caching)

    def _lora_slots(self, loaded: LoadedModel) -> LoRASlotTable | None:
        """Wrap the model's layers for adapters (before the runner's kernels look at them)."""
        if not self.config.enable_lora:
            return None
        if loaded.vision is not None:
            raise ValueError("enable_lora: vision-language models do not take adapters yet")
        from vllm_mlx.engine.lora_slots import LoRASlotTable

        config = self.config
        return LoRASlotTable(loaded.model, config.max_loras, config.max_lora_rank, base_model=self.model_path.name)

    def _disk_offload(self) -> DiskOffload | None:
        """The disk tier of ``kv_disk_path``, where this engine can use one (else a warning)."""
        config = self.config
        if config.kv_disk_path is None:
            return None
        why = None
        if not config.enable_prefix_caching:
            why = "it needs the prefix cache (enable_prefix_caching)"
        elif self.tp_group is not None:
            why = "it does not work with tensor or pipeline parallelism yet"
        elif not self.kv_cache.resumes_prefixes:
            why = "this model has recurrent layers and keeps no state checkpoints (max_state_checkpoints 0)"
        if why is not None:
            logger.warning("the KV disk tier is off: %s", why)
            return None
        from vllm_mlx.engine.disk_offload import DiskOffload
        from vllm_mlx.engine.kv_disk import DiskIdentity, DiskTier
        from vllm_mlx.models.digest import model_digest

        identity = DiskIdentity(model_digest(self.model_path), self.weight_format, config.block_size)
        tier = DiskTier(config.kv_disk_path, identity, config.kv_disk_budget, config.kv_disk_write_budget)
        runner = self.runner
        return DiskOffload(tier, self.scheduler.kv.prefix_cache, self.kv_cache, runner.pool, config.max_num_seqs,
                           runner.state_pool, self.kv_layout.bytes_per_token)  # fmt: skip

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | PreparedPrompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        images: Sequence[ImageSource] | None = None,
        fairness_key: str | None = None,
        constraint: CompiledGrammar | None = None,
        speculative: bool | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns the request id. Outputs come from ``step()``.

        A prompt the engine cannot serve (longer than the context or the KV cache, or with an
        image that cannot be read) finishes at once with ``finish_reason == "error"``; other
        requests are untouched.

        Args:
            prompt: Text (tokenized with the model's tokenizer), token ids, or a
                ``prepare_prompt`` result.
            sampling_params: How to sample; None for the defaults. With ``n > 1`` the
                completions share the prompt's KV blocks.
            request_id: A unique id; None draws ``"req-<number>"``.
            cache_salt: Folded into the prefix-cache block hashes: requests with different
                salts never share cached blocks.
            images: Images for a vision-language model, in prompt order (see
                ``prepare_prompt``).
            fairness_key: Requests with the same key share one turn of admission (the
                scheduler serves keys round-robin); None = this request's own id. The server
                gives all prompts of one HTTP request one key.
            constraint: ``compile_constraint(sampling_params)``, compiled beforehand on another
                thread; None compiles ``sampling_params.structured_outputs`` (if any) here.
            speculative: Whether this request speculates: None as the engine's
                ``speculative_config`` says; True even without one (n-gram lookup with its
                defaults); False never.
            lora_request: The LoRA adapter it runs with (``enable_lora``); None: the base
                model. Its files are read the first time an id is named.

        Returns:
            The request id, which later ``RequestOutput``s carry.

        Raises:
            ValueError: ``request_id`` is already in use, a token id (prompt or
                ``stop_token_ids``) is outside the vocabulary, a string is not valid Unicode,
                images were given to a text-only model, or the prompt's image placeholders do
                not match the images; ``ConstraintError`` (a ``ValueError``): an invalid
                structured-output schema, regex or grammar.
        """
        if self.runner.model is None:
            raise VllmMlxError("the engine is shut down")
        params = sampling_params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_id, lora_digest = 0, None
        if lora_request is not None:
            lora_digest, lora_id = self.register_lora(lora_request), lora_request.lora_int_id
        processed = self.input_processor.process(
            prompt, params, request_id, cache_salt=cache_salt, images=images, fairness_key=fairness_key,
            constraint=constraint, speculative=speculative, lora_id=lora_id, lora_digest=lora_digest,
        )  # fmt: skip
        if speculative and self.runner.held is not None:
            raise ValueError(f"speculative decoding: {HELD_NO_SPECULATION}")
        if speculative and self.speculator is None:  # asked for without a config: prompt lookup
            self.speculator = Speculator(SpeculativeConfig(), by_default=False)
        self.output_processor.add(processed)
        self._admit(request_id, processed.requests)
        self.output_processor.finish_if_done(request_id)  # refused at admission (e.g. prompt too long)
        return request_id

    def register_lora(self, lora_request: LoRARequest, files: AdapterFiles | None = None) -> str:
        """Know the adapter of ``lora_request`` now (``add_request`` does it on first use):
        parse ``files`` (``read_lora_files``, read on another thread), or read its folder here;
        returns its content digest.

        Raises:
            ValueError: The engine was started without ``enable_lora``, or the id already
                names another adapter; ``AdapterError`` (a ``ValueError``): the files do not fit.
        """
        if self.lora is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        return self.lora.register(lora_request, files)

    def read_lora_files(self, lora_request: LoRARequest, within: Path | None = None) -> AdapterFiles | None:
        """The adapter's files, read whole (no MLX: any thread, so a slow or stalled disk holds
        the caller, never a step); None when the engine already knows the adapter. ``within``:
        a folder the files must resolve inside.

        Raises:
            ValueError: The engine was started without ``enable_lora``; ``AdapterError``: the
                files are missing, not regular files, or larger than any adapter that fits.
        """
        if self.lora is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        if self.lora.knows(lora_request):
            return None
        from vllm_mlx.lora.adapter import read_adapter_files

        return read_adapter_files(lora_request.lora_path, self.lora.max_adapter_bytes, within)

    def unregister_lora(self, lora_int_id: int) -> None:
        """Forget adapter ``lora_int_id``: requests already given it finish with it, then its
        factors and slot are given back (no memory or file kept per load/unload cycle)."""
        if self.lora is not None:
            self.lora.forget(lora_int_id)
            self._collect_adapters()

    def _collect_adapters(self) -> None:
        if self.lora is None or not self.lora.retired:
            return
        requests = [*self.scheduler.requests.values(), *(r for s in self._deferred.values() for r in s.waiting)]
        self.lora.collect({r.lora_id for r in requests if r.lora_id})

    def compile_constraint(self, params: SamplingParams, max_bound: int | None = None) -> CompiledGrammar | None:
        """The compiled grammar of ``params.structured_outputs`` (None without one), from the
        cache when seen before. Thread-safe, no MLX work: call it from any thread.
        ``max_bound``: the largest repetition bound (``maxItems``, ``{n,m}``...) allowed; None =
        ``structured.bounds.DEFAULT_MAX_CONSTRAINT_BOUND``.

        Raises:
            ConstraintError: An invalid schema, regex or grammar (a ``ValueError``).
        """
        return self.input_processor.compile_constraint(params, max_bound)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (from its config), or None when it does not say."""
        return self.input_processor.vocab_size

    def prepare_prompt(
        self,
        prompt: str | list[int],
        images: Sequence[ImageSource] | None = None,
        *,
        media_policy: MediaPolicy | None = None,
    ) -> PreparedPrompt:
        """Tokenize ``prompt`` and load and preprocess its images (no MLX work: any thread).

        With images, each needs one image placeholder in the prompt (the chat template writes
        them; ``LLM.chat`` does this). A text prompt without any placeholder gets one per image
        in front. Images are loaded under ``media_policy`` (default: the config's). A bad image
        does not raise: the result carries the error, and the request made from it finishes at
        once with that message.

        Raises:
            ValueError: A token id outside the vocabulary; images for a text-only model; more
                images than the policy's ``max_images_per_prompt`` or than the model takes
                (checked before any is loaded); a placeholder count that differs from the number
                of images.
        """
        return self.input_processor.prepare_prompt(prompt, images, media_policy=media_policy)

    def check_images(self, images: Sequence[ImageSource]) -> None:
        """Raise ``ValueError`` if there are images and the model is text-only, or more of them than
        the model takes a prompt (before a chat template, which may not accept image parts at all,
        sees them)."""
        self.input_processor.check_images(images)

    def _admit(self, group_id: str, requests: list[Request]) -> None:
        """Queue a caller's requests. With prefix caching, siblings of an ``n > 1`` request
        wait until the first one has prefilled the prompt, so they share its blocks."""
        leader, *siblings = requests
        self.scheduler.add_request(leader)
        if siblings and self.config.enable_prefix_caching and not leader.is_finished:
            self._deferred[group_id] = _Siblings(leader, siblings)
            return
        for request in siblings:
            self.scheduler.add_request(request)

    def _release_deferred(self) -> None:
        for group_id, siblings in list(self._deferred.items()):
            if siblings.ready:
                del self._deferred[group_id]
                for request in siblings.waiting:
                    self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its completions); unknown or finished ids are a no-op."""
        requests = self.output_processor.requests(request_id)
        if requests is None:
            return
        self._deferred.pop(request_id, None)
        for request in requests:
            self.scheduler.abort_request(request.request_id)
            request.finish(RequestStatus.FINISHED_ABORTED)  # covers deferred siblings
        self.output_processor.finish_if_done(request_id)
        self.runner.keep_held(r.request_id for r in self.scheduler.running)
        if self.speculator is not None:
            self.speculator.settle(self.scheduler.running)

    @property
    def supports_images(self) -> bool:
        """True for a vision-language model (requests may carry images)."""
        return self.vision is not None

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may reach: the model's context, the
        ``max_model_len`` option and the KV pool's capacity, whichever is smallest."""
        return self.scheduler.max_model_len

    def has_unfinished_requests(self) -> bool:
        """True while any request is queued, running, or has an output not yet returned."""
        return bool(self.output_processor.has_pending or self._deferred) or self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward pass, update; return the outputs that changed.

        Returns:
            One ``RequestOutput`` per request that advanced (or was refused or aborted) since
            the last step; a finished request's last output has ``finished=True``.
        """
        start = time.perf_counter()
        outputs = self.output_processor.take_pending()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        if self.disk is not None:
            self.disk.before_schedule(self.scheduler.waiting, len(self.scheduler.running))
        if self.lora is not None:
            self.lora.begin_step(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.failed:  # ended at admission: reported now, alone
            outputs += self.output_processor.process(scheduler_output.failed, ModelRunnerOutput())
            self._collect_adapters()
        if scheduler_output.is_empty:
            return outputs
        with self._waiting_on_ranks(f"step {scheduler_output.step_id}"):
            runner_output = self._execute(scheduler_output)
        if self.speculator is not None:
            self.speculator.observe(runner_output)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.speculator is not None:
            self.speculator.settle(self.scheduler.running)
        if self.disk is not None:
            self.disk.after_update(scheduler_output.scheduled)
        outputs += self.output_processor.process(advanced, runner_output)
        # After the outputs: a stop string ends its request there. Preempted ones go too.
        self.runner.keep_held(r.request_id for r in self.scheduler.running)
        self._release_deferred()
        self._collect_adapters()
        self._record_step(scheduler_output, runner_output, time.perf_counter() - start)
        return outputs

    @contextmanager
    def _waiting_on_ranks(self, what: str) -> Iterator[None]:
        """Watch a block of work that holds collectives (tensor parallelism only). When the
        watchdog fired during it, the block's late return must not be taken as a success; once
        the ranks are lost, no block runs (its collectives could block forever)."""
        if self.watchdog is None:
            yield
            return
        if self.rank_failure is not None:
            raise self.rank_failure
        try:
            with self.watchdog.watch(what):
                yield
            if self.watchdog.fired is not None:
                raise self.watchdog.fired
        except RankLostError as exc:
            self.rank_failure = exc
            raise

    def _rank_hung(self, error: RankLostError) -> None:
        """The watchdog's or the liveness monitor's verdict (their threads; the first one counts):
        hand it on, or end a process that would hang."""
        with self._rank_failure_lock:
            if self.rank_failure is not None:  # already known (the other thread, or the step raised)
                return
            self.rank_failure = error
        if self.on_rank_lost is not None:
            self.on_rank_lost(error)
            return
        exit_hung_process(error)

    def heartbeat(self) -> None:
        """With tensor parallelism, while idle: one small message through every rank, so a dead
        or hung rank is found (and ``/health`` says so) before a request is sent to it."""
        if self.tp_group is None or self.rank_failure is not None:
            return
        from vllm_mlx.distributed.protocol import StepMessage, send_message

        with self._waiting_on_ranks("the idle heartbeat"):
            send_message(self.tp_group, StepMessage("ping"))

    def _record_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, wall_time: float) -> None:
        ran = self.runner.last_step  # stale when the step failed before the runner recorded it
        calls = ran.num_forward_calls if ran is not None and ran.step_id == scheduler_output.step_id else 0
        self.step_records.append(StepRecord.of(scheduler_output, calls, wall_time, runner_output.drafts))

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step. When it fails, each request is run again alone: one that fails alone
        ends with an error, the others keep their tokens, and the batch goes on, so no request
        can end the engine. If every request failed, a probe (one token through the model)
        decides: when it fails too the engine is broken, and the exception escapes (as does
        ``MemoryError``).

        Re-running is safe: a row writes only its own (unshared) slots, and sampling depends on
        the request's seed and step alone, never on the batch.
        """
        scheduled = scheduler_output.scheduled
        try:
            return self._run(scheduler_output)
        except (MemoryError, RankLostError):
            raise
        except Exception as exc:
            logger.error("step %d failed", scheduler_output.step_id, exc_info=True)
            if len(scheduled) == 1:
                output = ModelRunnerOutput(errors={scheduled[0].request_id: internal_error_message(exc)})
            else:
                output = self._execute_one_by_one(scheduler_output)
        if len(output.errors) == len(scheduled):
            self._probe()  # raises when the model itself cannot run
        return output

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The runner on this step; with tensor parallelism the other ranks are sent it first."""
        if self.step_encoder is None:
            return self.runner.execute_model(scheduler_output)
        from vllm_mlx.distributed.protocol import send_message

        send_message(self.tp_group, self.step_encoder.encode(scheduler_output))
        try:
            return self.runner.execute_model(scheduler_output)
        except RuntimeError as exc:
            if is_collective_failure(exc):  # not the step's fault: no retry (it could block)
                raise RankLostError(
                    f"a tensor-parallel rank is gone: step {scheduler_output.step_id}'s forward failed ({exc})"
                ) from exc
            raise

    def _probe(self) -> None:
        """``runner.probe()``; with tensor parallelism every rank probes (it is a forward)."""
        if self.tp_group is not None:
            from vllm_mlx.distributed.protocol import StepMessage, send_message

            send_message(self.tp_group, StepMessage("probe"))
        self.runner.probe()

    def _execute_one_by_one(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Each request of the step alone; the ones that fail are recorded in ``errors``."""
        merged = ModelRunnerOutput()
        for item in scheduler_output.scheduled:
            try:
                output = self._run(SchedulerOutput(scheduler_output.step_id, [item]))
            except (MemoryError, RankLostError):
                raise
            except Exception as exc:
                logger.error("request %s failed alone", item.request_id, exc_info=True)
                merged.errors[item.request_id] = internal_error_message(exc)
                continue
            merged.merge(output)
        return merged

    # -- observers and lifetime -------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The scheduler's, the KV pool's and the compiled grammars' counters, and the
        multimodal cache's for a vision-language model (``engine/observation.py``)."""
        mllm = self._mllm_stats() if self.vision is not None else None
        scheduler = self.scheduler.stats_view()  # the pool's counts come with it: counted once
        kv_disk = self.disk.tier.stats() if self.disk is not None else None
        return EngineStats(scheduler, scheduler.kv_cache, self.input_processor.grammars.stats_view(), mllm, kv_disk)

    def get_stats(self) -> dict:
        """Plain data (``stats().to_dict()``): ``{"scheduler": {running, waiting, preemptions,
        steps, ...}, "kv_cache": {...}, "structured_outputs": {cached, hits, misses}}``
        (compiled grammars), and ``"mllm"`` (the multimodal cache's stats) for a
        vision-language model."""
        return self.stats().to_dict()

    def snapshot(self, include_blocks: bool = True) -> CacheSnapshot:
        """The cache as observers see it (``core/snapshot.py``); without ``include_blocks``
        only requests and stats (``blocks`` and ``free_queue`` empty)."""
        return self.snapshotter.snapshot(include_blocks)

    def cache_snapshot(self, include_blocks: bool = True) -> dict:
        """Plain data (``snapshot().to_dict()``): ``blocks``, ``requests``, ``free_queue``,
        ``stats``, ``mllm`` (the multimodal cache's ``entries`` and ``stats``) and ``kv_groups``
        (the layer groups' kind, window, layers, bytes per token, dtype and blocks; see
        snapshot.py)."""
        return self.snapshot(include_blocks).to_dict()

    def recent_step_records(self, after: int = 0, limit: int | None = None) -> list[StepRecord]:
        """The newest ``limit`` (None: all) kept ``StepRecord``s with ``step_id > after``, oldest first."""
        return recent_step_records(self.step_records, after, limit)

    def _mllm_snapshot(self) -> MLLMSnapshot:
        """The MLLM cache's entries (none for a text model, or with the cache off) and stats."""
        entries = self.mllm_cache.entries() if self.mllm_cache is not None else []
        return MLLMSnapshot(entries, self._mllm_stats())

    def _mllm_stats(self) -> MLLMStats:
        """The MLLM cache's counters, whether it is on, and the vision-encoder runs so far."""
        stats = self.mllm_cache.stats() if self.mllm_cache is not None else MLLMCacheStats()
        runs = self.runner.vision_encoder_runs
        return MLLMStats(**asdict(stats), enabled=self.mllm_cache is not None, encoder_runs=runs)

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of unreferenced blocks (blocks in use keep theirs)."""
        return self.scheduler.kv.reset_prefix_cache()

    def save_prefix(self, prompt: str | list[int], path: str | Path, *, cache_salt: str | None = None) -> int:
        """Save the cached KV blocks of ``prompt`` (text or token ids; its longest cached run of
        full blocks) to a prefix file at ``path``, atomically; return the tokens saved. Generate
        from the prompt first so that its blocks are cached (``prefix_file.py`` has the format).

        Raises:
            ValueError: none of the prompt's blocks are cached; the prompt has images; prefix
                caching is off; the engine runs several ranks; the model has recurrent layers
                and keeps no state checkpoints.
        """
        return self._prefix_transfer.save(prompt, path, cache_salt)

    def load_prefix(self, path: str | Path, *, cache_salt: str | None = None, data: bytes | None = None) -> int:
        """Load a prefix file saved by ``save_prefix`` (this process or another, same model and
        weight format) into the prefix cache, under ``cache_salt``; return the prompt tokens
        cached now. A request whose prompt starts with those tokens then skips their prefill.

        Raises:
            PrefixFileError: (a ``ValueError``) the file is unreadable, damaged, or from another
                model, weight format or block size; nothing of it is loaded.
            ValueError: as for ``save_prefix``.

        ``data``: the file's bytes as ``read_prefix_bytes`` read them on another thread (so that
        a slow disk holds that caller, not a step); None reads ``path`` here.
        """
        return self._prefix_transfer.load(path, cache_salt, data)

    def read_prefix_bytes(self, path: str | Path) -> bytes:
        """The prefix file at ``path``, read whole if it is a regular file no larger than this
        engine could use (no MLX: any thread). Raises ``PrefixFileError``."""
        from vllm_mlx.engine.prefix_file import read_prefix_bytes

        return read_prefix_bytes(path, self._prefix_transfer.max_file_bytes)

    @cached_property
    def _prefix_transfer(self) -> PrefixTransfer:
        return PrefixTransfer(self)

    def shutdown(self) -> None:
        """Release the model for other engines; outstanding requests are aborted."""
        for request_id in self.output_processor.group_ids:
            self.abort_request(request_id)
        get_registry().release(str(self.model_path), self)
        self.input_processor.grammars.close()  # the constraint compile workers (compile_guard.py)
        try:
            self._stop_workers()
        finally:
            self.runner.release()
            if self.speculator is not None and self.speculator.drafter is not None:
                self.speculator.drafter.release()
            if self.disk is not None:
                self.disk.close()  # what is queued is written first

    def _stop_workers(self) -> None:
        """With tensor parallelism: send "stop" (the workers return), unless the ranks are
        already lost; a rank lost now is logged (the engine is ending anyway)."""
        if self.liveness is not None:
            self.liveness.close()  # the workers' exits are expected from here on
        if self.watchdog is None or self.runner.model is None:
            return
        if self.rank_failure is None:
            from vllm_mlx.distributed.protocol import StepMessage, send_message

            try:
                with self._waiting_on_ranks("the stop message"):
                    send_message(self.tp_group, StepMessage("stop"))
            except RankLostError as exc:
                logger.warning("could not stop the other ranks: %s", exc)
        self.watchdog.close()

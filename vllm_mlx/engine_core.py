"""EngineCore: schedule -> execute -> update, on the thread that owns the model.

``EngineCore`` is synchronous and single-threaded: whoever calls ``step()`` must be the thread
that created it (MLX streams are thread-local). ``AsyncEngineCore`` (``async_engine.py``) runs
one on a dedicated thread and serves callers from any thread or asyncio loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_mlx.detokenizer import IncrementalDetokenizer
from vllm_mlx.errors import ImageInputError, VllmMlxError, internal_error_message
from vllm_mlx.images import ImageSource
from vllm_mlx.media_policy import MediaPolicy
from vllm_mlx.mllm_cache import MLLMCacheManager, MLLMCacheStats
from vllm_mlx.model_registry import get_registry
from vllm_mlx.multimodal import MultiModalInput
from vllm_mlx.paged_cache import PagedCacheManager
from vllm_mlx.request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams
from vllm_mlx.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput, TokenLogprobs
from vllm_mlx.snapshot import CacheSnapshotter
from vllm_mlx.structured.grammar import CompiledGrammar, GrammarCompiler
from vllm_mlx.structured.matcher import RequestConstraint
from vllm_mlx.structured.reasoning_gate import ReasoningGate, ThinkTokens
from vllm_mlx.validation import check_encodable, parse_bytes, parse_memory

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
DEFAULT_MLLM_CACHE_MEMORY = 512 << 20  # 512 MiB


@dataclass
class PreparedPrompt:
    """A prompt ready for the scheduler: token ids (image placeholders expanded) and images.

    ``error`` is set when the prompt's images cannot be used: the request then finishes at once
    with that message, alone.
    """

    text: str | None
    token_ids: list[int]
    mm_input: MultiModalInput | None = None
    error: str | None = None


@dataclass
class EngineConfig:
    """Everything needed to build an engine; CLI flags and ``LLM(**options)`` map onto it."""

    model: str = "default"
    """Model source: MLX directory, .gguf file, hub id, or 'default'."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    """KV blocks in the pool; None = as many as ``kv_cache_memory`` holds."""
    kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY
    """KV pool size when ``num_kv_blocks`` is None: bytes (an int), or a fraction in (0, 1] of
    the memory available when the engine starts (a float)."""
    max_model_len: int | None = None
    """Longest prompt + output; None = the model's context length."""
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_state_checkpoints: int | None = None
    """Models with recurrent layers: how many recurrent states at block boundaries to keep for
    prefix hits (their bytes come out of the KV budget); None = ``2 * max_num_seqs``, at most
    half of the budget left after the running requests' states; 0 = no prefix hits."""
    seed: int | None = None
    """Seed for the per-request seeds drawn when a request brings none (None = random)."""
    weight_format: str = "auto"
    """"auto", "quantized" or "float32". Auto keeps quantized weights on Metal/CUDA and
    dequantizes to float32 on the CPU backend, where they run faster (cpu_backend.py)."""
    force_model_takeover: bool = False
    """Take the model over from another live engine instead of raising ModelOwnershipError."""
    enable_mllm_cache: bool = True
    """Vision-language models: keep vision-encoder outputs by image content hash, so the same
    image in a later request skips the encoder."""
    mllm_cache_memory: int = DEFAULT_MLLM_CACHE_MEMORY
    """Bytes of vision-encoder outputs the MLLM cache may hold (least recently used go first)."""
    trust_remote_code: bool = False
    """Load a model directory that names Python code to run (``model_file``, ``auto_map``);
    otherwise it is refused, and hub downloads skip ``*.py`` files."""
    media_policy: MediaPolicy | None = None
    """Which image paths and URLs prompts may use; None = ``MediaPolicy.operator()`` (any local
    file, public http(s) URLs). The server passes its own (``MediaPolicy.server()``)."""

    def normalize(self) -> None:
        """Accept every option in the forms the CLI takes (``kv_cache_memory="512M"`` or
        ``"0.3"``, ``mllm_cache_memory="256M"``) and check types and ranges, so that
        ``LLM(...)``, notebooks and the CLI agree. Raises ``ValueError`` naming the option."""
        for name, parse in (("kv_cache_memory", parse_memory), ("mllm_cache_memory", parse_bytes)):
            try:
                setattr(self, name, parse(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            _check_int_option(name, getattr(self, name), minimum=1)
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_int_option(name, getattr(self, name), minimum=1)
        if self.max_state_checkpoints is not None:
            _check_int_option("max_state_checkpoints", self.max_state_checkpoints, minimum=0)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "force_model_takeover", "enable_mllm_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def scheduler_config(self, num_blocks: int, context_len: int | None) -> SchedulerConfig:
        """The scheduler's limits for a pool of ``num_blocks`` and a model context of ``context_len``."""
        limits = [n for n in (self.max_model_len, context_len) if n]
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=min(limits) if limits else None,
        )


def _check_int_option(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass
class _Completion:
    """Engine-side state of one sequence (one of a request's ``n`` completions)."""

    group_id: str
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    num_detokenized: int = 0
    num_sent_tokens: int = 0
    num_sent_chars: int = 0

    def completion_output(self) -> CompletionOutput:
        r = self.request
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(r.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
        )


@dataclass
class _Group:
    """A caller's request: ``n`` completions that share one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.completions)


class EngineCore:
    """The synchronous engine: owns the model, the scheduler, the KV cache and the runner.

    Single-threaded: create it, and call every method, on the thread that owns the model.

    Args:
        config: The engine's settings; None for the defaults (the built-in default model).
        **overrides: ``EngineConfig`` fields that replace ``config``'s (``config`` is updated).

    Raises:
        ModelSourceError: The model cannot be found, downloaded, converted or loaded.
        ModelOwnershipError: Another live engine owns the model and
            ``force_model_takeover`` is False.
        UnsupportedModelError: The architecture needs caches we do not support (chunked
            attention, recurrent layers of an unchecked architecture).
        TypeError: An unknown option in ``overrides``.
        ValueError: A bad option value (e.g. a KV budget that holds no block).
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        from vllm_mlx.attention import check_supported
        from vllm_mlx.cpu_backend import choose_weight_format, prepare_model_weights
        from vllm_mlx.kv_spec import is_recurrent
        from vllm_mlx.model_runner import MLXModelRunner, measure_kv_layout
        from vllm_mlx.models import load_model
        from vllm_mlx.state_pool import probe_state_layout

        config = config or EngineConfig()
        for name, value in overrides.items():
            if not hasattr(config, name):
                raise TypeError(f"unknown engine option {name!r}")
            setattr(config, name, value)
        config.normalize()
        self.config = config
        loaded = load_model(config.model, trust_remote_code=config.trust_remote_code)
        specs = check_supported(loaded.model, loaded.config.get("model_type", "?"))
        self.vision = loaded.vision
        weights = loaded.vision.model if loaded.vision else loaded.model
        self.weight_format = prepare_model_weights(weights, choose_weight_format(config.weight_format))
        state_layout = probe_state_layout(loaded.model, specs) if any(map(is_recurrent, specs)) else None
        self.model_path: Path = loaded.path
        get_registry().claim(str(self.model_path), self, force=config.force_model_takeover)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        # After the weights are in their final format: the KV dtype follows the activations'.
        self.kv_layout = measure_kv_layout(loaded.model, state_layout)
        budget = kv_budget_bytes(config.kv_cache_memory)
        states = StateBudget.plan(config, budget, state_layout.bytes_per_request if state_layout else 0)
        block_groups = self.kv_layout.block_groups(specs)
        num_blocks = config.num_kv_blocks or self.kv_layout.blocks_for_budget(
            states.kv_bytes_left, config.block_size, block_groups
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
        self.runner = MLXModelRunner(
            loaded.model, num_blocks, config.block_size, self.mllm_cache, states.num_slots, state_layout,
            block_groups=block_groups,
        )  # fmt: skip
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids)
        self.think_tokens = ThinkTokens.of(self.tokenizer)
        self.snapshotter = CacheSnapshotter(
            self.kv_cache,
            self.scheduler,
            self.tokenizer,
            self._mllm_snapshot,
            self.kv_layout.to_dicts(num_blocks, max(states.num_running_slots - 1, 0), states.num_checkpoints),
        )
        self.step_records: deque = deque(maxlen=4096)
        self._groups: dict[str, _Group] = {}
        self._completion_of: dict[str, _Completion] = {}
        self._pending: list[RequestOutput] = []
        self._deferred: dict[str, list[Request]] = {}  # n > 1 siblings waiting for the prompt
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)

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
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check_request(params, request_id, cache_salt, fairness_key)
        grammar = constraint or self.compile_constraint(params)
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare_prompt(prompt, images)
        text, token_ids = prepared.text, prepared.token_ids
        gate = self._reasoning_gate(token_ids, params, grammar)
        group = _Group(request_id, text, token_ids)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child_params = params.clone(n=1, seed=base_seed + index)
            request = Request(
                child_id, token_ids, child_params, prompt=text,
                eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, mm_input=prepared.mm_input,
                fairness_key=fairness_key or request_id,
                constraint=RequestConstraint(grammar, self.eos_token_ids) if grammar else None,
                reasoning_gate=gate,
            )  # fmt: skip
            if prepared.error is not None:
                request.error(prepared.error)
            completion = _Completion(
                request_id, request, index,
                IncrementalDetokenizer(self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )  # fmt: skip
            group.completions.append(completion)
            self._completion_of[child_id] = completion
        self._groups[request_id] = group
        self._admit(group)
        if group.finished:  # refused at admission (e.g. prompt too long)
            self._pending.append(self._finish_group(group))
        return request_id

    def _check_request(
        self, params: SamplingParams, request_id: str, cache_salt: str | None, fairness_key: str | None
    ) -> None:
        """What ``SamplingParams`` cannot check alone: token ids against this model's vocabulary;
        strings that must encode as UTF-8 (they are hashed into block keys)."""
        vocab = self.vocab_size
        if vocab and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        check_encodable("request_id", request_id)
        if cache_salt is not None:
            if not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
            check_encodable("cache_salt", cache_salt)
        if fairness_key is not None:
            check_encodable("fairness_key", fairness_key)

    def _reasoning_gate(
        self, prompt_token_ids: list[int], params: SamplingParams, grammar: CompiledGrammar | None
    ) -> ReasoningGate | None:
        """The gate of a request on a thinking model that has a constraint or a thinking budget."""
        think = self.think_tokens
        if params.max_thinking_tokens is not None and think is None:
            raise ValueError(
                "max_thinking_tokens needs a thinking model: this tokenizer has no single-token <think> and </think>"
            )
        if think is None or (grammar is None and params.max_thinking_tokens is None):
            return None
        return ReasoningGate(think, think.prompt_opens(prompt_token_ids), params.max_thinking_tokens)

    def compile_constraint(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled grammar of ``params.structured_outputs`` (None without one), from the
        cache when seen before. Thread-safe, no MLX work: call it from any thread.

        Raises:
            ConstraintError: An invalid schema, regex or grammar (a ``ValueError``).
        """
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (from its config), or None when it does not say."""
        config = self.model_config.get("text_config", self.model_config)
        return config.get("vocab_size") or self.model_config.get("vocab_size")

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
                images than the policy's ``max_images_per_prompt`` (checked before any is
                loaded); a placeholder count that differs from the number of images.
        """
        images = list(images or [])
        self.check_images(images)
        policy = media_policy or self.config.media_policy or MediaPolicy.operator()
        policy.check_image_count(len(images))
        text, token_ids = self._encode(prompt)
        if not images:
            return PreparedPrompt(text, token_ids)
        if isinstance(prompt, str) and self.vision.placeholder_token_id not in token_ids:
            text, token_ids = self._encode(self.vision.image_placeholder_text * len(images) + prompt)
        try:
            expanded, mm_input = self.vision.prepare(token_ids, images, policy)
        except ImageInputError as exc:
            return PreparedPrompt(text, token_ids, error=str(exc))
        return PreparedPrompt(text, expanded, mm_input)

    def check_images(self, images: Sequence[ImageSource]) -> None:
        """Raise ``ValueError`` if there are images and the model is text-only (before a chat
        template, which may not accept image parts at all, sees them)."""
        if images and not self.supports_images:
            raise ValueError("this model is text-only; image inputs need a vision-language model")

    def _admit(self, group: _Group) -> None:
        """Queue a group's completions. With prefix caching, siblings of an ``n > 1`` request
        wait until the first one has prefilled the prompt, so they share its blocks."""
        leader, *siblings = [c.request for c in group.completions]
        self.scheduler.add_request(leader)
        if siblings and self.config.enable_prefix_caching and not leader.is_finished:
            self._deferred[group.request_id] = siblings
            return
        for request in siblings:
            self.scheduler.add_request(request)

    def _release_deferred(self) -> None:
        for group_id, siblings in list(self._deferred.items()):
            leader = self._groups[group_id].completions[0].request
            if leader.num_output_tokens > 0 or leader.is_finished:
                del self._deferred[group_id]
                for request in siblings:
                    self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its completions); unknown or finished ids are a no-op."""
        group = self._groups.get(request_id)
        if group is None:
            return
        self._deferred.pop(request_id, None)
        for completion in group.completions:
            self.scheduler.abort_request(completion.request.request_id)
            completion.request.finish(RequestStatus.FINISHED_ABORTED)  # covers deferred siblings
        self._pending.append(self._finish_group(group))

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
        return bool(self._pending or self._deferred) or self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one batched forward pass, update; return the outputs that changed.

        Returns:
            One ``RequestOutput`` per request that advanced (or was refused or aborted) since
            the last step; a finished request's last output has ``finished=True``.
        """
        outputs, self._pending = self._pending, []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return outputs
        runner_output = self._execute(scheduler_output)
        self.step_records.append(self.runner.last_step)
        advanced = self.scheduler.update_from_output(scheduler_output, runner_output)
        touched: dict[str, _Group] = {}
        for request in advanced:
            completion = self._completion_of.get(request.request_id)
            if completion is None:
                continue
            try:
                self._absorb(completion, runner_output.logprobs.get(request.request_id))
            except Exception as exc:  # this completion's text processing failed: it ends alone
                self._fail_request(request, exc, "processing its output")
            touched[completion.group_id] = None
        for group_id in touched:
            group = self._groups.get(group_id)
            if group is not None:
                outputs.append(self._finish_group(group) if group.finished else self._group_output(group))
        self._release_deferred()
        return outputs

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
            return self.runner.execute_model(scheduler_output)
        except MemoryError:
            raise
        except Exception as exc:
            logger.error("step %d failed", scheduler_output.step_id, exc_info=True)
            if len(scheduled) == 1:
                output = ModelRunnerOutput(errors={scheduled[0].request_id: internal_error_message(exc)})
            else:
                output = self._execute_one_by_one(scheduler_output)
        if len(output.errors) == len(scheduled):
            self.runner.probe()  # raises when the model itself cannot run
        return output

    def _execute_one_by_one(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Each request of the step alone; the ones that fail are recorded in ``errors``."""
        merged = ModelRunnerOutput()
        for item in scheduler_output.scheduled:
            try:
                output = self.runner.execute_model(SchedulerOutput(scheduler_output.step_id, [item]))
            except MemoryError:
                raise
            except Exception as exc:
                logger.error("request %s failed alone", item.request_id, exc_info=True)
                merged.errors[item.request_id] = internal_error_message(exc)
                continue
            merged.sampled_token_ids.update(output.sampled_token_ids)
            merged.logprobs.update(output.logprobs)
            merged.errors.update(output.errors)
        return merged

    def _fail_request(self, request: Request, exc: Exception, doing: str) -> None:
        """End ``request`` with an error after an unexpected exception; log the traceback."""
        logger.error("request %s failed while %s", request.request_id, doing, exc_info=exc)
        if not request.is_finished:
            message = internal_error_message(exc)
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, message)

    def _absorb(self, completion: _Completion, logprobs: TokenLogprobs | None) -> None:
        """Detokenize the completion's new tokens, apply stop strings, record logprobs."""
        request = completion.request
        completion.detokenizer.add_tokens(request.output_token_ids[completion.num_detokenized :])
        completion.num_detokenized = request.num_output_tokens
        if completion.detokenizer.stop_string is not None and not request.is_finished:
            self.scheduler.finish_request(
                request.request_id, RequestStatus.FINISHED_STOPPED, completion.detokenizer.stop_string
            )
        if request.is_finished and completion.detokenizer.stop_string is None:
            completion.detokenizer.finish()
        if logprobs is not None and completion.logprobs is not None:
            completion.logprobs.append({logprobs.token_id: logprobs.logprob, **logprobs.top})
            completion.cumulative_logprob += logprobs.logprob

    def _group_output(self, group: _Group) -> RequestOutput:
        first = group.completions[0]
        outputs = [c.completion_output() for c in group.completions]
        new_ids = first.request.output_token_ids[first.num_sent_tokens :]
        new_text = first.detokenizer.text[first.num_sent_chars :]
        for c in group.completions:
            c.num_sent_tokens = c.request.num_output_tokens
            c.num_sent_chars = len(c.detokenizer.text)
        r = first.request
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=group.finished,
            new_token_ids=new_ids,
            new_text=new_text,
            num_cached_tokens=r.num_cached_tokens,
            arrival_time=r.arrival_time,
            first_token_time=r.first_token_time,
            finish_time=max((c.request.finish_time or 0.0) for c in group.completions) or None,
            error=next((c.request.error_message for c in group.completions if c.request.error_message), None),
        )

    def _finish_group(self, group: _Group) -> RequestOutput:
        """The final output of a group; forgets the group."""
        for completion in group.completions:
            if completion.detokenizer.stop_string is None:
                completion.detokenizer.finish()
            self._completion_of.pop(completion.request.request_id, None)
        self._groups.pop(group.request_id, None)
        return self._group_output(group)

    # -- helpers ----------------------------------------------------------------------------

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_encodable("prompt", prompt)
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        token_ids = [int(t) for t in prompt]
        vocab = self.vocab_size
        if vocab and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, token_ids

    def get_stats(self) -> dict:
        """Plain data: ``{"scheduler": {running, waiting, preemptions, steps, ...}, "kv_cache": {...},
        "structured_outputs": {cached, hits, misses}}`` (compiled grammars), and ``"mllm"`` (the
        multimodal cache's stats) for a vision-language model."""
        stats = {
            "scheduler": self.scheduler.stats(),
            "kv_cache": self.kv_cache.stats().to_dict(),
            "structured_outputs": self.grammars.stats(),
        }
        if self.vision is not None:
            stats["mllm"] = self._mllm_stats()
        return stats

    def cache_snapshot(self, include_blocks: bool = True) -> dict:
        """Plain data: ``blocks``, ``requests``, ``free_queue``, ``stats``, ``mllm`` (the
        multimodal cache's ``entries`` and ``stats``) and ``kv_groups`` (the layer groups'
        kind, window, layers, bytes per token, dtype and blocks; see snapshot.py)."""
        return self.snapshotter.snapshot(include_blocks)

    def _mllm_snapshot(self) -> dict:
        """The MLLM cache's entries (none for a text model, or with the cache off) and stats."""
        entries = self.mllm_cache.snapshot()["entries"] if self.mllm_cache is not None else []
        return {"entries": entries, "stats": self._mllm_stats()}

    def _mllm_stats(self) -> dict:
        """The MLLM cache's counters, whether it is on, and the vision-encoder runs so far."""
        stats = self.mllm_cache.stats() if self.mllm_cache is not None else MLLMCacheStats()
        return {**stats.to_dict(), "enabled": self.mllm_cache is not None, "encoder_runs": self.runner.vision_encoder_runs}

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of unreferenced blocks (blocks in use keep theirs)."""
        return self.scheduler.prefix_cache.reset()

    def shutdown(self) -> None:
        """Release the model for other engines; outstanding requests are aborted."""
        for request_id in list(self._groups):
            self.abort_request(request_id)
        get_registry().release(str(self.model_path), self)
        self.runner.release()


def available_memory() -> int:
    """Bytes of memory available now (Linux: MemAvailable; elsewhere: physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_bytes(kv_cache_memory: int | float) -> int:
    """An absolute byte count, or a fraction of the available memory."""
    if isinstance(kv_cache_memory, float):
        if not 0 < kv_cache_memory <= 1:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
        return int(kv_cache_memory * available_memory())
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory}")
    return int(kv_cache_memory)


@dataclass(frozen=True)
class KVShape:
    """The KV cache's shape per token: ``num_layers`` caches of ``num_kv_heads`` x ``head_dim``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_shape(model_config: dict, model=None, num_layers: int | None = None) -> KVShape:
    """The KV shape from the (text) config; keys the config leaves out take the values the model
    was built with (mlx-lm's ``model.args`` holds its architecture's defaults, e.g. gemma3's
    ``head_dim``). ``num_layers``: the attention layers, when not all layers are (hybrids)."""
    config = model_config.get("text_config", model_config)
    args = getattr(model, "args", None)
    if args is not None and hasattr(args, "__dict__"):
        config = {**config, **{k: v for k, v in vars(args).items() if v is not None}}
    heads = config["num_attention_heads"]
    return KVShape(
        num_layers=num_layers if num_layers is not None else config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
    )


def kv_bytes_per_token(model_config: dict, dtype_bytes: int, model=None, num_layers: int | None = None) -> int:
    """Keys + values of one token across all (``num_layers``: that many) attention layers, from
    the config (see ``kv_shape``): for callers that know the dtype but cannot run the model. The
    engine sizes its pool from the measured layout instead (``model_runner.measure_kv_layout``),
    which is exact (dtype, latent attention, layers that share keys).

    Sliding-window layers count in full here (an upper bound: with block groups they hold only
    the blocks their window reaches; kv_spec.py).
    """
    shape = kv_shape(model_config, model, num_layers)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


@dataclass(frozen=True)
class StateBudget:
    """How the KV budget is shared with the recurrent-state pool (all zeros but
    ``kv_bytes_left`` for a model without recurrent layers): one slot per running request plus
    the null slot, then the checkpoint slots, all of ``bytes_per_request``."""

    num_running_slots: int  # the null slot included
    num_checkpoints: int
    kv_bytes_left: int

    @property
    def num_slots(self) -> int:
        return self.num_running_slots + self.num_checkpoints

    @classmethod
    def plan(cls, config: EngineConfig, budget_bytes: int, bytes_per_request: int) -> StateBudget:
        """Raises ``ValueError`` when the budget cannot hold the running requests' states."""
        if not bytes_per_request:
            return cls(0, 0, budget_bytes)
        running = config.max_num_seqs + 1
        left = budget_bytes - running * bytes_per_request
        if left <= 0:
            raise ValueError(
                f"kv_cache_memory={budget_bytes} bytes cannot hold the recurrent state of {running - 1} "
                f"requests ({bytes_per_request} bytes each): raise it or lower max_num_seqs"
            )
        wanted = config.max_state_checkpoints
        if wanted is None:  # automatic: never more than half of what the KV blocks would get
            wanted = min(2 * config.max_num_seqs, left // 2 // bytes_per_request)
        num_checkpoints = wanted if config.enable_prefix_caching else 0
        left -= num_checkpoints * bytes_per_request
        if left <= 0:
            raise ValueError(
                f"kv_cache_memory={budget_bytes} bytes cannot hold {num_checkpoints} state checkpoints "
                f"besides the running requests' states ({bytes_per_request} bytes each): lower "
                "max_state_checkpoints"
            )
        return cls(running, num_checkpoints, left)


def __getattr__(name: str):
    # The seed exports AsyncEngineCore from this module; it lives in async_engine.py.
    if name == "AsyncEngineCore":
        from vllm_mlx.async_engine import AsyncEngineCore

        return AsyncEngineCore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""MLXWorker: vLLM's worker protocol on top of our ``MLXModelRunner`` (one runner, two front ends).

vLLM's engine core owns scheduling, the block pool and prefix caching; each step it hands the
worker a ``vllm.v1.core.sched.output.SchedulerOutput`` that describes requests as *diffs*
(new requests in full, cached ones as new block ids and counters). The worker keeps a
``RequestState`` per request across steps, turns the step into our own ``SchedulerOutput``
(``ScheduledRequest(request, num_computed_tokens, num_new_tokens, block_ids)``) and runs it on
the same ``MLXModelRunner`` and paged KV pool as ``vllm_mlx.EngineCore``. vLLM's block ids index
our pool directly: both reserve block 0 as the null block.

Call order (vLLM 0.33, in-process executor): ``init_device``, ``load_model``,
``get_kv_cache_spec``, ``determine_available_memory``, ``initialize_from_config``,
``compile_or_warm_up_model``, ``get_supported_tasks``; then per step ``execute_model`` and, when
it returned None, ``sample_tokens``; finally ``shutdown``. Every call runs on the engine-core
thread, which is the only thread that touches MLX (MLX streams are thread-local).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_mlx.config import DEFAULT_KV_CACHE_MEMORY
from vllm_mlx.core.kv.sizing import available_memory, kv_bytes_per_token, kv_shape
from vllm_mlx.core.outputs import ScheduledRequest, SchedulerOutput, TokenLogprobs
from vllm_mlx.core.request import Request, SamplingParams

logger = init_logger(__name__)

UNLIMITED_TOKENS = 1 << 30
"""Our SamplingParams needs a max_tokens; vLLM's scheduler enforces the real limit."""

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class MLXPagedAttentionBackend(AttentionBackend):
    """What vLLM's config code asks of an attention backend, for our paged attention.

    ``MLXModelRunner`` runs attention itself (``vllm_mlx.executor.attention``), so no vLLM layer ever
    calls this backend; vLLM still resolves one per platform (layout and block-size checks).
    Our pool takes any block size and any float dtype.
    """

    supported_dtypes = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("MLXModelRunner runs attention itself (vllm_mlx.executor.attention)")

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError("MLXModelRunner builds its own attention layout")

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # Our pool is head-major per layer: [num_kv_heads, num_blocks * block_size, head_size].
        return (2, num_kv_heads, num_blocks * block_size, head_size)


@dataclass
class RequestState:
    """The worker's copy of one vLLM request, kept across steps.

    Invariant between steps: ``request.output_token_ids`` holds every token this worker sampled
    for the request that vLLM still counts (vLLM never resends them), and ``block_ids`` is the
    request's whole block table in our pool.
    """

    request: Request
    block_ids: list[int] = field(default_factory=list)


@dataclass
class WorkerStats:
    """Counts of what vLLM asked of this worker (tests read them through ``collective_rpc``)."""

    steps: int = 0
    empty_steps: int = 0
    new_requests: int = 0
    prefix_hits: int = 0
    """New requests that arrived with ``num_computed_tokens > 0`` (vLLM prefix-cache hits)."""
    resumed_requests: int = 0
    """Preempted requests scheduled again (their block table replaced)."""
    partial_prefills: int = 0
    """Scheduled rows that stopped short of the known tokens (nothing sampled)."""


class MLXWorker(WorkerBase):
    """vLLM's worker for the MLX platform: loads the MLX model and runs ``MLXModelRunner``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.loaded = None  # vllm_mlx.models.LoadedModel
        self.runner = None  # MLXModelRunner, once the KV pool size is known
        self.kv_dtype: str | None = None
        self.states: dict[str, RequestState] = {}
        self.stats = WorkerStats()
        self._pending: ModelRunnerOutput | None = None
        self._seed_rng = random.Random(self.model_config.seed)
        self._thread: threading.Thread | None = None

    # -- start-up, in vLLM's order ------------------------------------------------------------

    def init_device(self) -> None:
        from vllm_mlx.platform.threads import clear_streams_at_exit, create_random_state_here

        self.device = torch.device("cpu")
        self._thread = threading.current_thread()
        create_random_state_here()
        if self._thread is threading.main_thread():
            clear_streams_at_exit()
        _quiet_accelerator_cache_calls()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Load the model as our engine does: the same sources, checks and CPU weight format,
        chosen by memory before loading (the KV pool counted as ``determine_available_memory``
        will size it: ``kv_cache_memory_bytes``, else our default budget)."""
        from vllm_mlx.config import EngineConfig
        from vllm_mlx.engine.weight_plan import log_plan, plan_weight_format
        from vllm_mlx.executor.attention import check_supported
        from vllm_mlx.models import load_model, resolve_model
        from vllm_mlx.platform.cpu_backend import prepare_model_weights

        if load_dummy_weights:
            raise ValueError("load_format='dummy' is not supported by the MLX platform plugin")
        trust = bool(self.model_config.trust_remote_code)
        path = resolve_model(self.model_config.model, trust)
        kv_budget = self.cache_config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY
        plan = plan_weight_format(EngineConfig(kv_cache_memory=int(kv_budget)), path)
        log_plan(plan)
        loaded = load_model(path, trust_remote_code=trust)
        if loaded.vision is not None:
            raise ValueError("vision-language models are not supported through vLLM on MLX yet")
        # Recurrent state needs slots that vLLM's scheduler does not hand our runner yet.
        check_supported(loaded.model, loaded.config.get("model_type", "?"), recurrent=False)
        prepare_model_weights(loaded.model, plan.weight_format)
        self.loaded = loaded
        self.kv_dtype = activation_dtype(loaded.model)
        logger.info("MLX model loaded from %s (KV cache in %s)", loaded.path, self.kv_dtype)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """One full-attention spec per layer, describing our pool's layout and dtype.

        Sliding-window layers too: our pool keeps every block of their requests (one block
        table for all layers), and our runner applies the window when it gathers and masks."""
        shape = kv_shape(self.loaded.config, self.loaded.model)
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_dim,
            dtype=_TORCH_DTYPES[self.kv_dtype],
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(len(self.loaded.model.layers))}

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: ``kv_cache_memory_bytes`` when given, else our engine's
        default budget (1 GiB), capped at ``gpu_memory_utilization`` of the free host memory.

        vLLM's default (90% of device memory) suits a GPU; MLX's pool here lives in host memory
        shared with everything else, so the default stays our engine's."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        cap = int(self.cache_config.gpu_memory_utilization * available_memory())
        return min(DEFAULT_KV_CACHE_MEMORY, cap)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Build the runner with a pool of exactly vLLM's block count (block 0: null block)."""
        from vllm_mlx.executor.model_runner import MLXModelRunner

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"expected one KV cache group, got {len(groups)}")
        block_size = groups[0].kv_cache_spec.block_size
        self.runner = MLXModelRunner(self.loaded.model, kv_cache_config.num_blocks, block_size)
        per_token = kv_bytes_per_token(self.loaded.config, _DTYPE_BYTES[self.kv_dtype], self.loaded.model)
        logger.info(
            "MLX KV pool: %d blocks of %d tokens (%.1f MiB)",
            kv_cache_config.num_blocks,
            block_size,
            kv_cache_config.num_blocks * block_size * per_token / 2**20,
        )

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # MLX compiles lazily; the runner's split probe already ran one forward pass.
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # -- steps ----------------------------------------------------------------------------------

    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        """Run one vLLM step on our runner.

        Returns None (the output comes from ``sample_tokens``), except for a step with no
        scheduled tokens: vLLM then does not call ``sample_tokens`` and takes this output.
        """
        self._update_states(scheduler_output)
        self.stats.steps += 1
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.stats.empty_steps += 1
            return EMPTY_MODEL_RUNNER_OUTPUT
        if scheduler_output.scheduled_spec_decode_tokens:
            raise ValueError("speculative decoding is not supported by the MLX platform plugin")
        batch = self._our_scheduler_output(scheduler_output)
        result = self.runner.execute_model(batch)
        self.stats.partial_prefills += sum(not item.samples for item in batch.scheduled)
        for item in batch.scheduled:
            token_id = result.sampled_token_ids.get(item.request_id)
            if token_id is not None:
                item.request.append_output_token(token_id)
        self._pending = _vllm_output(batch, result)
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        """The output of the step ``execute_model`` ran (sampling happened there)."""
        if grammar_output is not None and len(grammar_output.structured_output_request_ids):
            raise ValueError("structured outputs are not supported by the MLX platform plugin")
        output, self._pending = self._pending, None
        return output if output is not None else EMPTY_MODEL_RUNNER_OUTPUT

    def _update_states(self, so) -> None:
        """Apply vLLM's diff: drop finished requests, add new ones, update cached ones."""
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = RequestState(
                Request(new.req_id, new.prompt_token_ids, self._sampling_params(new.sampling_params)),
                list(new.block_ids[0]),
            )
            self.states[new.req_id].request.num_computed_tokens = new.num_computed_tokens
            self.stats.new_requests += 1
            self.stats.prefix_hits += new.num_computed_tokens > 0
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0])  # preempted and resumed: a new table
                self.stats.resumed_requests += 1
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            request = state.request
            if req_id in cached.all_token_ids:  # vLLM resends tokens after a gap
                request.output_token_ids = cached.all_token_ids[req_id][request.num_prompt_tokens :]
            # Outputs vLLM discarded (e.g. past a stop) must not feed the next forward.
            del request.output_token_ids[cached.num_output_tokens[i] :]
            request.num_computed_tokens = cached.num_computed_tokens[i]

    def _our_scheduler_output(self, so) -> SchedulerOutput:
        batch = SchedulerOutput(step_id=0)
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            request = state.request
            start = request.num_computed_tokens
            if start + num_new > request.num_tokens:
                raise RuntimeError(
                    f"request {req_id}: vLLM scheduled tokens {start}..{start + num_new} but the "
                    f"worker knows {request.num_tokens} (state out of sync)"
                )
            batch.scheduled.append(ScheduledRequest(request, start, num_new, state.block_ids))
        return batch

    def _sampling_params(self, params) -> SamplingParams:
        """vLLM's SamplingParams as ours. Stops are vLLM's job; the sampler needs only what
        shapes a token: the min_tokens ban covers every stop id, EOS included, as in vLLM."""
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return SamplingParams(
            max_tokens=UNLIMITED_TOKENS,
            min_tokens=params.min_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            seed=seed,
            stop_token_ids=sorted(params.all_stop_token_ids),
            ignore_eos=True,
            logprobs=params.logprobs,
        )

    # -- the rest of the protocol ---------------------------------------------------------------

    def get_model(self):
        return self.loaded.model if self.loaded is not None else None

    def take_draft_token_ids(self):
        return None

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        """Drop the model and pool (MLX arrays) on the thread that made them."""
        if self.runner is not None:
            self.runner.release()
        self.runner = self.loaded = None
        self.states.clear()
        if self._thread is threading.current_thread() and self._thread is not threading.main_thread():
            from vllm_mlx.platform.threads import clear_thread_streams

            clear_thread_streams()


def activation_dtype(model) -> str:
    """The dtype the model's hidden states (hence keys and values) have: one embedding lookup."""
    import mlx.core as mx

    try:
        hidden = model.model.embed_tokens(mx.array([[0]]))
    except AttributeError:
        return "float32"
    name = str(hidden.dtype).removeprefix("mlx.core.")
    return name if name in _TORCH_DTYPES else "float32"


def _vllm_output(batch: SchedulerOutput, result) -> ModelRunnerOutput:
    """Our runner's output in vLLM's shape: one row per scheduled request, empty when the
    step was a partial prefill (nothing sampled)."""
    req_ids = [item.request_id for item in batch.scheduled]
    sampled = [[result.sampled_token_ids[r]] if r in result.sampled_token_ids else [] for r in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=_logprobs_lists(req_ids, result.logprobs),
    )


def _logprobs_lists(req_ids: list[str], records: dict[str, TokenLogprobs]) -> LogprobsLists | None:
    """vLLM's logprobs rows: column 0 is the sampled token, then the top-N by logprob.

    The sampled token's rank is exact when it is among the top N (always, for greedy); otherwise
    it is reported as N + 1, the best rank it can have (our sampler returns no full ranking).
    """
    if not records:
        return None
    width = 1 + max(len(r.top) for r in records.values())
    ids = np.zeros((len(req_ids), width), dtype=np.int64)
    values = np.full((len(req_ids), width), -np.inf, dtype=np.float32)
    ranks = np.ones(len(req_ids), dtype=np.int64)
    for row, req_id in enumerate(req_ids):
        record = records.get(req_id)
        if record is None:
            continue
        top = sorted(record.top.items(), key=lambda kv: kv[1], reverse=True)
        ids[row, 0], values[row, 0] = record.token_id, record.logprob
        for col, (token_id, logprob) in enumerate(top, start=1):
            ids[row, col], values[row, col] = token_id, logprob
        order = [token_id for token_id, _ in top]
        ranks[row] = order.index(record.token_id) + 1 if record.token_id in order else len(order) + 1
    return LogprobsLists(ids, values, ranks)


def _quiet_accelerator_cache_calls() -> None:
    """vLLM's shutdown calls ``torch.accelerator.empty_cache()`` on out-of-tree platforms. With a
    CPU-only torch (or no accelerator) that raises and prints a traceback; there is no torch
    device cache to empty, so the calls become no-ops. With an accelerator they are untouched."""
    if torch.accelerator.current_accelerator() is not None:
        return
    for name in ("empty_cache", "empty_host_cache"):
        if hasattr(torch.accelerator, name):
            setattr(torch.accelerator, name, _no_op)


def _no_op(*args, **kwargs) -> None:
    return None

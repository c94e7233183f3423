"""Continuous-batching scheduler: token budgets, chunked prefill, preemption.

Pure bookkeeping (no MLX). The scheduler talks to the KV cache through one front door,
``KVCacheManager`` (find computed blocks, allocate slots, complete a step, free), and never
touches KV arrays.
The model runner sees only a ``SchedulerOutput`` and answers with a ``ModelRunnerOutput`` (both
plain data in ``outputs.py``, re-exported here).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mlx.core.fields import described
from vllm_mlx.core.kv.coordinator import KVCacheCoordinator
from vllm_mlx.core.kv.manager import KVCacheManager
from vllm_mlx.core.outputs import (
    Admission,
    DraftVerdict,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from vllm_mlx.core.request import Request, RequestStatus
from vllm_mlx.core.sched.observation import RequestView, SchedulerStats, requests_to_dict
from vllm_mlx.core.sched.prefill_budget import PrefillCost
from vllm_mlx.core.sched.waiting_queue import WaitingQueue
from vllm_mlx.platform.errors import internal_error_message

# Re-exported: these lived here, and the seed exports SchedulerOutput from this module.
__all__ = ["ModelRunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput", "TokenLogprobs"]

logger = logging.getLogger(__name__)

MAX_ADMISSION_PASSES = 64
"""Steps a request that cannot be admitted yet (every LoRA slot busy with other adapters) lets
others past it. Then no one passes it: the queue waits with it until it can be admitted (a slot
frees as running requests finish), so a stream of requests for the adapters in the slots cannot
starve it."""


@dataclass
class SchedulerConfig:
    """Limits of one engine step and of the KV cache. Each field's meaning is declared with it
    (``described``), and the configuration reference's ``SchedulerConfig`` table is generated
    from those declarations."""

    max_num_seqs: int = described(32, doc="most requests running at once")
    max_num_batched_tokens: int = described(
        512, doc="token budget of one step (prefill chunks + one token per decoding request)",
    )  # fmt: skip
    block_size: int = described(
        16, doc="tokens per KV block; must equal the KV cache's (`PagedCacheManager.block_size`), else `Scheduler` "
        "raises `ValueError`",
    )  # fmt: skip
    num_blocks: int | None = described(
        None, doc="blocks in the pool, including the reserved null block (the engine sets its pool's; the "
        "scheduler reads the pool's own capacity, not this)",
    )  # fmt: skip
    kv_cache_memory: int | None = described(
        None, doc="KV budget in bytes, for whoever sizes the pool when `num_blocks` is `None` (the scheduler "
        "reads neither; the engine sizes its pool from `EngineConfig.kv_cache_memory` and leaves this `None`)",
    )  # fmt: skip
    enable_chunked_prefill: bool = described(
        True, doc="split long prompts across steps so running requests keep decoding",
    )  # fmt: skip
    enable_prefix_caching: bool = described(True, doc="reuse computed full blocks across requests with the same prefix")
    max_model_len: int | None = described(
        None, doc="longest prompt + output a request may reach (the model's context; `None` = no limit of its "
        "own); the scheduler also caps it at the pool's capacity in tokens (and, without chunked prefill, at "
        "`max_num_batched_tokens + 1`)",
    )  # fmt: skip
    prefill_attention_tokens: int = described(
        0, doc="charge prefill chunks for their attention (`vllm_mlx.core.sched.prefill_budget.PrefillCost`): the "
        "context length at which a token's attention costs as much as its weights (the engine passes its "
        "`EngineConfig` value, 1024 by default); `0` = a chunk costs its token count; only with chunked prefill "
        "(a whole prompt cannot be cut to its cost)",
    )  # fmt: skip


class Scheduler:
    """Decides, each step, which requests compute how many tokens (vLLM v1 style).

    One ``schedule()`` → model runner → ``update_from_output()`` cycle is a step; the two calls
    alternate. Running requests are served first, in admission order, then waiting requests,
    all under one token budget. When the block pool runs dry, the most recently admitted
    request is preempted: its blocks are freed and it is recomputed later (prefix hits included).

    Fairness: waiting requests are grouped by ``fairness_key`` (a caller's request: its prompts
    and its ``n`` completions). Admission takes the key with the fewest running requests first
    (FIFO among equals and within a key), and when the batch is full (seats or blocks) while a
    key runs at least two requests more than a waiting key, one request of the heaviest key is
    preempted per step to make room. So a huge request cannot starve a small one sent after it.

    Invariants at step boundaries (checked by ``check_invariants()``):

    * every unfinished request is in exactly one of ``waiting`` / ``running``; finished requests
      are in neither and hold no blocks;
    * a waiting request holds no blocks and has ``num_computed_tokens == 0``;
    * a running request's block table covers its ``num_computed_tokens`` and it still has
      tokens to compute (``num_computed_tokens < num_tokens``);
    * no running request holds a shared block that is not full: prefix hits are whole blocks
      and stop before the block of the last known token, so writes never touch a shared block;
    * ``num_tokens < max_model_len`` for every unfinished request, where ``max_model_len`` is
      the *effective* limit (see ``__init__``), so any request can always finish alone.

    Prefill chunks are charged for their attention (``prefill_budget.PrefillCost``, with
    ``prefill_attention_tokens``): a chunk deep in a long prompt costs more budget than one at
    its start, so each step costs about the same and decoding requests keep a bounded gap
    between tokens. A row of one token (a decode) costs 1.

    Hybrid models (recurrent layers) resume a prefix only where a state checkpoint was kept:
    prefill chunks are cut where the KV manager keeps one (``KVCacheManager.cut_at_checkpoint``).
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheCoordinator, cache_namespace: str = ""
    ) -> None:
        """``kv_cache``: the block bookkeeping (a ``PagedCacheManager``), which the scheduler
        reaches only through its ``KVCacheManager``, ``self.kv`` (observers too: its read
        methods). ``max_model_len`` = min(config.max_model_len, pool capacity in tokens), and,
        with chunked prefill off, at most ``max_num_batched_tokens + 1`` so that a preempted
        request can always be recomputed in one step. ``cache_namespace`` (model identity) and
        each request's ``cache_salt`` are folded into its block hashes."""
        _check_config(config, kv_cache)
        self.config = config
        self.admission_check: Callable[[Request], bool] | None = None
        """Called on the request about to be admitted; False keeps it waiting (the engine's LoRA
        slots: ``engine/lora_slots.py``)."""
        self.block_size = kv_cache.block_size
        self.cache_namespace = cache_namespace
        self.kv = KVCacheManager(kv_cache, cache_namespace, config.enable_prefix_caching)
        limits = [self.kv.token_capacity(config.max_num_batched_tokens)]
        if config.max_model_len is not None:
            limits.append(config.max_model_len)
        if not config.enable_chunked_prefill:
            limits.append(config.max_num_batched_tokens + 1)
        self.max_model_len = min(limits)
        self.prefill_cost = PrefillCost(config.prefill_attention_tokens if config.enable_chunked_prefill else 0)

        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.step_id = 0  # number of schedule() calls so far

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request``; a prompt that can never fit finishes at once with FINISHED_ERROR."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.is_finished:
            return
        if request.num_tokens >= self.max_model_len:
            request.error(
                f"prompt has {request.num_tokens} tokens but the limit is {self.max_model_len} "
                "(context length / KV cache capacity)"
            )
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, status: RequestStatus, reason: str | int | None = None
    ) -> Request | None:
        """End a request from outside (stop string, error, abort); free its blocks.

        For FINISHED_ERROR a str ``reason`` becomes the error message. Unknown or already
        finished ids are a no-op (returns None). Allowed between ``schedule()`` and
        ``update_from_output()``: the update then skips the request.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if status == RequestStatus.FINISHED_ERROR:
            request.error(reason if isinstance(reason, str) else "request failed")
        else:
            request.finish(status, reason)
        self._release(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Cancel a request (FINISHED_ABORTED); unknown or finished ids are a no-op."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work under one token budget: running requests, then waiting ones.

        A running request computes its remaining tokens (1 when decoding), capped by the budget
        (chunked prefill). Waiting requests are admitted (least-served key first) only if no
        running request had to be preempted for blocks in this step, while budget and
        ``max_num_seqs`` allow and blocks can be allocated.
        """
        self.step_id += 1
        output = SchedulerOutput(step_id=self.step_id, token_budget=self.config.max_num_batched_tokens)
        self._preempt_for_fairness(output)
        num_fair_preemptions = len(output.preempted_ids)
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if len(output.preempted_ids) == num_fair_preemptions:
            self._schedule_waiting(output, budget)
        return output

    def _preempt_for_fairness(self, output: SchedulerOutput) -> None:
        """Make room for the least-served waiting key when the batch is full: preempt the most
        recently admitted request of the heaviest running key, if it runs >= 2 more requests."""
        if not self.waiting or not self.running:
            return
        load = Counter(r.fairness_key for r in self.running)
        starved = self.waiting.peek(load)
        heavy_key, heavy_load = load.most_common(1)[0]
        if heavy_load - load[starved.fairness_key] < 2 or not self._batch_full(starved):
            return
        victim = next(r for r in reversed(self.running) if r.fairness_key == heavy_key)
        self.running.remove(victim)
        self._preempt(victim, output)

    def _batch_full(self, request: Request) -> bool:
        """No seat for ``request``, or too few free blocks for its first chunk."""
        if len(self.running) >= self.config.max_num_seqs:
            return True
        return not self.kv.has_room_for(min(request.num_tokens, self.config.max_num_batched_tokens))

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = self._chunk(request.num_tokens - start, start, budget)
            num_new = self._whole_spans(request, start, self.kv.cut_at_checkpoint(request, start, num_new))
            spec = self._spec_tokens(request, num_new, budget - self._charge(num_new, start))
            if spec and not self.kv.allocate_slots(request, start + num_new + len(spec)):
                spec = request.spec_token_ids = []  # no room to verify: decode plainly
            while not spec and not self.kv.allocate_slots(request, start + num_new):
                victim = self.running.pop()  # the tail: most recently admitted
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                budget -= self._charge(num_new, start) + len(spec)
                output.scheduled.append(self._scheduled(request, num_new, spec))
                i += 1
        return budget

    def _spec_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposed tokens ``request`` verifies in this step (speculative decoding): only
        after a chunk that reaches its last known token, and only as many as the step's budget
        and the request's room below ``max_model_len`` allow (its KV must fit the context)."""
        if not request.spec_token_ids or request.num_computed_tokens + num_new != request.num_tokens:
            return []
        room = min(budget, self.max_model_len - request.num_tokens)
        return request.spec_token_ids[: max(room, 0)]

    def _chunk(self, remaining: int, position: int, budget: int) -> int:
        """How many of a request's ``remaining`` tokens, the first at ``position``, fit in
        ``budget`` (at least 1 while any is left)."""
        return self.prefill_cost.fit(budget, position, remaining)

    @staticmethod
    def _whole_spans(request: Request, start: int, num_new: int) -> int:
        """The chunk moved so it does not end inside a span of tokens that attend both ways
        (``MultiModalInput.whole_spans``: an image whole, even past the budget)."""
        mm = request.mm_input
        return num_new if mm is None or not mm.both_ways else mm.whole_spans(start, num_new)

    def _charge(self, num_new: int, position: int) -> int:
        """Budget units of a row: one for a single token (a decode), else the chunk's cost."""
        return 1 if num_new == 1 else self.prefill_cost.cost(num_new, position)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        load = Counter(r.fairness_key for r in self.running)
        passed: set[str] = set()  # keys whose first request cannot be admitted this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek(load, skip=passed)
            if request is None:
                break
            admissible = self._admissible(request, output)
            if admissible is None:  # failed at admission: ended alone
                continue
            if not admissible:  # it waits (e.g. every LoRA slot is busy); its key's later requests too
                request.admission_passes += 1
                if request.admission_passes > MAX_ADMISSION_PASSES:
                    break  # its turn: nobody passes it any more
                passed.add(request.fairness_key)
                continue
            hits = self.kv.get_computed_blocks(request)
            num_hit = len(hits) * self.block_size
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self.kv.cut_at_checkpoint(request, num_hit, self._chunk(num_new, num_hit, budget))
            num_new = self._whole_spans(request, num_hit, num_new)
            if not self.kv.allocate_slots(request, num_hit + num_new, hits):
                break
            self.waiting.pop(request)
            load[request.fairness_key] += 1
            output.admitted.append(Admission(request.request_id, num_hit, resumed=request.num_preemptions > 0))
            self._admit(request, num_hit)
            output.scheduled.append(self._scheduled(request, num_new, []))
            budget -= self._charge(num_new, num_hit)

    def _admissible(self, request: Request, output: SchedulerOutput) -> bool | None:
        """``admission_check(request)``; None when the check failed: the request ends with the
        error (in ``output.failed``), the others go on."""
        if self.admission_check is None:
            return True
        try:
            return self.admission_check(request)
        except Exception as exc:  # e.g. its adapter could not be put in a slot
            logger.error("admitting request %s failed", request.request_id, exc_info=True)
            self.waiting.remove(request)
            request.error(internal_error_message(exc))
            self._release(request)
            output.failed.append(request)
            return None

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a finished step: advance computed tokens, register newly full blocks, append
        sampled tokens, check token-level stops, free finished requests.

        Returns the requests that advanced (got a token, or finished) in this step. Requests
        finished or aborted since ``schedule()`` are skipped. Stop *strings* are the engine's
        job (it detokenizes, then calls ``finish_request``).
        """
        advanced: list[Request] = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if self.requests.get(request.request_id) is not request:
                continue  # finished or aborted meanwhile
            try:
                if self._update_request(scheduled, runner_output):
                    advanced.append(request)
            except Exception as exc:  # this request's bookkeeping failed: it ends alone
                logger.error("updating request %s failed", request.request_id, exc_info=True)
                request.error(internal_error_message(exc))
                advanced.append(request)
        finished = [r for r in advanced if r.is_finished]
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            for request in finished:
                self._release(request)
        return advanced

    def _update_request(self, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput) -> bool:
        """Apply one request's share of a step; True if it advanced (a token, or its end)."""
        request = scheduled.request
        request.spec_token_ids = []  # verified now, or to be proposed afresh
        error = runner_output.errors.get(request.request_id)
        checkpointed = scheduled.checkpoint_slot is not None
        if error is not None:  # its KV was not computed: nothing to cache
            self.kv.complete_step(request, scheduled.num_computed_tokens, checkpointed, succeeded=False)
            request.error(error)
            return True
        verdict = runner_output.drafts.get(request.request_id)
        if verdict is not None:
            return self._update_verified(scheduled, runner_output.new_token_ids(request.request_id), verdict)
        request.num_computed_tokens += scheduled.num_new_tokens
        self.kv.complete_step(request, scheduled.num_computed_tokens, checkpointed, succeeded=True)
        if not scheduled.samples:
            return False
        token_id = runner_output.sampled_token_ids.get(request.request_id)
        if token_id is None:
            request.error("the model runner returned no token for this request")
        else:
            request.append_output_token(token_id)
            self._check_stop(request)
        return True

    def _update_verified(self, scheduled: ScheduledRequest, new_tokens: list[int], verdict: DraftVerdict) -> bool:
        """A step that verified proposed tokens: its accepted ones and the sampled one are the
        request's new tokens (until a stop), and its computed count covers the accepted ones;
        the rejected positions' KV is left to be overwritten. Recurrent layers cannot drop the
        rejected tokens from their state, which the runner then did not write: the request
        recomputes from where the step began (``kv.rolls_back_by_recompute``)."""
        request = scheduled.request
        request.num_draft_tokens += verdict.num_proposed
        request.num_accepted_tokens += verdict.num_accepted
        if len(new_tokens) != verdict.num_accepted + 1:
            request.error("the model runner returned no token for this request")
            self.kv.complete_step(request, scheduled.num_computed_tokens, False, succeeded=False)
            return True
        for token_id in new_tokens:
            request.append_output_token(token_id)
            self._check_stop(request)
            if request.is_finished:
                break
        computed = scheduled.num_computed_tokens + scheduled.num_known_tokens + verdict.num_accepted
        if verdict.num_rejected and self.kv.rolls_back_by_recompute:
            computed = scheduled.num_computed_tokens
        request.num_computed_tokens = min(computed, request.num_tokens)  # a stop may end it early
        self.kv.complete_step(request, scheduled.num_computed_tokens, False, succeeded=True)
        return True

    # ---- helpers -------------------------------------------------------------------------------

    def _scheduled(self, request: Request, num_new: int, spec: list[int]) -> ScheduledRequest:
        cache = self.kv.assign(request, num_new, speculative=bool(spec))
        return ScheduledRequest(
            request, request.num_computed_tokens, num_new + len(spec), cache.block_ids, cache.state_slot,
            cache.state_read_slot, cache.checkpoint_slot, cache.block_tables, list(spec),
        )  # fmt: skip

    def _admit(self, request: Request, num_hit: int) -> None:
        self.kv.record_admission(request, num_hit)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self.running.append(request)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.kv.free(request, finished=False)
        request.preempt()
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        output.preempted_ids.append(request.request_id)

    def _release(self, request: Request) -> None:
        self.kv.free(request, finished=True)
        self.requests.pop(request.request_id, None)

    def _check_stop(self, request: Request) -> None:
        """Token-level stops, after ``request``'s newest token was appended."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        may_stop = request.num_output_tokens > params.min_tokens  # min_tokens came before it
        if may_stop and token_id in params.stop_token_ids:
            request.finish(RequestStatus.FINISHED_STOPPED, token_id)
        elif may_stop and not params.ignore_eos and token_id in request.eos_token_ids:
            request.finish(RequestStatus.FINISHED_STOPPED)
        elif request.num_output_tokens >= params.max_tokens:
            request.finish(RequestStatus.FINISHED_LENGTH_CAPPED)
        elif request.num_tokens >= self.max_model_len:
            request.finish(RequestStatus.FINISHED_LENGTH_CAPPED)

    # ---- observation ---------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats_view(self) -> SchedulerStats:
        """The counters, with the KV pool's."""
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, self.step_id, self.kv.stats())

    def stats(self) -> dict:
        """``stats_view()`` as plain data."""
        return self.stats_view().to_dict()

    def request_views(self) -> dict[str, RequestView]:
        """One view per unfinished request id (running first, then waiting in queue order)."""
        return {r.request_id: self._request_view(r) for r in [*self.running, *self.waiting]}

    def snapshot(self) -> dict:
        """``request_views()`` as plain data."""
        return requests_to_dict(self.request_views())

    def _request_view(self, request: Request) -> RequestView:
        return RequestView(
            status=request.status.name,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            block_ids=self.kv.block_ids(request.request_id),
            num_disk_tokens=min(request.num_disk_tokens, request.num_cached_tokens),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if a step-boundary invariant (class docstring) is broken."""
        live = [*self.running, *self.waiting]
        _require(len({id(r) for r in live}) == len(live), "a request is queued twice")
        _require({r.request_id for r in live} == set(self.requests), "queues != request map")
        for request in self.waiting:
            _require(request.status in _WAITING_STATES, f"{request.request_id} waits while done")
            _require(request.num_computed_tokens == 0, f"{request.request_id} waits computed")
            _require(not self.kv.block_ids(request.request_id), "a waiter holds blocks")
        for request in self.running:
            self._check_running(request)
        self.kv.check_requests(self.running)  # tables cover, no shared partial block

    def _check_running(self, request: Request) -> None:
        rid = request.request_id
        _require(request.status == RequestStatus.RUNNING, f"{rid} runs as {request.status.name}")
        _require(request.num_computed_tokens < request.num_tokens, f"{rid} has nothing to do")
        _require(request.num_tokens < self.max_model_len, f"{rid} exceeds max_model_len")


_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)



def _check_config(config: SchedulerConfig, kv_cache: KVCacheCoordinator) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.prefill_attention_tokens < 0:
        raise ValueError(f"prefill_attention_tokens must be >= 0, got {config.prefill_attention_tokens}")
    if config.max_model_len is not None and config.max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {config.max_model_len}")
    if config.block_size != kv_cache.block_size:
        raise ValueError(
            f"config.block_size {config.block_size} != kv_cache.block_size {kv_cache.block_size}"
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

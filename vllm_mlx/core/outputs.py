"""Plain-data types that cross layers within one engine step.

The scheduler builds a ``SchedulerOutput`` (the ``ScheduledRequest``s of a step), the model runner
answers with a ``ModelRunnerOutput`` (sampled tokens, their ``TokenLogprobs``, per-request errors)
and leaves a ``StepRecord`` of what it ran. Every layer may import this module: it holds data and
cheap derived properties only, no behaviour, and imports nothing but ``request`` (plain data too).
``scheduler`` and ``model_runner`` re-export these names, where they used to live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_mlx.core.request import Request


@dataclass
class ScheduledRequest:
    """One request's work in a step: compute ``num_new_tokens`` tokens starting at
    ``num_computed_tokens`` (i.e. token ids ``request.all_token_ids[start:start + n]``)."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    """The request's whole block table after this step's allocation."""
    state_slot: int = 0
    """The request's recurrent-state slot (models with recurrent layers; 0: the null slot)."""
    state_read_slot: int | None = None
    """Where this step reads the state from when not ``state_slot``: the checkpoint a prefix
    hit resumes from, in the first step after admission."""
    checkpoint_slot: int | None = None
    """A state-checkpoint slot this step also writes its final state into (the step ends on a
    block boundary; published for prefix hits once the step succeeded)."""
    block_tables: list[list[int]] | None = None
    """With several block groups, the table of each (``block_ids`` is the first); else None."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens verified after the known ones (speculative decoding): the last
    ``len(spec_token_ids)`` of ``num_new_tokens`` are these, not the request's own tokens."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_known_tokens(self) -> int:
        """The request's own tokens this step computes (``num_new_tokens`` less the proposals)."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled.
        A prefill chunk that stops short of the prompt's end samples nothing."""
        return self.num_computed_tokens + self.num_known_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: the request's own, then the proposed ones."""
        start = self.num_computed_tokens
        return self.request.all_token_ids[start : start + self.num_known_tokens] + self.spec_token_ids


@dataclass
class Admission:
    """A request the scheduler took from the waiting queue in a step."""

    request_id: str
    num_cached_tokens: int
    """Tokens served from the prefix cache at admission (whole blocks; 0: no hit)."""
    resumed: bool
    """True when it had been preempted before: this admission recomputes it."""


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    """Requests preempted while building this step (their blocks are already freed)."""
    admitted: list[Admission] = field(default_factory=list)
    """Requests taken from the waiting queue in this step, in admission order."""
    failed: list[Request] = field(default_factory=list)
    """Requests that ended at admission (their admission check failed): the engine reports them."""
    token_budget: int = 0
    """The step's token budget (``max_num_batched_tokens``); 0 when unknown."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Log-probabilities for one generated token (from the raw model distribution)."""

    token_id: int
    logprob: float
    top: dict[int, float]
    """The top-N token ids and their logprobs (N = SamplingParams.logprobs; may be empty)."""


@dataclass
class DraftVerdict:
    """What the target model made of one request's proposed tokens in a step."""

    num_proposed: int
    accepted_token_ids: list[int]
    """The proposals kept (a prefix of them): each is the token the request would have sampled
    there without speculation. The step's sampled token follows them."""
    accepted_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """Their logprobs (one per accepted token) when the request asks for logprobs."""

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_token_ids)

    @property
    def num_rejected(self) -> int:
        return self.num_proposed - self.num_accepted


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step, keyed by request id (only requests whose step samples)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Requests whose work failed in the runner (e.g. the vision encoder rejected an image):
    they were left out of the forward and finish with FINISHED_ERROR; the batch goes on."""
    drafts: dict[str, DraftVerdict] = field(default_factory=dict)
    """Requests that verified proposed tokens: how many were kept (their tokens come before
    the sampled one)."""

    def new_token_ids(self, request_id: str) -> list[int]:
        """The request's tokens from this step, in order: accepted proposals, then the sampled one."""
        verdict = self.drafts.get(request_id)
        sampled = self.sampled_token_ids.get(request_id)
        accepted = verdict.accepted_token_ids if verdict is not None else []
        return accepted + ([sampled] if sampled is not None else [])

    def new_logprobs(self, request_id: str) -> list[TokenLogprobs | None]:
        """Per token of ``new_token_ids``, its logprobs (None where not asked for)."""
        verdict = self.drafts.get(request_id)
        accepted = verdict.accepted_logprobs if verdict is not None else []
        return [*accepted, self.logprobs.get(request_id)]

    def merge(self, other: ModelRunnerOutput) -> None:
        """Take ``other``'s results in (a step re-run request by request)."""
        self.sampled_token_ids.update(other.sampled_token_ids)
        self.logprobs.update(other.logprobs)
        self.errors.update(other.errors)
        self.drafts.update(other.drafts)


@dataclass
class StepRequestRecord:
    """One request's share of a step.

    Its ``num_new_tokens`` are either decode tokens (the single newest token of a request whose
    earlier tokens are all computed, plus any proposed tokens it verifies) or prefill: a chunk of
    the prompt or, after a preemption, of the prompt and output so far being recomputed. So
    across the steps of a request that was never preempted, prefill tokens sum to its prompt
    length minus its cached tokens."""

    request_id: str
    num_computed_tokens: int
    """Tokens already computed before this step (where its chunk starts)."""
    num_new_tokens: int
    num_prompt_tokens: int
    is_decode: bool
    num_draft_tokens: int = 0
    """Proposed tokens verified in this step (speculative decoding; part of ``num_new_tokens``)."""
    num_accepted_tokens: int = 0
    """How many of them were kept."""

    @classmethod
    def of(cls, scheduled: ScheduledRequest, verdict: DraftVerdict | None = None) -> StepRequestRecord:
        start, n = scheduled.num_computed_tokens, scheduled.num_new_tokens
        num_prompt = scheduled.request.num_prompt_tokens
        is_decode = scheduled.num_known_tokens == 1 and start >= num_prompt
        accepted = verdict.num_accepted if verdict is not None else 0
        return cls(scheduled.request_id, start, n, num_prompt, is_decode, len(scheduled.spec_token_ids), accepted)

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.is_decode else self.num_new_tokens

    @property
    def num_decode_tokens(self) -> int:
        return self.num_new_tokens if self.is_decode else 0


@dataclass
class StepRecord:
    """What one step ran (observers, tests and the notebook timeline read these; plain data,
    built from the ``SchedulerOutput`` once per step whether anyone reads them or not)."""

    step_id: int
    request_ids: list[str]
    num_new_tokens: list[int]
    num_forward_calls: int
    requests: list[StepRequestRecord] = field(default_factory=list)
    """Per scheduled request, in batch order: its prefill or decode tokens."""
    preempted: list[str] = field(default_factory=list)
    """Requests preempted while this step was scheduled (they wait to be recomputed)."""
    admitted: list[Admission] = field(default_factory=list)
    """Requests admitted in this step: prefix-cache hits and resumes after a preemption."""
    token_budget: int = 0
    """``max_num_batched_tokens``: the most tokens the step could have taken."""
    wall_time: float = 0.0
    """Seconds the engine spent on the step (schedule, forward pass, update, outputs)."""

    @classmethod
    def of(
        cls, output: SchedulerOutput, num_forward_calls: int, wall_time: float = 0.0,
        drafts: dict[str, DraftVerdict] | None = None,
    ) -> StepRecord:  # fmt: skip
        """``drafts``: the runner's verdicts on proposed tokens (``ModelRunnerOutput.drafts``)."""
        scheduled, drafts = output.scheduled, drafts or {}
        return cls(
            output.step_id, [s.request_id for s in scheduled], [s.num_new_tokens for s in scheduled],
            num_forward_calls, [StepRequestRecord.of(s, drafts.get(s.request_id)) for s in scheduled],
            list(output.preempted_ids), list(output.admitted), output.token_budget, wall_time,
        )  # fmt: skip

    @property
    def num_draft_tokens(self) -> int:
        """Proposed tokens verified in this step (speculative decoding)."""
        return sum(r.num_draft_tokens for r in self.requests)

    @property
    def num_accepted_tokens(self) -> int:
        """Proposed tokens kept in this step."""
        return sum(r.num_accepted_tokens for r in self.requests)

    @property
    def num_scheduled_tokens(self) -> int:
        """The token budget used."""
        return sum(self.num_new_tokens)

    @property
    def resumed(self) -> list[str]:
        """Requests re-admitted in this step after an earlier preemption."""
        return [a.request_id for a in self.admitted if a.resumed]

    @property
    def prefix_hits(self) -> dict[str, int]:
        """Cached tokens of the requests admitted in this step with a prefix-cache hit."""
        return {a.request_id: a.num_cached_tokens for a in self.admitted if a.num_cached_tokens}


def recent_step_records(records: Sequence[StepRecord], after: int, limit: int | None = None) -> list[StepRecord]:
    """The newest ``limit`` (None: all) records with ``step_id > after``, oldest first
    (``records`` are in step order, as ``EngineCore.step_records`` keeps them)."""
    newest: list[StepRecord] = []
    for record in reversed(records):
        if record.step_id <= after or len(newest) == limit:
            break
        newest.append(record)
    return newest[::-1]

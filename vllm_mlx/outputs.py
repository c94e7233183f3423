"""Plain-data types that cross layers within one engine step.

The scheduler builds a ``SchedulerOutput`` (the ``ScheduledRequest``s of a step), the model runner
answers with a ``ModelRunnerOutput`` (sampled tokens, their ``TokenLogprobs``, per-request errors)
and leaves a ``StepRecord`` of what it ran. Every layer may import this module: it holds data and
cheap derived properties only, no behaviour, and imports nothing but ``request`` (plain data too).
``scheduler`` and ``model_runner`` re-export these names, where they used to live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mlx.request import Request


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

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled.
        A prefill chunk that stops short of the prompt's end samples nothing."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runner executes in one step."""

    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    """Requests preempted while building this step (their blocks are already freed)."""

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
class ModelRunnerOutput:
    """Sampled tokens of one step, keyed by request id (only requests whose step samples)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Requests whose work failed in the runner (e.g. the vision encoder rejected an image):
    they were left out of the forward and finish with FINISHED_ERROR; the batch goes on."""


@dataclass
class StepRecord:
    """What one step ran (observers and tests read these; cheap plain data)."""

    step_id: int
    request_ids: list[str]
    num_new_tokens: list[int]
    num_forward_calls: int

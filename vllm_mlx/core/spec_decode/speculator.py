"""The engine's speculation: before each step, the proposals of the requests that decode next.

``Speculator.propose`` runs before ``Scheduler.schedule``: for each running request whose next
step decodes (its one unverified token is its last), it finds up to ``num_speculative_tokens``
proposed tokens, lets the policy (``policy.py``) choose how many the batch verifies, and leaves
them in ``Request.spec_token_ids``; the scheduler takes what its budget allows.
``Speculator.observe`` reads each verification after the step, for the policy.

Two proposers: n-gram lookup (``ngram.py``), which finds its proposals first and lets the policy
cut them; and a draft model (a ``Drafter``: ``engine/draft_model.py``), whose proposals cost
forwards, so the policy chooses the lengths first (pricing the draft's forwards) and the draft
then proposes just that many.

Requests with a structured-output constraint or a reasoning gate do not speculate: their next
token's mask depends on the tokens before it, which the runner builds for known tokens only.
"""

from __future__ import annotations

from typing import Protocol

from vllm_mlx.core.outputs import ModelRunnerOutput
from vllm_mlx.core.request import Request, RequestStatus
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.core.spec_decode.ngram import Lookup, NgramProposer
from vllm_mlx.core.spec_decode.policy import DRAFT_PRIOR, AcceptanceEstimate, choose_lengths, step_cost


class Drafter(Protocol):
    """A model that proposes tokens by decoding greedily ahead of its target."""

    cost_ratio: float
    """One draft forward over some rows, relative to a target decode step of those rows."""

    def draft(self, requests: list[Request], lengths: list[int]) -> list[list[int]]:
        """Up to ``lengths[i]`` proposed tokens to follow ``requests[i]``'s tokens (none for 0)."""
        ...

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget the draft's state of every request not in ``request_ids``."""
        ...


class Speculator:
    """Proposals and acceptance estimates for one engine (n-gram lookup, or ``drafter``)."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None, by_default: bool = True) -> None:
        self.config = config
        self.by_default = by_default
        """Whether requests that do not say (``Request.speculative is None``) speculate: True for
        the engine's ``speculative_config``, False for the lookup made for requests that ask."""
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        self.drafter = drafter
        self.estimates: dict[str, AcceptanceEstimate] = {}

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of the running requests that decode next (others: none)."""
        decoding = [r for r in running if speculates(r) and self.wanted_by(r)]
        for request in running:
            request.spec_token_ids = []
        self.estimates = {r.request_id: self.estimates.get(r.request_id) or AcceptanceEstimate() for r in decoding}
        limits = [room_for_proposals(r, self.config.num_speculative_tokens) for r in decoding]
        estimates = [self.estimates[r.request_id] for r in decoding]
        if self.drafter is not None:
            rates = [estimate.rate_from(DRAFT_PRIOR) for estimate in estimates]
            lengths, cost = limits, self.drafter.cost_ratio
        else:
            lookups = [self.proposer.lookup(r.all_token_ids) if n else NO_LOOKUP for r, n in zip(decoding, limits)]
            proposals = [lookup.token_ids[:n] for lookup, n in zip(lookups, limits)]
            rates = [estimate.rate(lookup.match_len) for estimate, lookup in zip(estimates, lookups)]
            lengths, cost = [len(p) for p in proposals], 0.0
        if self.config.adaptive and decoding:
            lengths = choose_lengths(rates, lengths, len(running) - len(decoding), cost * step_cost(len(decoding), 1))
        if self.drafter is not None:
            proposals = self.drafter.draft(decoding, lengths)
        for request, proposal, n in zip(decoding, proposals, lengths):
            request.spec_token_ids = proposal[:n]

    def observe(self, runner_output: ModelRunnerOutput) -> None:
        """Learn each request's acceptance from the step just run (one that verified nothing:
        its estimate fades towards the prior)."""
        for request_id, estimate in self.estimates.items():
            verdict = runner_output.drafts.get(request_id)
            if verdict is None:
                estimate.record(0, 0)
            else:
                estimate.record(verdict.num_proposed, verdict.num_accepted)


    def wanted_by(self, request: Request) -> bool:
        return self.by_default if request.speculative is None else request.speculative

    def settle(self, running: list[Request]) -> None:
        """After a step or an abort: forget the draft's state of requests that no longer run
        (finished, aborted or preempted), so that its pool holds only running requests' blocks."""
        if self.drafter is not None:
            self.drafter.keep_only({r.request_id for r in running})


NO_LOOKUP = Lookup([], 0)


def speculates(request: Request) -> bool:
    """Whether ``request``'s next step may verify proposals: it decodes (one unverified token,
    its last) and no constraint or reasoning gate masks its tokens."""
    return (
        request.status == RequestStatus.RUNNING
        and request.num_computed_tokens == request.num_tokens - 1
        and request.constraint is None
        and request.reasoning_gate is None
    )


def room_for_proposals(request: Request, most: int) -> int:
    """Proposals worth making: the step's sampled token always comes too, so at most
    ``max_tokens - 1`` more than the output so far."""
    return max(0, min(most, request.sampling_params.max_tokens - request.num_output_tokens - 1))

"""The engine's speculation: before each step, the proposals of the requests that decode next.

``Speculator.propose`` runs before ``Scheduler.schedule``: for each running request whose next
step decodes (its one unverified token is its last), it asks the proposer for up to
``num_speculative_tokens`` tokens, lets the policy (``policy.py``) choose how many the batch
verifies, and leaves them in ``Request.spec_token_ids``; the scheduler takes what its budget
allows. ``Speculator.observe`` reads each verification after the step, for the policy.

Requests with a structured-output constraint or a reasoning gate do not speculate: their next
token's mask depends on the tokens before it, which the runner builds for known tokens only.
"""

from __future__ import annotations

from vllm_mlx.core.outputs import ModelRunnerOutput
from vllm_mlx.core.request import Request, RequestStatus
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.core.spec_decode.ngram import Lookup, NgramProposer
from vllm_mlx.core.spec_decode.policy import AcceptanceEstimate, choose_lengths


class Speculator:
    """Proposals and acceptance estimates for one engine (n-gram lookup)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        self.estimates: dict[str, AcceptanceEstimate] = {}

    def propose(self, running: list[Request]) -> None:
        """Set ``spec_token_ids`` of the running requests that decode next (others: none)."""
        decoding = [r for r in running if speculates(r)]
        for request in running:
            request.spec_token_ids = []
        self.estimates = {r.request_id: self.estimates.get(r.request_id) or AcceptanceEstimate() for r in decoding}
        limits = [room_for_proposals(r, self.config.num_speculative_tokens) for r in decoding]
        lookups = [self.proposer.lookup(r.all_token_ids) if n else NO_LOOKUP for r, n in zip(decoding, limits)]
        proposals = [lookup.token_ids[:n] for lookup, n in zip(lookups, limits)]
        lengths = [len(p) for p in proposals]
        if self.config.adaptive and decoding:
            rates = [self.estimates[r.request_id].rate(lookup.match_len) for r, lookup in zip(decoding, lookups)]
            lengths = choose_lengths(rates, lengths, len(running) - len(decoding))
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

"""Verifying proposed tokens inside the batch (speculative decoding, issue #28).

A row that verifies ``k`` proposed tokens computed ``k + 1`` positions: its last known token and
the proposals. Each position is sampled exactly as decoding without speculation would sample it
had the proposals before it been the request's own tokens: the same seed, the step index they
would give, the penalties over that history, ``min_tokens`` counted with it (``sampling_row``).
The walk then keeps proposals while each equals the token sampled at its position, and the
token sampled at the first difference (or after the last proposal) comes last.

So the output is token for token the output without speculation, greedy or sampled, for any
proposal; and for a proposal that is a point mass (n-gram lookup) this is speculative sampling's
accept/reject rule itself (``core/spec_decode/rejection.py``): a proposed token ``x`` is kept
with probability ``p(x)``, and a rejection's token is drawn from ``p`` without ``x``,
renormalised, which is the residual ``max(p - q, 0)`` when ``q`` is the point mass at ``x``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from vllm_mlx.core.outputs import DraftVerdict, ScheduledRequest, TokenLogprobs
from vllm_mlx.core.request import Request
from vllm_mlx.executor.sampling import SamplerOutput, SamplingRow, sampling_row


@dataclass
class VerificationPlan:
    """The sampled positions of a step's rows, in the order their hidden states were picked:
    one per row, ``k + 1`` for a row verifying ``k`` proposals."""

    items: list[ScheduledRequest]
    requests: list[Request]
    """Per position, its request (a constraint's mask is per position; verifying rows have none)."""
    sampling_rows: list[SamplingRow]

    @classmethod
    def of(cls, sampled: list[ScheduledRequest]) -> VerificationPlan:
        requests, rows = [], []
        for item in sampled:
            for num_proposed in range(len(item.spec_token_ids) + 1):
                requests.append(item.request)
                rows.append(sampling_row(item, num_proposed))
        return cls(sampled, requests, rows)

    def per_request(
        self, result: SamplerOutput
    ) -> Iterator[tuple[ScheduledRequest, list[int], list[TokenLogprobs | None]]]:
        """Each row with the tokens (and logprobs) sampled at its positions."""
        first = 0
        for item in self.items:
            n = len(item.spec_token_ids) + 1
            yield item, result.token_ids[first : first + n], result.logprobs[first : first + n]
            first += n


def verify_proposals(
    proposed: list[int], sampled: list[int], logprobs: list[TokenLogprobs | None]
) -> DraftVerdict:
    """Keep the proposals while each equals the token sampled at its position (``sampled`` has
    one more entry: the position after the last proposal)."""
    if len(sampled) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} sampled positions")
    kept = 0
    while kept < len(proposed) and proposed[kept] == sampled[kept]:
        kept += 1
    return DraftVerdict(len(proposed), list(sampled[:kept]), list(logprobs[:kept]))

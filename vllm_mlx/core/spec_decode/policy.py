"""How many proposed tokens each request verifies in the next step: measured, not guessed.

A decode step costs what its rows and positions cost (``STEP_MS``, measured on our engine): with
few it is bound by reading the weights and an extra position is almost free; with many it is
bound by compute and each position costs its share. A request whose proposals are accepted at
rate ``a`` gains ``a ** j`` expected tokens from its ``j``-th proposal (it counts only if every
earlier one was kept). The decode rows share one padded forward, so the batch's proposals are
chosen together: the width (one plus the most proposals any row verifies) with the most expected
tokens per unit of cost wins. A lone stream with a good guess takes many; a batch of 32 takes
few or none, and speculation then costs nothing (the back-off the issue asks for).

Each request's rate is estimated from its own verifications (``AcceptanceEstimate``: accepted
over decided proposals, recent steps weighing more) and a prior that regains its weight while a
request does not speculate. For a draft model the prior is ``DRAFT_PRIOR``. For n-gram lookup two
pieces of evidence meet: how often a match of this length is right (``MATCH_PRIOR``), and how
often this request's proposals were kept; they are added in log-odds (``AcceptanceEstimate.rate``),
so a long match in a request that is copying is trusted most, and a one-token match is tried
only where the request has been copying.

A draft model's proposals cost forwards of their own: one per proposed position, over the rows
that speculate. The caller prices them (``proposal_cost``) in the same unit as ``step_cost``, so a
draft that is slow next to its target proposes few tokens or none.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

STEP_MS: dict[int, dict[int, float]] = {
    1: {1: 55.8, 2: 62.5, 3: 65.4, 4: 91.2, 5: 92.9, 6: 96.9, 7: 112.6, 8: 116.3},
    8: {1: 131.6, 2: 141.9, 3: 156.3, 4: 175.0, 5: 184.6, 6: 200.6, 7: 211.6, 8: 201.3},
    32: {1: 235.1, 2: 264.2, 3: 327.1, 4: 397.5, 5: 483.8, 6: 581.7, 7: 690.0, 8: 742.9},
}
"""Our engine's decode step in ms, by rows (B) and positions per row (W: one plus the proposals
verified): ``python bench/speculative_cost.py --engine --k 1 2 3 4 5 6 7 --repeats 5`` on the
default model, float32 weights, 256-token contexts, 2-core x86_64 (docs/benchmarks.md). Linear
between the measured points and beyond them along the last slope. Not smooth: at one row, a
fourth position costs more than the second and third together (the matmuls change kernels). On
Metal the weight read dominates for longer, so the costs grow more slowly and these figures err
on the side of speculating less."""

MATCH_PRIOR: tuple[float, ...] = (0.13, 0.42, 0.51, 0.90)
"""How often n-gram lookup's first proposed token is right, by the length of the tail it matched
(1, 2, 3, 4 or more tokens): ``python bench/speculative.py --match-table`` on the default model,
greedy, 128 tokens of each of its workloads (one-token matches are right 13% of the time, and
seldom pay; four-token ones 90%). A request's estimate starts here, per proposal."""
DRAFT_PRIOR = 0.6
"""A draft model's starting acceptance: the least at which the issue calls a draft worth running
(below it the draft's own forwards eat the gain). A request's own verifications outweigh it
after its first step or two, so a worse draft backs off quickly."""
PRIOR_WEIGHT = 1.0
"""The prior weighs as much as this many decided proposals of the request's own."""
MIN_GAIN = 1.03
"""Speculate only where the expected tokens per unit of cost beat plain decoding by this much:
the figures are noisy, and proposing and verifying cost some bookkeeping of their own."""
DECAY = 0.9
"""Each verification's counts weigh this much less at the next (about ten remembered):
acceptance changes within a request (a quoted passage ends)."""
IDLE_DECAY = 0.97
"""How the counts fade over a step without proposals, so that the prior regains its weight: a
request whose proposals all failed stops after three or four, and tries one proposal again
every dozen steps or so (a retry that fails costs about 1% of those steps' time alone)."""


def step_cost(rows: int, width: int) -> float:
    """The relative cost of a decode step of ``rows`` rows, each ``width`` positions (``STEP_MS``)."""
    sizes = sorted(STEP_MS)
    costs = [_interpolate(_never_cheaper(STEP_MS[b]), width) for b in sizes]
    return _interpolate(list(zip(sizes, costs)), rows) / STEP_MS[1][1]


def _never_cheaper(by_width: dict[int, float]) -> list[tuple[int, float]]:
    """The measured points by width, less any that cost less than a narrower one: a wider step
    computes all a narrower one does, so such a dip is noise in the measurement."""
    points: list[tuple[int, float]] = []
    for width, ms in sorted(by_width.items()):
        if not points or ms >= points[-1][1]:
            points.append((width, ms))
    return points


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise-linear through ``points`` (sorted by x), extended along the end segments."""
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect.bisect_left([p for p, _ in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class AcceptanceEstimate:
    """One request's acceptance rate, from its recent verifications and a prior.

    The counts fade every step, verified or not (``DECAY``, ``IDLE_DECAY``): a request whose
    proposals were all wrong stops speculating, and some steps later the prior has weight again,
    so it tries again (a chat that begins in its own words often quotes its input later)."""

    accepted: float = 0.0
    decided: float = 0.0

    def rate(self, match_len: int) -> float:
        """The expected acceptance of a proposal found by matching ``match_len`` tokens: the
        match length's prior and the request's own record (from an even start), added in
        log-odds as independent evidence. Either alone misleads: a request that has been copying
        keeps most 4-token matches but few 1-token ones (they mostly come where the copy ended),
        and one whose guesses failed should not trust even a long match as much as the table.
        Offline over ``bench/speculative.py``'s greedy runs this took the extraction workload
        from 1.77x to 1.87x (1.83x to 1.96x with seven proposals) for the same editing speed."""
        own = self.rate_from(0.5)
        return _probability(_log_odds(match_prior(match_len)) + _log_odds(own))

    def rate_from(self, prior: float) -> float:
        """The expected acceptance, starting from ``prior``."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.decided + PRIOR_WEIGHT)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """A step verified ``num_proposed`` tokens and kept the first ``num_accepted``: those
        were decided as kept, the next one (if any) as rejected; the rest were never decided.
        ``num_proposed == 0``: a step without speculation (the counts fade)."""
        decided = num_accepted + (1 if num_accepted < num_proposed else 0)
        decay = DECAY if num_proposed else IDLE_DECAY
        self.accepted = self.accepted * decay + num_accepted
        self.decided = self.decided * decay + decided


def _log_odds(rate: float) -> float:
    rate = min(max(rate, 1e-6), 1 - 1e-6)  # a prior or record of 0 or 1 must not be infinite
    return math.log(rate / (1 - rate))


def _probability(log_odds: float) -> float:
    return 1 / (1 + math.exp(-log_odds))


def match_prior(match_len: int) -> float:
    """``MATCH_PRIOR`` for an n-gram match of ``match_len`` tokens."""
    return MATCH_PRIOR[min(max(match_len, 1), len(MATCH_PRIOR)) - 1]


def choose_lengths(
    rates: list[float], available: list[int], num_other_rows: int = 0, proposal_cost: float = 0.0
) -> list[int]:
    """How many proposed tokens each decoding row verifies (at most ``available[i]``), for the
    most expected tokens per unit of step cost. ``num_other_rows``: decode rows that do not
    speculate (they share the forward). ``proposal_cost``: what making one more proposed token
    for every speculating row costs, in ``step_cost``'s unit (0: n-gram lookup, no model).

    The runner pads the decode rows of a step to its widest (one forward call), so a step costs
    what ``rows x width`` positions cost, however the proposals spread: the choice is the width,
    and within it every row verifies what it has (the padding is computed anyway)."""
    rows = len(rates) + num_other_rows
    best_width, best_value = 1, 1.0  # tokens per unit of cost, relative to plain decoding
    plain = rows / step_cost(rows, 1)
    for width in range(2, max(available, default=0) + 2):
        expected = num_other_rows + sum(_expected(rate, min(width - 1, n)) for rate, n in zip(rates, available))
        value = expected / (step_cost(rows, width) + (width - 1) * proposal_cost) / plain
        if value > best_value * (MIN_GAIN if best_width == 1 else 1.0):
            best_width, best_value = width, value
    return [min(best_width - 1, n) for n in available]


def _expected(rate: float, k: int) -> float:
    """Tokens a row yields verifying ``k`` proposals kept at ``rate`` each: the sampled one, and
    proposal ``j`` when it and every earlier one was kept."""
    return sum(rate**j for j in range(k + 1))

"""Speculative decoding's adaptive policy and proposals (no model): how many proposed tokens a
request verifies, from its measured acceptance and the batch's measured step cost."""

from __future__ import annotations

import pytest

from vllm_mlx.core.outputs import DraftVerdict, ModelRunnerOutput
from vllm_mlx.core.request import Request, RequestStatus, SamplingParams
from vllm_mlx.core.spec_decode.config import SpeculativeConfig
from vllm_mlx.core.spec_decode.policy import (
    DRAFT_PRIOR,
    MATCH_PRIOR,
    STEP_MS,
    AcceptanceEstimate,
    choose_lengths,
    step_cost,
)
from vllm_mlx.core.spec_decode.speculator import Speculator


def test_step_cost_follows_the_measured_points_and_extends_their_last_slopes():
    for rows, by_width in STEP_MS.items():
        for width, ms in by_width.items():
            if ms >= max(v for w, v in by_width.items() if w <= width):  # else a dip: noise, left out
                assert step_cost(rows, width) == pytest.approx(ms / STEP_MS[1][1])
    last, before = STEP_MS[1][8], STEP_MS[1][7]
    assert step_cost(1, 10) == pytest.approx((last + 2 * (last - before)) / STEP_MS[1][1])
    assert step_cost(20, 1) == pytest.approx((STEP_MS[8][1] + STEP_MS[32][1]) / 2 / STEP_MS[1][1])
    for rows in (1, 4, 8, 20, 32, 64):
        costs = [step_cost(rows, w) for w in range(1, 12)]
        assert all(wider > narrower for narrower, wider in zip(costs, costs[1:]))  # more positions cost more
    assert step_cost(64, 1) > step_cost(32, 1)


def expected_speedup(rates: list[float], lengths: list[int]) -> float:
    """Expected tokens per unit of cost over plain decoding (one padded call)."""
    tokens = sum(sum(rate**j for j in range(n + 1)) for rate, n in zip(rates, lengths))
    rows = len(rates)
    return tokens / step_cost(rows, 1 + max(lengths)) * step_cost(rows, 1) / rows


def test_a_lone_stream_speculates_more_as_its_proposals_are_kept_more():
    lengths = [choose_lengths([rate], [8])[0] for rate in (0.05, 0.3, 0.6, 0.9, 0.99)]
    assert lengths[0] == 0 and lengths == sorted(lengths) and lengths[-1] == 8


@pytest.mark.parametrize("rows", [8, 32])
def test_a_large_batch_backs_off_and_never_expects_a_loss(rows):
    for rate in (0.05, 0.1, 0.3, 0.5, 0.7, 0.9):
        lengths = choose_lengths([rate] * rows, [8] * rows)
        assert expected_speedup([rate] * rows, lengths) >= 1.0 - 1e-9
    assert choose_lengths([0.1] * 32, [8] * 32) == [0] * 32
    assert max(choose_lengths([0.7] * 32, [8] * 32)) < choose_lengths([0.7], [8])[0] * 2


def test_one_width_for_the_batch_and_every_row_fills_it():
    """The decode rows share one padded call: a row's proposals inside the width cost nothing."""
    lengths = choose_lengths([0.95, 0.1, 0.6], [6, 6, 2])
    assert lengths[0] == lengths[1] > 0 and lengths[2] == 2
    assert choose_lengths([0.95, 0.95], [2, 0]) == [2, 0]  # what a row has to offer is its limit
    assert choose_lengths([0.1, 0.1], [6, 6], num_other_rows=30) == [0, 0]


def test_a_draft_models_forwards_are_priced():
    """A draft model proposes with one forward per proposed position: a small draft at its
    prior speculates; one as large as its target, or a small one whose proposals fail, does not."""
    small, same_size = 0.05 * step_cost(1, 1), 1.0 * step_cost(1, 1)
    assert choose_lengths([DRAFT_PRIOR], [4], proposal_cost=small)[0] >= 2
    assert choose_lengths([0.95], [4], proposal_cost=same_size) == [0]
    assert choose_lengths([0.1], [4], proposal_cost=small) == [0]
    # Drafting costs less per row in a batch: a batch of 8 small-draft rows still gains.
    rows = 8
    batch = choose_lengths([0.8] * rows, [4] * rows, proposal_cost=0.05 * step_cost(rows, 1))
    assert max(batch) >= 1


def test_the_estimate_learns_from_verifications_and_fades_back_to_the_prior():
    estimate = AcceptanceEstimate()
    assert [estimate.rate(n) for n in (1, 2, 3, 4, 9)] == pytest.approx([*MATCH_PRIOR, MATCH_PRIOR[-1]])  # the prior
    for _ in range(6):
        estimate.record(4, 0)  # every first proposal rejected
    assert estimate.rate(3) < 0.1 and choose_lengths([estimate.rate(3)], [4]) == [0]
    for _ in range(30):
        estimate.record(0, 0)  # steps without speculation
    assert choose_lengths([estimate.rate(3)], [4]) == [1]  # it tries again
    for _ in range(6):
        estimate.record(4, 4)
    assert estimate.rate(1) > 0.5


def test_the_match_length_and_the_requests_record_are_both_evidence():
    """A request that has been copying trusts its matches more than the table does, a long one
    most; one whose guesses failed trusts them less; a one-token match is worth a try only
    where the request has been copying (a fresh one does not try it)."""
    copying, failing, fresh = AcceptanceEstimate(), AcceptanceEstimate(), AcceptanceEstimate()
    for _ in range(5):
        copying.record(4, 4)
        failing.record(4, 0)
    for match_len in (1, 2, 3, 4):
        assert failing.rate(match_len) < fresh.rate(match_len) < copying.rate(match_len)
    assert copying.rate(1) < copying.rate(2) < copying.rate(4) and copying.rate(4) > 0.98
    assert choose_lengths([fresh.rate(1)], [4]) == [0] and choose_lengths([copying.rate(1)], [4])[0] > 0
    assert choose_lengths([failing.rate(4)], [4])[0] < choose_lengths([fresh.rate(4)], [4])[0]


def running(rid: str, prompt: list[int], output: list[int], **params) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=params.pop("max_tokens", 50), **params))
    request.output_token_ids = list(output)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_the_speculator_proposes_lookups_within_the_request_room():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, adaptive=False))
    copying = running("a", [5, 6, 7, 8, 9, 5, 6], [])
    near_end = running("b", [5, 6, 7, 8, 9, 5, 6], [1], max_tokens=3)
    prefilling = running("c", [5, 6, 7, 5, 6], [])
    prefilling.num_computed_tokens = 2
    speculator.propose([copying, near_end, prefilling])
    assert copying.spec_token_ids == [7, 8, 9]
    assert near_end.spec_token_ids == []  # "1" never occurred before
    near_end.output_token_ids = [9]
    speculator.propose([near_end])
    assert near_end.spec_token_ids == [5]  # max_tokens 3: one output, one proposal, the sampled one
    assert prefilling.spec_token_ids == []


def test_the_adaptive_speculator_mostly_stops_proposing_to_a_request_whose_guesses_fail():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    request = running("a", [5, 6, 7, 8, 9, 5, 6], [])
    lengths = []
    for _ in range(40):
        speculator.propose([request])
        lengths.append(len(request.spec_token_ids))
        verdict = {"a": DraftVerdict(lengths[-1], [])} if lengths[-1] else {}
        speculator.observe(ModelRunnerOutput(drafts=verdict))
    assert lengths[0] == 2 and sum(lengths[10:]) <= 3 and max(lengths[10:]) == 1  # a retry now and then
    speculator.propose([])
    assert speculator.estimates == {}  # a request that no longer runs is forgotten

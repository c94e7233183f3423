"""How the runner groups a step's rows into forward calls (``group_for_padding``).

A call reads every weight once however few rows it has, and a padded row computes its padding:
the grouping minimises padded tokens plus ``CALL_COST_TOKENS`` per call. Pure bookkeeping: no
model runs here.
"""

from __future__ import annotations

import itertools
import random

from vllm_mlx.core.request import Request
from vllm_mlx.core.sched.scheduler import ScheduledRequest
from vllm_mlx.executor.model_runner import CALL_COST_TOKENS, group_for_padding

C = CALL_COST_TOKENS


def rows(lengths: list[int]) -> list[ScheduledRequest]:
    return [
        ScheduledRequest(Request(f"r{i}", [1] * n), num_computed_tokens=0, num_new_tokens=n, block_ids=[1])
        for i, n in enumerate(lengths)
    ]


def lengths_of(groups: list[list[ScheduledRequest]]) -> list[list[int]]:
    return [[item.num_new_tokens for item in group] for group in groups]


def cost(groups: list[list[int]]) -> int:
    return sum(C + len(g) * max(g) for g in groups)


def test_decodes_share_one_call_and_a_few_token_chunk_joins_them():
    assert lengths_of(group_for_padding(rows([1] * 8))) == [[1] * 8]
    assert lengths_of(group_for_padding(rows([1, 3, 1, 1]))) == [[3, 1, 1, 1]]


def test_a_row_is_padded_only_when_that_costs_less_than_a_call_of_its_own():
    long = 200
    assert lengths_of(group_for_padding(rows([long - C + 8, long]))) == [[long, long - C + 8]]
    assert lengths_of(group_for_padding(rows([long - C - 8, long]))) == [[long], [long - C - 8]]


def test_without_padding_only_rows_of_equal_length_share_a_call():
    groups = lengths_of(group_for_padding(rows([1, 5, 3, 5, 1]), pad=False))
    assert groups == [[5, 5], [3], [1, 1]]


def test_the_grouping_is_the_cheapest_split_of_the_rows_sorted_by_length():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([1, 1, 1, 2, 7, 16, 30, 64, 100, 128, 160]) for _ in range(rng.randint(1, 12))]
        groups = lengths_of(group_for_padding(rows(lengths)))
        flat = [n for g in groups for n in g]
        assert flat == sorted(lengths, reverse=True)  # every row once, longest first
        ordered = sorted(lengths, reverse=True)
        splits = (
            [ordered[a:b] for a, b in zip((0, *cuts), (*cuts, len(ordered)))]
            for k in range(len(ordered))
            for cuts in itertools.combinations(range(1, len(ordered)), k)
        )
        assert cost(groups) == min(cost(s) for s in splits)


def verifying(num_proposed: list[int]) -> list[ScheduledRequest]:
    """Decode rows, each verifying ``num_proposed[i]`` proposed tokens (speculative decoding)."""
    return [
        ScheduledRequest(Request(f"d{i}", [1, 2]), 1, 1 + k, [1], spec_token_ids=[3] * k)
        for i, k in enumerate(num_proposed)
    ]


def test_decode_rows_verifying_proposals_always_share_one_call():
    """The speculation policy prices a step as rows x the widest decode row: it must be so."""
    groups = group_for_padding(verifying([7] + [0] * 31))
    assert [len(g) for g in groups] == [32]
    long_chunk = rows([300])
    groups = group_for_padding(verifying([4, 0, 2]) + long_chunk)
    assert sorted(len(g) for g in groups) == [1, 3]
    groups = group_for_padding(verifying([4, 0, 2]), pad=False)  # a model that cannot pad
    assert sorted(len(g) for g in groups) == [1, 1, 1]

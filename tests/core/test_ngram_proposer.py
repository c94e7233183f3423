"""n-gram prompt lookup against a brute-force statement of its rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_mlx.core.spec_decode.ngram import NgramProposer


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """The rule spelled out: the longest tail that occurred earlier, its latest occurrence, the
    tokens after it (and the tail's length)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k], n
    return [], 0


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),  # a small alphabet: many repeats
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 6),
)
def test_proposal_follows_the_rule(tokens, min_n, extra, k):
    proposer = NgramProposer(min_n=min_n, max_n=min_n + extra, num_tokens=k)
    found = proposer.lookup(tokens)
    assert (found.token_ids, found.match_len) == brute_force(tokens, min_n, min_n + extra, k)
    assert proposer.propose(tokens) == found.token_ids


def test_an_edit_copies_the_text_it_was_given():
    text = [11, 12, 13, 14, 15, 16, 17, 18]
    context = [1, *text, 2, 3, *text[:3]]  # the answer has started to copy the text
    assert NgramProposer(min_n=2, max_n=3, num_tokens=4).propose(context) == [14, 15, 16, 17]


def test_longer_tails_win_and_the_latest_occurrence_of_them():
    # "7 8" occurs twice before the tail; "6 7 8" once, at the start: the longer tail wins.
    context = [6, 7, 8, 1, 7, 8, 2, 6, 7, 8]
    assert NgramProposer(min_n=2, max_n=3, num_tokens=1).propose(context) == [1]
    assert NgramProposer(min_n=2, max_n=2, num_tokens=1).propose(context) == [2]  # the latest "7 8"


def test_nothing_to_propose():
    proposer = NgramProposer(min_n=2, max_n=3, num_tokens=3)
    assert proposer.propose([]) == [] and proposer.propose([5]) == []
    assert proposer.propose([1, 2, 3, 4]) == []  # no tail repeats
    assert proposer.propose([9, 9, 9]) == [9]  # a run predicts itself, as far as the context goes


@pytest.mark.parametrize("kwargs", [{"min_n": 0}, {"min_n": 3, "max_n": 2}, {"num_tokens": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)

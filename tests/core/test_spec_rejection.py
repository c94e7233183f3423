"""Speculative sampling keeps the target's distribution, whatever is proposed; greedy keeps its tokens."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_mlx.core.spec_decode.rejection import accept_greedy, accept_sampled

V, K, N = 6, 3, 6000
CHI2_CRITICAL = 18.5  # chi-square, 4 degrees of freedom (5 possible tokens), p = 0.001


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def distributions(rng: np.random.Generator, rows: int) -> np.ndarray:
    p = rng.dirichlet(np.full(V, 0.7), size=rows)
    p[:, 0] = 0.0  # a token the target never emits: the residual must not bring it back
    return p / p.sum(-1, keepdims=True)


def run(target, proposal, draw_proposal, seed=0):
    """N independent speculative steps; returns the emitted sequences."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(N):
        proposed = draw_proposal(rng)
        out.append(accept_sampled(proposed, target, proposal, rng.random(K + 1)))
    return out


@pytest.mark.parametrize("proposer", ["draft", "point-mass"])
def test_emitted_tokens_follow_the_target(proposer):
    """The first emitted token follows target[0], whatever the proposals (a poor draft that even
    proposes a token the target excludes, or an n-gram guess)."""
    rng = np.random.default_rng(1)
    target = distributions(rng, K + 1)
    if proposer == "draft":
        proposal = rng.dirichlet(np.ones(V), size=K)
        sequences = run(target, proposal, lambda r: [int(r.choice(V, p=proposal[i])) for i in range(K)])
    else:
        sequences = run(target, None, lambda r: [1, 2, 3])
    first = np.bincount([s[0] for s in sequences], minlength=V)
    assert chi_square(first, target[0]) < CHI2_CRITICAL


def test_after_a_kept_guess_the_next_token_follows_the_target():
    """Given the n-gram guess 1 was kept, the second token follows target[1] (the target's row
    after that prefix): kept or replaced, the second position keeps the target's distribution."""
    target = distributions(np.random.default_rng(5), K + 1)
    sequences = run(target, None, lambda r: [1, 2, 3], seed=6)
    second = np.bincount([s[1] for s in sequences if s[0] == 1 and len(s) >= 2], minlength=V)
    assert second.sum() > 500
    assert chi_square(second, target[1]) < CHI2_CRITICAL


def test_a_perfect_draft_is_always_kept():
    rng = np.random.default_rng(2)
    target = distributions(rng, K + 1)
    lengths = [len(s) for s in run(target, target[:K], lambda r: [int(r.choice(V, p=target[i])) for i in range(K)])]
    assert set(lengths) == {K + 1}


def test_a_proposal_the_target_excludes_is_never_kept():
    target = distributions(np.random.default_rng(3), K + 1)  # token 0 has probability 0
    for u in np.linspace(0, 0.999, 50):
        emitted = accept_sampled([0, 0, 0], target, None, np.full(K + 1, u))
        assert len(emitted) == 1 and emitted[0] != 0


def test_the_same_uniforms_give_the_same_tokens():
    rng = np.random.default_rng(4)
    target, uniforms = distributions(rng, K + 1), rng.random(K + 1)
    assert accept_sampled([1, 2, 3], target, None, uniforms) == accept_sampled([1, 2, 3], target, None, uniforms)


@pytest.mark.parametrize(
    "proposed, argmax, emitted",
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all kept, plus the target's next token
        ([5, 9, 7], [5, 6, 7, 8], [5, 6]),  # the first difference: the target's token, then stop
        ([4, 6, 7], [5, 6, 7, 8], [5]),
        ([], [3], [3]),  # no proposal: plain decoding
    ],
)
def test_greedy_keeps_what_plain_decoding_would_emit(proposed, argmax, emitted):
    assert accept_greedy(proposed, argmax) == emitted


def test_row_counts_are_checked():
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError):
        accept_sampled([1, 2], np.full((2, V), 1 / V), None, np.zeros(3))

"""Which proposed tokens a request keeps: speculative sampling's accept/reject rule.

The target model scored the request's last token and the ``k`` proposed ones in one forward:
``target[i]`` is its next-token distribution after the first ``i`` proposed tokens (``k + 1``
rows). Proposed token ``i`` was drawn from ``proposal[i]`` (a draft model's distribution; an
n-gram guess is a point mass on the token). Walking the proposals in order, token ``x`` is kept
with probability ``min(1, target[i][x] / proposal[i][x])``; the first rejected one is replaced by
a draw from the residual ``max(target[i] - proposal[i], 0)`` (normalised) and the walk stops;
when every proposal is kept, one more token is drawn from ``target[k]``. Each emitted token is
then distributed exactly as the target alone would have sampled it (Leviathan et al., "Fast
Inference from Transformers via Speculative Decoding", 2023; Chen et al., "Accelerating Large
Language Model Decoding with Speculative Sampling", 2023), whatever the proposals were: they only
decide how many tokens one forward yields.

Greedy requests (temperature 0) take the argmax rows instead (``accept_greedy``): a proposal is
kept while it equals the target's argmax, so the output is token for token what decoding without
speculation gives.

The randomness is passed in (``uniforms``: ``k + 1`` numbers in [0, 1) from the request's own
seeded stream), so a request's seed still fixes its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def accept_greedy(proposed: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits: the proposals that equal the target's argmax, then the
    target's own token at the first difference (or after the last proposal)."""
    if len(target_argmax) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} target rows")
    emitted = []
    for token, best in zip(proposed, target_argmax):
        emitted.append(int(best))
        if token != best:
            return emitted
    emitted.append(int(target_argmax[-1]))
    return emitted


def accept_sampled(
    proposed: Sequence[int], target: np.ndarray, proposal: np.ndarray | None, uniforms: np.ndarray
) -> list[int]:
    """The tokens a sampled request emits (at least one, at most ``k + 1``).

    ``target``: (k + 1, vocab) probabilities after each prefix; ``proposal``: (k, vocab)
    probabilities the proposed tokens were drawn from, or None for point masses (n-gram lookup);
    ``uniforms``: k + 1 numbers in [0, 1), one per decision.
    """
    k = len(proposed)
    if target.shape[0] != k + 1 or len(uniforms) < k + 1:
        raise ValueError(f"{k} proposed tokens need {k + 1} target rows and {k + 1} uniforms")
    emitted = []
    for i, token in enumerate(proposed):
        q = _point_mass(token, target.shape[1]) if proposal is None else proposal[i]
        p = target[i]
        if q[token] > 0 and uniforms[i] * q[token] < p[token]:  # kept: u < p(x) / q(x)
            emitted.append(int(token))
            continue
        emitted.append(_draw(np.maximum(p - q, 0.0), uniforms[k]))
        return emitted
    emitted.append(_draw(target[k], uniforms[k]))
    return emitted


def _point_mass(token: int, vocab: int) -> np.ndarray:
    q = np.zeros(vocab)
    q[token] = 1.0
    return q


def _draw(weights: np.ndarray, uniform: float) -> int:
    """Inverse-CDF draw from unnormalised ``weights`` (all zero: impossible for a residual,
    since target and proposal would then be equal and the token kept)."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    if cumulative[-1] <= 0:
        raise ValueError("nothing to draw from: the weights are all zero")
    return int(min(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"), len(weights) - 1))

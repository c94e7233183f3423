"""n-gram prompt lookup: propose the tokens that followed the last time the context's tail appeared.

A request's tokens so far (prompt, then output) often repeat their own earlier stretches: an edit
copies most of the text it was given, an extraction quotes it, code refers back to its names.
When the last ``n`` tokens occurred before, the tokens that followed them then are a free guess
at what follows now. No model runs; the target verifies the guess (every accepted token is one
the target itself would have produced, so output never changes).

The rule (vLLM's ``prompt_lookup_min``/``prompt_lookup_max``): try the longest tail first, from
``max_n`` down to ``min_n`` tokens; the first length that occurred earlier wins, and of its
earlier occurrences the most recent one (it reflects the latest copy, e.g. a text edited twice);
propose up to ``num_tokens`` of the tokens that followed it, fewer where the context ends first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to ``num_tokens`` tokens by matching a tail of ``min_n`` to ``max_n`` tokens."""

    min_n: int = 1
    max_n: int = 4
    num_tokens: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.min_n} and {self.max_n}")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")

    def propose(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        """The proposal for what follows ``tokens`` (empty when no tail occurred before)."""
        return self.lookup(tokens).token_ids

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> Lookup:
        """The proposal and the length of the tail it matched (0: none matched)."""
        context = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            start = last_earlier_occurrence(context, n)
            if start is not None:
                follows = start + n
                return Lookup(context[follows : follows + self.num_tokens].tolist(), n)
        return Lookup([], 0)


@dataclass(frozen=True)
class Lookup:
    """A proposal and how it was found."""

    token_ids: list[int]
    match_len: int
    """How many tokens of the context's tail matched (longer matches are right more often)."""


def last_earlier_occurrence(context: np.ndarray, n: int) -> int | None:
    """Where the tail ``context[-n:]`` last began before itself, or None. An occurrence may
    overlap the tail (a run "a a a" predicts "a"), but must end before the context does, so that
    at least one token follows it."""
    if n < 1 or len(context) <= n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # every start but the tail's
    hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None

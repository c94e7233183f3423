"""The price of a prefill chunk in a step's token budget, attention included.

A step's budget (``max_num_batched_tokens``) counts tokens, but a prefill token does not cost
the same everywhere: its pass through the weights is fixed, while its attention reads every key
before it, so a chunk deep in a long prompt costs much more than one at its start (measured on
the CPU backend with SmolLM2-135M, docs/benchmarks.md: a 512-token chunk took 6 s at context 0
and 20-80 s past context 5,000; a 128-token chunk 2.6x as long at context 7,000 as at 0). Counted in tokens, the late chunks of a long prompt made every step that
carried one slow, and a stream decoding beside it waited that long for each token.

``PrefillCost`` charges a chunk of ``n`` tokens starting at context position ``p``

    n + floor(n * (p + n / 2) / attention_tokens)

budget units: one per token for its weights, plus its attention, which grows with the keys it
reads (``p + n / 2`` on average) and equals the weights' cost at ``attention_tokens`` keys.
The scheduler cuts each chunk to the budget left in these units, so every step costs about as
much as ``max_num_batched_tokens`` tokens at the start of a prompt, and a concurrent stream's
gap between tokens stays bounded whatever the prompt's length. Decode rows stay one unit each:
they must run every step, and the budget exists to keep prefill from crowding them out.
``attention_tokens == 0`` charges tokens only (the policy before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_PREFILL_ATTENTION_TOKENS = 1024
"""From the step times measured on the CPU backend with SmolLM2-135M (docs/benchmarks.md): the
context at which a chunk's time doubles was ~1,700 tokens for 128-token chunks and ~600-1,500
for 512-token ones (their attention scores outgrow the caches); the lower end keeps the gap
bounded for the budget's largest chunks."""


@dataclass(frozen=True)
class PrefillCost:
    attention_tokens: int
    """Keys at which a token's attention costs as much as its pass through the weights; 0 =
    a chunk costs its token count."""

    def cost(self, num_tokens: int, position: int) -> int:
        """Budget units of a chunk of ``num_tokens`` tokens whose first is at ``position``: the
        formula above, its attention part rounded down to whole units (so short contexts, where
        attention adds less than a token's worth, cost exactly their tokens)."""
        if not self.attention_tokens:
            return num_tokens
        return num_tokens + num_tokens * (2 * position + num_tokens) // (2 * self.attention_tokens)

    def fit(self, budget: int, position: int, remaining: int) -> int:
        """The longest chunk, up to ``remaining`` tokens, at ``position`` that costs at most
        ``budget``, but at least 1 token while any budget is left (so a prefill always moves)."""
        if budget <= 0 or remaining <= 0:
            return 0
        if not self.attention_tokens:
            return min(remaining, budget)
        # n^2 / (2L) + n (1 + p / L) = budget: its positive root, then exact integer steps
        scale = 1 + position / self.attention_tokens
        root = self.attention_tokens * (math.sqrt(scale * scale + 2 * budget / self.attention_tokens) - scale)
        num_tokens = max(1, min(remaining, math.floor(root)))
        while num_tokens > 1 and self.cost(num_tokens, position) > budget:
            num_tokens -= 1
        while num_tokens < remaining and self.cost(num_tokens + 1, position) <= budget:
            num_tokens += 1
        return num_tokens

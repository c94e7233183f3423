"""``ReasoningGate``: a thinking model's ``<think>...</think>`` is free; constraints start after it.

For models whose tokenizer has ``<think>`` and ``</think>`` as single tokens (Qwen3, QwQ,
DeepSeek-R1 and their distills, ...). Read from one completion's output tokens at every step (no
state to roll back on preemption, as ``RequestConstraint``):

- The completion *reasons* from the start when its prompt left a ``<think>`` open (templates that
  open it in the generation prompt), or from just after a ``<think>`` it wrote as its first token;
  until its first ``</think>``, no constraint applies.
- Its constraint then applies to the tokens after that ``</think>`` only. A completion that does
  not start by reasoning is constrained from its first token, where ``<think>`` is also allowed.
- ``max_thinking_tokens``: once the reasoning holds that many tokens, ``</think>`` is the only
  token allowed, which closes it (a budget of 0 closes it at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTokens:
    """The single-token ids of ``<think>`` and ``</think>``."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer) -> ThinkTokens | None:
        """The tokenizer's think tokens; None unless both are single tokens of its vocabulary."""
        ids = []
        for text in (THINK_START, THINK_END):
            try:
                encoded = tokenizer.encode(text, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot say has no think tokens
                return None
            if len(encoded) != 1 or tokenizer.decode(encoded) != text:
                return None
            ids.append(int(encoded[0]))
        return cls(*ids)

    def prompt_opens(self, prompt_token_ids: Sequence[int]) -> bool:
        """True if the prompt's last think token is an open ``<think>``."""
        for token in reversed(prompt_token_ids):
            if token in (self.start, self.end):
                return token == self.start
        return False


@dataclass(frozen=True)
class GatePhase:
    """What a completion's next token may be, as far as its reasoning goes."""

    constrain_from: int | None
    """Output index from which its constraint applies; None: no constraint this step (reasoning)."""
    force_token: int | None = None
    """The only token allowed (``</think>`` when the thinking budget is spent)."""
    also_allow: int | None = None
    """A token allowed besides the constraint's (``<think>`` as the first token)."""


@dataclass(frozen=True)
class ReasoningGate:
    """One completion's reasoning: where it starts (the prompt), its budget, its tokens."""

    tokens: ThinkTokens
    starts_in_reasoning: bool
    max_thinking_tokens: int | None = None

    def phase(self, output_token_ids: Sequence[int]) -> GatePhase:
        start = self._reasoning_start(output_token_ids)
        if start is None:
            also = self.tokens.start if not output_token_ids else None
            return GatePhase(constrain_from=0, also_allow=also)
        for i in range(start, len(output_token_ids)):
            if output_token_ids[i] == self.tokens.end:
                return GatePhase(constrain_from=i + 1)
        budget = self.max_thinking_tokens
        if budget is not None and len(output_token_ids) - start >= budget:
            return GatePhase(constrain_from=None, force_token=self.tokens.end)
        return GatePhase(constrain_from=None)

    def _reasoning_start(self, output_token_ids: Sequence[int]) -> int | None:
        """Output index where the reasoning text begins; None if the completion does not reason."""
        if self.starts_in_reasoning:
            return 0
        if output_token_ids and output_token_ids[0] == self.tokens.start:
            return 1
        return None

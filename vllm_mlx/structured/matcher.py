"""``RequestConstraint``: one completion's grammar state, kept equal to its accepted tokens.

The matcher holds state for the request's *accepted* output tokens only, and catches up lazily
(``sync``) right before its next mask is computed. So nothing has to advance it when the
scheduler appends a token, and nothing has to roll it back when the request is preempted (its
output tokens are kept and recomputed as prompt, the matcher's position is unchanged) or when a
failed step is re-run request by request (``sync`` is idempotent).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vllm_mlx.structured.grammar import CompiledGrammar, compact_error

ERROR_PREFIX = "structured output: "
"""Every constraint failure message starts with this (the server maps them to 400s)."""


class RequestConstraint:
    """The matcher of one completion (``n`` siblings each have their own).

    Args:
        compiled: The request's compiled grammar; this constraint advances a fresh copy.
        eos_token_ids: Tokens that end the completion: sampling one is only valid where the
            output is complete.
    """

    def __init__(self, compiled: CompiledGrammar, eos_token_ids: Collection[int]) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_consumed = 0
        """Output tokens the matcher has consumed."""
        self.error: str | None = None
        """Set once the matcher failed; the request must end with it."""

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    def sync(self, output_token_ids: Sequence[int]) -> str | None:
        """Consume the accepted tokens not consumed yet; return the error, if any."""
        if self.error is not None:
            return self.error
        count = len(output_token_ids)
        if count < self.num_consumed:  # tokens were taken back: undo them in the matcher too
            self.matcher.rollback(self.num_consumed - count)
            self.num_consumed = count
        if count > self.num_consumed:
            if not self.matcher.consume_tokens(list(output_token_ids[self.num_consumed :])):
                self.error = self._matcher_error()
            self.num_consumed = count
        return self.error

    def _matcher_error(self) -> str:
        why = compact_error(self.matcher.get_error())
        return f"{ERROR_PREFIX}the {self.compiled.kind} constraint failed: {why}"

    def check_sampled(self, token_id: int, allowed: bool, any_allowed: bool) -> str | None:
        """Why ``token_id`` (sampled from this step's masked logits) cannot be accepted, or None.

        ``allowed``: its bit in this step's mask; ``any_allowed``: whether the mask allows any
        token at all (only looked at when ``allowed`` is False).
        """
        kind = self.compiled.kind
        if allowed and token_id in self.eos_token_ids and not self.matcher.is_accepting():
            # llguidance allows EOS where the grammar cannot go on (e.g. a regex matching nothing)
            return f"{ERROR_PREFIX}the {kind} constraint admits no complete output from here"
        if self.matcher.is_error():  # computing this step's mask failed (e.g. a resource limit)
            return self._matcher_error()
        if not any_allowed:
            return f"{ERROR_PREFIX}no token can continue the output under the {kind} constraint"
        if not allowed:
            return (
                f"{ERROR_PREFIX}every token the {kind} constraint allows is excluded by other sampling "
                "settings (e.g. min_tokens forbids EOS where the output is complete)"
            )
        return None

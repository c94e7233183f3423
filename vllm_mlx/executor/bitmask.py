"""One step's token masks: fill the constrained rows' bitmasks, mask the batch's logits once.

``StepMasks.build(requests)`` syncs each constrained request's matcher with its accepted tokens
(those after its reasoning, see ``reasoning_gate``) and fills one ``[k, words]`` int32 bitmask
for the ``k`` masked rows (llguidance's executor, in parallel, off the GIL); a row whose
thinking budget is spent allows ``</think>`` alone. ``apply`` masks the ``[N, V]`` logits in one MLX
expression: disallowed tokens, and logits columns the tokenizer does not have (models pad their
vocabulary), become ``-inf``; rows without a constraint are not touched. After sampling,
``rejected`` names the requests whose token cannot be accepted (fail closed: they end with an
error; the batch goes on).

Runs on the engine thread, between the forward pass and sampling.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_mlx.core.request import Request
from vllm_mlx.structured.matcher import RequestConstraint

# Bit positions of a 32-bit mask word. NumPy, not MLX: an MLX array made at import is a lazy
# op on the importing thread's stream, and evaluating it on another engine thread fails
# ("There is no Stream(cpu, 1) in current thread") once that thread's streams are gone.
_SHIFTS = np.arange(32, dtype=np.uint32)
_executor = None
_executor_lock = threading.Lock()


def _mask_executor():
    """llguidance's thread pool for batch mask computation (one per process)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


@dataclass(frozen=True)
class RowMask:
    """How one batch row is masked this step: by its constraint (following ``tokens``), or
    by ``force_token`` alone (a thinking budget closing the reasoning)."""

    row: int
    constraint: RequestConstraint | None
    tokens: Sequence[int] = ()
    """The output tokens the constraint follows (those after the reasoning, if any)."""
    force_token: int | None = None
    also_allow: int | None = None
    """A token allowed besides the constraint's (``<think>`` as a thinking model's first token)."""

    @classmethod
    def of(cls, row: int, request: Request) -> RowMask | None:
        """The row's mask, or None when nothing restricts its next token."""
        gate = getattr(request, "reasoning_gate", None)
        if gate is None:
            return cls(row, request.constraint, request.output_token_ids) if request.constraint else None
        phase = gate.phase(request.output_token_ids)
        if phase.force_token is not None:
            return cls(row, None, force_token=phase.force_token)
        if phase.constrain_from is None or request.constraint is None:
            return None
        tokens = request.output_token_ids[phase.constrain_from :]
        return cls(row, request.constraint, tokens, also_allow=phase.also_allow)

    @property
    def width(self) -> int:
        """Tokens the mask must cover."""
        forced = (self.force_token or 0) + 1
        return max(self.constraint.vocab_size if self.constraint else 0, forced, (self.also_allow or 0) + 1)


@dataclass
class StepMasks:
    """Token masks of the masked rows of one step's batch."""

    masks: list[RowMask]
    """One per masked row (ascending rows)."""
    bitmask: np.ndarray
    """``[len(masks), words]`` int32: bit ``t % 32`` of word ``t // 32`` is set when token t is allowed."""
    errors: dict[int, str]
    """Row -> why its matcher failed before this step (its mask allows nothing)."""

    @property
    def rows(self) -> list[int]:
        """Batch rows that are masked (ascending)."""
        return [m.row for m in self.masks]

    @classmethod
    def build(cls, requests: Sequence[Request]) -> StepMasks | None:
        """Masks for the rows of ``requests`` (one per batch row) whose next token is restricted;
        None when none is (the step then pays nothing)."""
        masks = [m for i, r in enumerate(requests) if (m := RowMask.of(i, r)) is not None]
        if not masks:
            return None
        words = (max(m.width for m in masks) + 31) // 32
        bitmask = np.zeros((len(masks), words), dtype=np.int32)
        errors: dict[int, str] = {}
        live: list[tuple[object, int]] = []
        for k, mask in enumerate(masks):
            if mask.constraint is None:
                continue
            error = mask.constraint.sync(mask.tokens)
            if error is None:
                live.append((mask.constraint.matcher, k))
            else:
                errors[mask.row] = error
        if live:
            _mask_executor().unsafe_compute_mask_ptr(live, bitmask.ctypes.data, words * 4, len(masks))
        for k, mask in enumerate(masks):
            if mask.force_token is not None:
                _set_bit(bitmask, k, mask.force_token)
            elif mask.also_allow is not None and mask.row not in errors:
                _set_bit(bitmask, k, mask.also_allow)
        return cls(masks, bitmask, errors)

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` ([N, V]) with every token the masks forbid at ``-inf`` (constrained rows only)."""
        allowed = self._allowed(logits.shape[1])
        if len(self.rows) == logits.shape[0]:
            return mx.where(allowed, logits, float("-inf"))
        where = mx.array(self.rows)
        masked = mx.array(logits)  # a new array: the caller's logits stay as they are
        masked[where] = mx.where(allowed, logits[where], float("-inf"))
        return masked

    def _allowed(self, width: int) -> mx.array:
        """``[k, width]`` bool from the bitmask; columns past the tokenizer's vocabulary: False."""
        bits = mx.array(self.bitmask.view(np.uint32))
        k, words = self.bitmask.shape
        allowed = ((bits[:, :, None] >> mx.array(_SHIFTS)) & 1).astype(mx.bool_).reshape(k, words * 32)
        if words * 32 >= width:
            return allowed[:, :width]
        return mx.concatenate([allowed, mx.zeros((k, width - words * 32), dtype=mx.bool_)], axis=1)

    def rejected(self, requests: Sequence[Request], token_ids: Sequence[int]) -> dict[str, str]:
        """Request id -> error, for each constrained row whose sampled token cannot be accepted."""
        out: dict[str, str] = {}
        for k, mask in enumerate(self.masks):
            token = token_ids[mask.row]
            error = self.errors.get(mask.row)
            if error is None and mask.constraint is not None and token != mask.also_allow:
                allowed = self._bit(k, token)
                error = mask.constraint.check_sampled(token, allowed, allowed or bool(self.bitmask[k].any()))
            if error is not None:
                out[requests[mask.row].request_id] = error
        return out

    def _bit(self, k: int, token: int) -> bool:
        word = token >> 5
        if token < 0 or word >= self.bitmask.shape[1]:
            return False
        return bool((int(self.bitmask[k, word]) >> (token & 31)) & 1)


def _set_bit(bitmask: np.ndarray, k: int, token: int) -> None:
    bitmask.view(np.uint32)[k, token >> 5] |= np.uint32(1 << (token & 31))

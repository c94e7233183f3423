"""One step's token masks: fill the constrained rows' bitmasks, mask the batch's logits once.

``StepMasks.build(requests)`` syncs each constrained request's matcher with its accepted tokens
and fills one ``[k, words]`` int32 bitmask for the ``k`` constrained rows (llguidance's
executor, in parallel, off the GIL). ``apply`` masks the ``[N, V]`` logits in one MLX
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

from vllm_mlx.request import Request
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


@dataclass
class StepMasks:
    """Token masks of the constrained rows of one step's batch."""

    rows: list[int]
    """Batch rows that have a constraint (ascending)."""
    constraints: list[RequestConstraint]
    bitmask: np.ndarray
    """``[len(rows), words]`` int32: bit ``t % 32`` of word ``t // 32`` is set when token t is allowed."""
    errors: dict[int, str]
    """Row -> why its matcher failed before this step (its mask allows nothing)."""

    @classmethod
    def build(cls, requests: Sequence[Request]) -> StepMasks | None:
        """Masks for the rows of ``requests`` (one per batch row) that have a constraint; None
        when none has one (the step then pays nothing)."""
        rows = [i for i, r in enumerate(requests) if r.constraint is not None]
        if not rows:
            return None
        constraints = [requests[i].constraint for i in rows]
        words = (max(c.vocab_size for c in constraints) + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        errors: dict[int, str] = {}
        live: list[tuple[object, int]] = []
        for k, (row, constraint) in enumerate(zip(rows, constraints)):
            error = constraint.sync(requests[row].output_token_ids)
            if error is None:
                live.append((constraint.matcher, k))
            else:
                errors[row] = error
        if live:
            _mask_executor().unsafe_compute_mask_ptr(live, bitmask.ctypes.data, words * 4, len(rows))
        return cls(rows, constraints, bitmask, errors)

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
        for k, (row, constraint) in enumerate(zip(self.rows, self.constraints)):
            error = self.errors.get(row)
            if error is None:
                token = token_ids[row]
                allowed = self._bit(k, token)
                error = constraint.check_sampled(token, allowed, allowed or bool(self.bitmask[k].any()))
            if error is not None:
                out[requests[row].request_id] = error
        return out

    def _bit(self, k: int, token: int) -> bool:
        word = token >> 5
        if token < 0 or word >= self.bitmask.shape[1]:
            return False
        return bool((int(self.bitmask[k, word]) >> (token & 31)) & 1)

"""Per-request sampling inside a batch: penalties, temperature, top-k/p, min-p, seeds, logprobs.

``sample(logits, rows)`` turns one ``[N, V]`` logits array into N tokens, each row
following its own ``SamplingParams`` (vLLM semantics). Work is vectorised over rows
with per-row parameters as ``[n, 1]`` arrays; each optional stage (banning,
penalties, sorting, logprobs) runs only on the rows that ask for it. A call syncs
once at the end (plus once when a top-p row without top-k needs more than
``SORT_CANDIDATES`` tokens, see ``_sorted_threshold``).

Order of operations for one row:

1. ``raw`` = logits as float32. Logprobs, when requested, are ``log_softmax(raw)``:
   nothing below (banning, penalties, temperature, filters) changes them.
2. Banned tokens (``SamplingRow.banned_token_ids``) get ``-inf``.
3. Penalties: repetition (tokens seen in prompt or output: positive logits divided
   by it, negative ones multiplied), then frequency (count x penalty) and presence
   (penalty once) over output tokens.
4. Greedy rows (temperature below ``GREEDY_EPS``, as in vLLM) take the argmax.
5. Sampled rows: divide by temperature, keep tokens passing top-k, top-p (the
   smallest set of most likely tokens whose mass >= top_p, top token always kept)
   and min-p (p >= min_p x p_max), then an inverse-CDF draw with the row's own key.

Determinism contract: a row's token is a function of its own logits, params,
seed, step and token history only -- never of the other rows, its position in the
batch, or the batch size. The random number of a row is
``mx.random.uniform(shape=(1,), key=mx.random.key(row_seed(seed, step)))``, so the same
(seed, step) draws the same token alone, batched, or recomputed after preemption;
``step`` is the index of the token being sampled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from vllm_mlx.core.outputs import ScheduledRequest, TokenLogprobs
from vllm_mlx.core.request import SamplingParams
from vllm_mlx.executor import cpu_kernels

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's _SAMPLING_EPS); 0 is the documented value."""

SORT_CANDIDATES = 2048
"""Top-p rows without top-k first look for their nucleus among this many largest logits."""

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the batch."""

    params: SamplingParams
    seed: int
    """Resolved seed (the engine draws one when params.seed is None)."""
    step: int
    """Index of the token being sampled (= tokens generated so far)."""
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()
    """Never sampled (e.g. EOS and stop ids while min_tokens is not reached)."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """One per row; None where params.logprobs is None."""


def sample(logits: mx.array, rows: list[SamplingRow]) -> SamplerOutput:
    """Sample one token per row of ``logits`` ([N, V], any float dtype)."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {logits.shape}")
    if not rows:
        return SamplerOutput([], [])
    raw = logits.astype(mx.float32)
    x = apply_penalties(_ban(raw, rows), rows)
    tokens = mx.argmax(x, axis=-1)
    sampled = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    if sampled:
        picked = _sample_rows(_take_rows(x, sampled), [rows[i] for i in sampled])
        if len(sampled) == len(rows):
            tokens = picked
        else:
            tokens[mx.array(sampled)] = picked
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    lp_arrays = _logprobs(raw, tokens, rows, wanted) if wanted else ()
    mx.eval(tokens, *lp_arrays)  # one sync for the batch; the tolist() calls below copy
    token_ids = tokens.tolist()
    return SamplerOutput(token_ids, _logprob_records(len(rows), rows, wanted, token_ids, lp_arrays))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_EPS


def row_seed(seed: int, step: int) -> int:
    """The 64-bit key seed of (seed, step): splitmix64 applied twice, well mixed in both."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _exp(x: mx.array) -> mx.array:
    """``mx.exp``; on the CPU backend our vectorised one (MLX's CPU exp is scalar: ~0.6 ms for
    one row of a 49k vocabulary), to within 3e-7 relative error."""
    return cpu_kernels.exp(x) if cpu_kernels.enabled() else mx.exp(x)


def _take_rows(x: mx.array, idx: list[int]) -> mx.array:
    return x if len(idx) == x.shape[0] else x[mx.array(idx)]


def _column(values: list[float] | list[int]) -> mx.array:
    """Per-row parameters as an [n, 1] array, broadcasting against [n, V]."""
    return mx.array(values)[:, None]


def _scatter_index(seqs: Sequence[Sequence[int]], vocab: int) -> tuple[mx.array, mx.array] | None:
    """(row, token) index arrays for all tokens of ``seqs``; ids outside [0, vocab) dropped."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    if total == 0:
        return None
    cols = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    row_ids = np.repeat(np.arange(len(seqs), dtype=np.int32), lens)
    keep = (cols >= 0) & (cols < vocab)
    return mx.array(row_ids[keep]), mx.array(cols[keep].astype(np.int32))


# ---------------------------------------------------------------------------
# Banning and penalties


def _ban(x: mx.array, rows: list[SamplingRow]) -> mx.array:
    index = _scatter_index([r.banned_token_ids for r in rows], x.shape[1])
    if index is None:
        return x
    x = mx.array(x)  # a new array: the caller's raw logits stay untouched
    x[index] = _NEG_INF
    return x


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def apply_penalties(x: mx.array, rows: list[SamplingRow]) -> mx.array:
    """Repetition, frequency and presence penalties; rows without any are left as they are.

    Count matrices are built with scatter-add for the penalised rows only.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not idx:
        return x
    prow = [rows[i] for i in idx]
    sub = _take_rows(x, idx)
    counts = _counts(sub.shape, [r.output_token_ids for r in prow])
    if any(r.params.repetition_penalty != 1 for r in prow):
        seen = (counts + _counts(sub.shape, [r.prompt_token_ids for r in prow])) > 0
        rp = _column([r.params.repetition_penalty for r in prow])
        sub = mx.where(seen, mx.where(sub > 0, sub / rp, sub * rp), sub)
    freq = _column([r.params.frequency_penalty for r in prow])
    pres = _column([r.params.presence_penalty for r in prow])
    sub = sub - freq * counts - pres * (counts > 0)
    if len(idx) == len(rows):
        return sub
    x = mx.array(x)
    x[mx.array(idx)] = sub
    return x


def _counts(shape: tuple[int, int], seqs: Sequence[Sequence[int]]) -> mx.array:
    counts = mx.zeros(shape, dtype=mx.float32)
    index = _scatter_index(seqs, shape[1])
    return counts if index is None else counts.at[index].add(1.0)


# ---------------------------------------------------------------------------
# Temperature, filters and the draw


def _sample_rows(x: mx.array, rows: list[SamplingRow]) -> mx.array:
    """Tokens for non-greedy rows: temperature, filters, then one draw from the inverse of
    the row's cumulative distribution.

    One uniform number per row, not one Gumbel variate per vocabulary entry: on MLX's CPU
    backend the Gumbel noise (two scalar logs and a random number per entry) took ~0.7 ms a
    row at a 49k vocabulary, ~20x the rest. The smallest index whose cumulative mass exceeds
    ``u`` times the row's total is drawn, so a token with zero probability (filtered, banned)
    is never drawn.
    """
    x = x / _column([r.params.temperature for r in rows])
    x = apply_filters(x, [r.params for r in rows])
    cumulative = mx.cumsum(_exp(x - mx.max(x, axis=-1, keepdims=True)), axis=-1)
    uniform = mx.concatenate([mx.random.uniform(shape=(1,), key=mx.random.key(row_seed(r.seed, r.step))) for r in rows])
    target = uniform[:, None] * cumulative[:, -1:]
    return mx.argmax(cumulative > target, axis=-1)


def apply_filters(x: mx.array, params: list[SamplingParams]) -> mx.array:
    """Mask to -inf what top-k, top-p and min-p drop (x: temperature-scaled logits).

    Every filter reduces to a per-row threshold on x: a row keeps ``x >= thr``,
    and a row without filters has ``thr = -inf``. Min-p needs no sort: the top
    token survives top-k/top-p, so ``p >= min_p * p_max`` is
    ``x >= max(x) + log(min_p)`` before or after them.
    """
    thr = mx.full((x.shape[0], 1), _NEG_INF)
    if any(p.min_p > 0 for p in params):
        log_min_p = mx.log(_column([p.min_p for p in params]))  # log(0) = -inf: off
        thr = mx.maximum(thr, mx.max(x, axis=-1, keepdims=True) + log_min_p)
    sorted_idx = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
    if sorted_idx:
        sub = _sorted_threshold(_take_rows(x, sorted_idx), [params[i] for i in sorted_idx])
        if len(sorted_idx) == len(params):
            thr = mx.maximum(thr, sub)
        else:
            where = mx.array(sorted_idx)
            thr[where] = mx.maximum(thr[where], sub)
    elif not any(p.min_p > 0 for p in params):
        return x
    return mx.where(x >= thr, x, _NEG_INF)


def _sorted_threshold(
    x: mx.array, params: list[SamplingParams], candidates: int | None = None
) -> mx.array:
    """[n, 1] thresholds of top-k then top-p, from each row's largest values sorted descending.

    Only the ``width`` largest values are sorted: the largest k in use, and at least
    ``candidates`` when some row has top-p without top-k. Such a row whose nucleus
    fills every candidate is redone with a full sort (this needs one sync). Prefix
    sums run along the sorted order and a row reads only its own first k positions,
    so its threshold never depends on ``width``, i.e. on the other rows.
    """
    vocab = x.shape[1]
    candidates = candidates or SORT_CANDIDATES
    limit = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    width = max(n if p.top_k > 0 else min(n, candidates) for n, p in zip(limit, params))
    top = x if width == vocab else mx.topk(x, width, axis=-1)
    s = mx.sort(top, axis=-1)[:, ::-1]
    has_k = _column([p.top_k > 0 for p in params])
    kidx = _column([min(n, width) - 1 for n in limit])
    thr = mx.where(has_k, mx.take_along_axis(s, kidx, axis=-1), _NEG_INF)
    if all(p.top_p >= 1 for p in params):
        return thr
    top_p = _column([p.top_p for p in params])
    all_k = all(p.top_k > 0 for p in params)
    kept = _nucleus_size(None if all_k else x, s, kidx, has_k, top_p)
    thr_p = mx.take_along_axis(s, kept - 1, axis=-1)
    thr = mx.maximum(thr, mx.where(top_p < 1, thr_p, _NEG_INF))
    if width < vocab and not all_k:
        _redo_spilled(x, params, thr, (kept[:, 0] >= width) & ~has_k[:, 0])
    return thr


def _redo_spilled(x: mx.array, params: list[SamplingParams], thr: mx.array, spill: mx.array) -> None:
    """Recompute in ``thr`` (in place), with a full sort, rows whose nucleus filled every candidate."""
    redo = [i for i, flag in enumerate(spill.tolist()) if flag]  # a sync, top-p only
    if redo:
        where = mx.array(redo)
        thr[where] = _sorted_threshold(x[where], [params[i] for i in redo], candidates=x.shape[1])


def _nucleus_size(
    x: mx.array | None, s: mx.array, kidx: mx.array, has_k: mx.array, top_p: mx.array
) -> mx.array:
    """[n, 1] count of sorted positions kept by top-p (>= 1: the top token always stays).

    Position j is kept when the mass strictly before it is < top_p x the mass of the
    row's top-k survivors (the whole row ``x`` without top-k; ``x`` is None when every
    row has top-k). Masses are relative to the top token, unnormalised.
    """
    e = mx.where(mx.arange(s.shape[1])[None, :] <= kidx, _exp(s - s[:, :1]), 0.0)
    before = mx.cumsum(e, axis=-1, inclusive=False)
    total = mx.take_along_axis(before + e, kidx, axis=-1)
    if x is not None:
        row_mass = mx.sum(_exp(x - s[:, :1]), axis=-1, keepdims=True)
        total = mx.where(has_k, total, row_mass)
    return mx.sum(before < top_p * total, axis=-1, keepdims=True).astype(mx.int32)


# ---------------------------------------------------------------------------
# Logprobs


def _logprobs(
    raw: mx.array, tokens: mx.array, rows: list[SamplingRow], wanted: list[int]
) -> tuple[mx.array, ...]:
    """(sampled-token logprobs [n], and when some row wants top-N: top ids, top logprobs)."""
    sub = _take_rows(raw, wanted)
    lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
    picked = tokens if len(wanted) == len(rows) else tokens[mx.array(wanted)]
    token_lp = mx.take_along_axis(lp, picked[:, None].astype(mx.int32), axis=-1)[:, 0]
    n_top = min(max(rows[i].params.logprobs for i in wanted), raw.shape[1])
    if n_top == 0:
        return (token_lp,)
    ids = mx.argpartition(-lp, n_top - 1, axis=-1)[:, :n_top]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return token_lp, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def _logprob_records(
    n: int, rows: list[SamplingRow], wanted: list[int], token_ids: list[int], arrays: tuple
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * n
    if not wanted:
        return out
    token_lp = arrays[0].tolist()
    top_ids, top_vals = (arrays[1].tolist(), arrays[2].tolist()) if len(arrays) > 1 else ([], [])
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        top = dict(zip(top_ids[j][:k], top_vals[j][:k])) if k else {}
        out[i] = TokenLogprobs(token_ids[i], token_lp[j], top)
    return out


def sampling_row(item: ScheduledRequest, num_proposed: int = 0) -> SamplingRow:
    """The sampling row of ``item``'s next token; with ``num_proposed``, of the position after
    its first ``num_proposed`` proposed tokens (as if they had been sampled: same seed, the
    step and history they would give)."""
    request = item.request
    params = request.sampling_params
    history = request.output_token_ids + item.spec_token_ids[:num_proposed] if num_proposed else request.output_token_ids
    banned: list[int] = []
    if len(history) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
    if params.seed is None:
        raise ValueError(f"request {request.request_id} has no seed (the engine draws one for every request)")
    return SamplingRow(
        params=params,
        seed=params.seed,
        step=len(history),
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=history,
        banned_token_ids=banned,
    )

"""Held caches: a model whose cache the engine does not page keeps its own, per request, in the batch.

Some models' ``make_cache`` returns a class of their own (DeepSeek-V4.1's ``LayerCache``: a
sliding window, compressed groups of closed blocks and their index keys; LongCat-Flash-NGram's
n-gram history, which a fixed-size state slot cannot hold). Rather than refuse them, the runner
keeps each running request's own cache objects (mlx-lm's ``make_prompt_cache``: the model's
``make_cache()``) from its first scheduled chunk to its end, and runs every forward call of such a
model on one row, with that row's caches: any cache class works unmodified, as in mlx-lm's own
generation (its batch generator keeps a cache per sequence the same way). What this costs: no
prefix caching (nothing is shared between requests), no speculative decoding (a cache that
cannot be trimmed cannot take back rejected tokens), one forward call per row, and the stock
mlx-lm kernels.

Invariant: a held cache has seen exactly ``HeldCache.num_tokens`` tokens of its request
(``UNKNOWN_TOKENS`` while a forward call feeds it). A row that starts elsewhere (a failed step
re-run row by row, whose first run fed the cache already; a preempted request recomputed from
its start) rewinds it first: trimmed back where every cache can trim (mlx-lm's
``can_trim_prompt_cache``), else made fresh, the request's earlier tokens fed again in the same
call. So a row never feeds a cache a token twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx

logger = logging.getLogger(__name__)

# Architectures that make_cache a class the engine does not page, and that a held cache does not
# serve either (state kept on the model object between calls, shared by every request): why. The
# engine refuses them at load as before. None of mlx-lm's is known to need it.
HELD_REFUSED: dict[str, str] = {
    # mlx-vlm's Unlimited-OCR (its checkpoints spell it so): held, one image equals mlx-vlm, but its ring tells
    # prompt tokens from generated ones, which a held cache rebuilt after a preemption (one prefill of both)
    # does not, and two images leave mlx-vlm's tokens after a few (not yet explained).
    "unlimited-ocr": "its RingSlidingKVCache keeps the whole prompt and a ring of the last generated tokens apart, "
    "which a cache held per request cannot rebuild after a preemption (it feeds prompt and generated tokens "
    "again as one prefill)",
}

UNKNOWN_TOKENS = -1
"""``HeldCache.num_tokens`` while a forward call feeds the caches: a call that fails midway leaves
some layers fed and others not, so the next row rebuilds them."""

# mlx-lm's KVCache grows in steps of 256 slots, so 256 tokens fill exactly one step: the measured
# bytes per token are exact for KVCache layers; a fixed-size part (a sliding window, a recurrent
# state, an open compressed group) is spread over 256 tokens, so a longer request is counted more
# than it holds and a shorter one less, by at most that fixed part.
PROBE_TOKENS = 256


@dataclass
class HeldCache:
    """One request's own cache objects (the model's ``make_cache()``, as the model takes them)
    and how many of the request's tokens they have seen."""

    caches: list
    num_tokens: int = 0
    inputs: dict | None = None
    """Per-request inputs beside the embeddings (a vision adapter's ``request_inputs``: mllama's cross-attention
    states and masks), built at the request's first row from its images and kept with its caches."""
    model_state: dict | None = None
    """What the model keeps of this request between calls (its ``request_state``), saved after each
    of the row's calls; None until the first. It goes with the caches: made fresh with them."""


@dataclass
class HeldRow:
    """What one row's forward call feeds: ``tokens`` start at the cache's ``num_tokens``, the
    ``num_recomputed`` earlier tokens a rebuilt cache needs again first, then the step's own."""

    caches: list
    tokens: list[int]
    num_recomputed: int
    held: HeldCache


def make_held_caches(model) -> list:
    """A fresh set of the model's own caches: a vision-language adapter's ``held_caches`` (its text
    model's own classes, mlx-vlm's), else mlx-lm's ``make_prompt_cache``."""
    from mlx_lm.models.cache import make_prompt_cache

    own = getattr(model, "held_caches", None)
    return own() if own is not None else make_prompt_cache(model)


def cache_arrays(caches: Iterable) -> list[mx.array]:
    """Every array the caches hold (``state``, nested through ``CacheList``s; None skipped)."""

    def leaves(value) -> Iterable[mx.array]:
        if isinstance(value, mx.array):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from leaves(item)

    return [a for cache in caches for a in leaves(_state(cache))]


def _state(cache):
    try:
        return cache.state
    except (AttributeError, TypeError, ValueError):  # an empty cache of some classes has no state yet
        return ()


def held_bytes(caches: Iterable) -> int | None:
    """What the caches hold now (their ``nbytes``); None when some class does not say."""
    total = 0
    for cache in caches:
        size = getattr(cache, "nbytes", None)
        if not isinstance(size, int):
            return None
        total += size
    return total


@dataclass(frozen=True)
class HeldMeasure:
    """What one token costs in a model's own caches (0: a class does not say), and their dtype."""

    bytes_per_token: int
    dtype: str


def measure_held(model) -> HeldMeasure:
    """``PROBE_TOKENS`` tokens through a fresh set of the model's caches (one forward call), their
    ``nbytes`` divided by the tokens. With 0 bytes a token the pool bounds only the tokens in
    flight, not the memory (logged)."""
    caches = make_held_caches(model)
    model(mx.zeros((1, PROBE_TOKENS), dtype=mx.int32), cache=caches)
    arrays = cache_arrays(caches)
    mx.eval(arrays)
    floating = [a for a in arrays if mx.issubdtype(a.dtype, mx.floating)]  # not an n-gram history's ids
    dtype = str(floating[0].dtype).removeprefix("mlx.core.") if floating else "float32"
    size = held_bytes(caches)
    if size is None:
        logger.warning("the model's caches do not report their size: its KV budget bounds only the tokens in flight")
        return HeldMeasure(0, dtype)
    return HeldMeasure(max(size // PROBE_TOKENS, 1), dtype)


class HeldCaches:
    """The runner's held caches, by request id (``HeldCache``); see the module docstring."""

    def __init__(self, model) -> None:
        self.model = model
        self._held: dict[str, HeldCache] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def nbytes(self) -> int:
        """What every held cache holds now (0 for classes that do not say)."""
        return sum(held_bytes(h.caches) or 0 for h in self._held.values())

    def row(self, request_id: str, all_token_ids: list[int], start: int, new_tokens: list[int]) -> HeldRow:
        """The caches and tokens of a row computing ``new_tokens`` from position ``start`` of a
        request whose tokens are ``all_token_ids``: the request's cache, rewound to ``start``
        where it has seen more (or an unknown number), made at its first row."""
        held = self._held.get(request_id)
        if held is not None and held.num_tokens != start:
            held = self._rewound(held, start)
        if held is None:
            held = self._held[request_id] = HeldCache(make_held_caches(self.model))
        earlier = all_token_ids[held.num_tokens : start]
        return HeldRow(held.caches, earlier + new_tokens, len(earlier), held)

    def _rewound(self, held: HeldCache, start: int) -> HeldCache | None:
        """``held`` back at ``start`` tokens: as it is when it is behind (the row feeds the rest),
        trimmed where every cache can, else None (a fresh one)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if 0 <= held.num_tokens < start:
            return held
        # Model state kept per request has no way back: such a cache is made fresh, its tokens fed again.
        rewindable = held.model_state is None
        if held.num_tokens > start and rewindable and can_trim_prompt_cache(held.caches):
            trim_prompt_cache(held.caches, held.num_tokens - start)
            held.num_tokens = start
            return held
        return None

    def entry(self, request_id: str) -> HeldCache:
        """The request's held caches (after ``row``)."""
        return self._held[request_id]

    def feeding(self, request_id: str) -> None:
        """A forward call is about to feed the request's caches: their count is unknown until
        ``fed``."""
        self._held[request_id].num_tokens = UNKNOWN_TOKENS

    def fed(self, request_id: str, num_tokens: int) -> None:
        """The call that fed the caches was built: they have now seen ``num_tokens`` tokens."""
        self._held[request_id].num_tokens = num_tokens

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def keep_only(self, request_ids: Iterable[str]) -> None:
        """Drop the caches of every request not in ``request_ids`` (finished, aborted, preempted)."""
        keep = set(request_ids)
        for request_id in [r for r in self._held if r not in keep]:
            del self._held[request_id]

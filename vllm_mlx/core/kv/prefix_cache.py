"""Automatic prefix caching: content hashes of full KV blocks.

A block's hash names the KV it holds. The KV of token ``i`` depends on every token before it,
so a block's hash chains its parent block's hash (the whole prefix), then its own token ids, then
*extra keys*: whatever else changes the KV or must keep caches apart (model identity / cache
namespace, the request's cache salt, the content hashes of the images inside the block).

Hence **equal hash ⇒ equal KV**: the same tokens after a different prefix, under a different
model or salt, hash differently and never share a block. Hashes use sha256 over a fixed byte
encoding — never Python's ``hash()``, which is salted per process and collides easily.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from vllm_mlx.core.canonical import canonical_bytes
from vllm_mlx.core.fields import known_fields
from vllm_mlx.core.kv.block_pool import CacheBlock
from vllm_mlx.core.kv.coordinator import KVCacheCoordinator
from vllm_mlx.core.kv.records import RequestCache
from vllm_mlx.core.request import Request

__all__ = [
    "ROOT_HASH",
    "BlockAwarePrefixCache",
    "PrefixCacheManager",
    "PrefixCacheStats",
    "compute_block_hashes",
    "hash_block",
]

ROOT_HASH = bytes(32)
"""Parent of a request's first block (sha256-sized, all zeros)."""


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """sha256 of (parent hash or ``ROOT_HASH``, token ids as little-endian int64, extra keys).

    ``extra_keys`` is a tuple of None / bool / int / str / bytes / nested tuples, encoded
    canonically (type-tagged, length-prefixed), so ``("a", 1)`` and ``("a1",)`` differ.
    """
    tokens = array("q", token_ids)  # OverflowError/TypeError on non-int64 ids
    if sys.byteorder != "little":
        tokens.byteswap()
    digest = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens.tobytes())
    digest.update(canonical_bytes(tuple(extra_keys)))
    return digest.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple | Callable[[int], tuple] = (),
    existing: list[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block has none).

    ``extra_keys`` is one tuple for every block, or a function of the block index returning
    that block's tuple (e.g. with the hashes of the images inside the block).

    With ``existing`` (hashes of this same token sequence's first blocks, same ``extra_keys``),
    only the blocks after them are hashed: ``existing`` is extended in place and returned, so a
    growing request pays for each block once.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes = [] if existing is None else existing
    num_full = len(token_ids) // block_size
    if len(hashes) > num_full:
        raise ValueError(f"{len(hashes)} existing hashes but only {num_full} full blocks")
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        keys = extra_keys(i) if callable(extra_keys) else extra_keys
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], keys)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache effectiveness since the engine started (or the last ``reset_stats``)."""

    queries: int = 0
    """Lookups: one per admission of a request (a preempted request resuming counts again)."""
    query_tokens: int = 0
    """Tokens those requests had when looked up."""
    hits: int = 0
    """Lookups that found at least one cached block."""
    hit_tokens: int = 0
    """Tokens served from cached blocks: prefill work saved."""
    evictions: int = 0
    """Cached blocks reclaimed for new content (from the block pool)."""

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens that came from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.hit_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "tokens_saved": self.tokens_saved}

    @classmethod
    def from_dict(cls, data: dict) -> PrefixCacheStats:
        """The inverse of ``to_dict`` (the derived ``hit_rate`` and ``tokens_saved`` are ignored)."""
        return cls(**known_fields(cls, data))


class PrefixCacheManager:
    """Token-level prefix cache over a ``PagedCacheManager``'s (a ``KVCacheCoordinator``'s) hash map.

    ``lookup`` finds the longest run of cached full blocks for a token sequence; ``register``
    publishes a sequence's computed full blocks. Both work on hashes chained as described in
    the module docstring, with ``namespace`` (the model's identity) in every block's extra keys.
    """

    def __init__(self, kv_cache: KVCacheCoordinator, namespace: str = "", enabled: bool = True) -> None:
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.namespace = namespace
        self.enabled = enabled and kv_cache.enable_caching
        self._stats = PrefixCacheStats()

    def extra_keys(self, cache_salt: str | None = None) -> tuple:
        return (self.namespace, cache_salt)

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[CacheBlock]:
        """Cached blocks holding the longest cached prefix of ``token_ids`` (no ref counting)."""
        if not self.enabled:
            return []
        return self.kv_cache.get_computed_blocks("", self.block_hashes(token_ids, cache_salt))

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (no images) under ``cache_salt``."""
        return compute_block_hashes(token_ids, self.block_size, self.extra_keys(cache_salt))

    def hashes_of(self, request: Request, num_tokens: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``request``'s first ``num_tokens`` tokens (all of
        them by default), images and salt included, computed afresh: not the request's record
        (a finished request has none)."""
        tokens = request.all_token_ids if num_tokens is None else request.all_token_ids[:num_tokens]
        return compute_block_hashes(tokens, self.block_size, self._block_keys(request))

    def num_cached_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` are cached right now."""
        return len(self.lookup(token_ids, cache_salt)) * self.block_size

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._stats.queries += 1
        self._stats.query_tokens += num_tokens
        self._stats.hits += num_hit_tokens > 0
        self._stats.hit_tokens += num_hit_tokens
        self.kv_cache.record_prefix_query(num_tokens, num_hit_tokens)

    def stats(self) -> PrefixCacheStats:
        stats = PrefixCacheStats(**asdict(self._stats))
        stats.evictions = self.kv_cache.pool.evictions
        return stats

    def reset(self) -> bool:
        """Forget every unreferenced cached block (blocks in use keep their hashes)."""
        return self.kv_cache.reset_prefix_cache()


class BlockAwarePrefixCache(PrefixCacheManager):
    """The prefix cache as the KV manager (``core/kv/manager.py``) uses it: per request, on the
    paged blocks.

    A hit maps the new request's block table onto the same physical blocks (ref count + 1,
    zero copy). Each request's block hashes are computed once, incrementally, as blocks fill,
    and kept in the request's record (``records.RequestCache``) until ``forget``.
    A hit never includes the block holding the request's last known token: at least one token
    is computed (there must be logits to sample), and no request ever writes into a shared block.
    """

    def find_cached_blocks(self, request: Request) -> list[CacheBlock]:
        """The request's cached prefix. With recurrent layers, a hit ends at a state checkpoint;
        when more blocks than that are cached, where they end is remembered as the request's
        branch point (``branch_point``): a checkpoint kept there serves the next such prompt."""
        if not self.enabled:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.mm_input is not None:  # a hit never ends inside tokens that attend both ways
            max_blocks = request.mm_input.resumable_blocks(max_blocks, self.block_size)
        hashes = self.request_hashes(request)[:max_blocks]
        hits = self.kv_cache.get_computed_blocks(request.request_id, hashes)
        state = self.kv_cache.state
        if state is not None and state.checkpoints is not None:
            num_cached = self.kv_cache.num_cached_blocks(hashes)
            if num_cached > len(hits):
                self._record(request).branch_point = num_cached * self.block_size
        return hits

    def branch_point(self, request: Request) -> int | None:
        """Where the blocks cached at the request's admission ended, past its hit (None if not)."""
        record = self.kv_cache.requests.get(request.request_id)
        return None if record is None else record.branch_point

    def cache_computed_blocks(self, request: Request, num_computed_before: int) -> None:
        """Publish the blocks that became full of computed KV since ``num_computed_before``."""
        num_full = request.num_computed_tokens // self.block_size
        if not self.enabled or num_full == num_computed_before // self.block_size:
            return
        hashes = self.request_hashes(request)
        self.kv_cache.cache_full_blocks(request.request_id, hashes, request.all_token_ids, num_full_blocks=num_full)

    def publish_state_checkpoint(self, request: Request, moving: bool) -> None:
        """The request's state checkpoint, written by the step just applied, now holds the state
        after its ``num_computed_tokens`` (a block boundary): key it by that block's hash."""
        key = self.request_hashes(request)[request.num_computed_tokens // self.block_size - 1]
        self.kv_cache.state.publish_checkpoint(request.request_id, key, moving)

    def forget(self, request_id: str) -> None:
        self.kv_cache.forget(request_id)

    def request_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks (computed now for blocks filled since)."""
        hashes = self._record(request).block_hashes
        if len(hashes) < request.num_tokens // self.block_size:  # a block filled up since
            compute_block_hashes(request.all_token_ids, self.block_size, self._block_keys(request), hashes)
        return hashes

    def _record(self, request: Request) -> RequestCache:
        return self.kv_cache.request_cache(request.request_id)

    def _block_keys(self, request: Request) -> tuple | Callable[[int], tuple]:
        """Per-block extra keys: namespace and salt, plus the hashes of the images a block
        holds (with the chaining, every later block depends on them too)."""
        base = self.extra_keys(request.cache_salt)
        if request.lora_digest is not None:
            base = (*base, ("lora", request.lora_digest))
        mm = request.mm_input
        if mm is None:
            return base
        return lambda block: base + mm.block_extra_keys(block, self.block_size)

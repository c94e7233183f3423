"""Prefix-cache counters per tenant: what an operator reads to see how each tenant uses the cache.

A tenant is a ``cache_salt`` (requests with different salts never share a block). The counters
are kept under a label, never the salt itself: the salt is what keeps a tenant's blocks to
itself, and whoever knew it could probe that tenant's prompts. The label is the first 16 hex
digits of the salt's SHA-256 (``tenant_label``), so an operator who knows a tenant's salt finds
its counters; requests without a salt count under ``"none"``.

Salts are chosen by clients, so the table is bounded: after ``MAX_TENANTS`` labels, requests of
new salts count under ``"other"``. The engine thread owns the counters; observers read copies.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace

from vllm_mlx.core.fields import known_fields

MAX_TENANTS = 256
NO_SALT = "none"
OVERFLOW = "other"
LABEL_HEX_DIGITS = 16


def tenant_label(cache_salt: str | None) -> str:
    """The label a tenant's counters go under (see the module docstring)."""
    if cache_salt is None:
        return NO_SALT
    digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()
    return "sha256:" + digest[:LABEL_HEX_DIGITS]


@dataclass
class TenantCacheStats:
    """One tenant's prefix-cache counters since the engine started."""

    queries: int = 0
    """Lookups: one per admission of a request (a preempted request resuming counts again)."""
    query_tokens: int = 0
    """Tokens those requests had when looked up."""
    hits: int = 0
    """Lookups that found at least one cached block."""
    hit_tokens: int = 0
    """Prompt tokens served from cached blocks (the requests' cached tokens)."""
    allocations: int = 0
    """Blocks taken from the free queue for the tenant's new content (a hit takes none)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TenantCacheStats:
        return cls(**known_fields(cls, data))


class TenantCacheCounters:
    """``TenantCacheStats`` per tenant label, at most ``max_tenants`` of them plus ``"other"``."""

    def __init__(self, max_tenants: int = MAX_TENANTS) -> None:
        self.max_tenants = max_tenants
        self._stats: dict[str, TenantCacheStats] = {}

    def record_query(self, cache_salt: str | None, num_tokens: int, num_hit_tokens: int) -> None:
        stats = self._of(cache_salt)
        stats.queries += 1
        stats.query_tokens += num_tokens
        stats.hits += num_hit_tokens > 0
        stats.hit_tokens += num_hit_tokens

    def record_allocations(self, cache_salt: str | None, num_blocks: int) -> None:
        if num_blocks:
            self._of(cache_salt).allocations += num_blocks

    def copy(self) -> dict[str, TenantCacheStats]:
        """``{label: counters}``, copies (observers read these, never the live counters)."""
        return {label: replace(stats) for label, stats in self._stats.items()}

    def to_dict(self) -> dict[str, dict]:
        """``{label: counters}``, plain data (a copy)."""
        return {label: stats.to_dict() for label, stats in self._stats.items()}

    def _of(self, cache_salt: str | None) -> TenantCacheStats:
        label = tenant_label(cache_salt)
        if label not in self._stats and len(self._stats) >= self.max_tenants:
            label = OVERFLOW
        return self._stats.setdefault(label, TenantCacheStats())

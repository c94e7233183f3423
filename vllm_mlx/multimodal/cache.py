"""Multimodal cache: image content hash → vision encoder output, LRU under a memory budget.

Running the vision encoder on an image is the expensive part of a multimodal prefill. The same
picture sent again (a follow-up chat turn, another notebook cell) hashes to the same key
(:func:`vllm_mlx.multimodal.images.image_content_hash`: decoded pixels plus processor settings, never file
names), so its features are reused and the encoder run is skipped.

Invariants (checked by :meth:`MLLMCacheManager.check_invariants`):

* ``memory_used`` equals the sum of the cached entries' ``nbytes`` and never exceeds
  ``max_memory_bytes``. An entry larger than the whole budget is never cached.
* Entries are ordered by last use: a hit or an insert makes an entry most recently used (MRU);
  eviction takes the least recently used (LRU) first, and only to make room for an insert.
* ``queries == hits + misses``; ``encoder_runs_skipped == hits``; ``tokens_saved`` is the sum
  of the hit entries' ``num_tokens``.

Bookkeeping only: no MLX import, no mlx-vlm. Features are opaque objects with ``.nbytes``
(an ``mx.array``, a numpy array, or a list/tuple/dict of them). Thread-safe: one lock guards
every method, so observers may call :meth:`stats`/:meth:`snapshot` from any thread; the
features themselves are only handed back, never touched.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm_mlx.core.snapshot import MLLMCacheStats, MLLMEntryView
from vllm_mlx.multimodal.images import ImageSource, image_content_hash, load_image, thumbnail_png

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "DEFAULT_MAX_MEMORY_BYTES",
    "MLLMCacheEntry",
    "MLLMCacheManager",
    "MLLMCacheStats",
    "VLMCacheManager",
    "VLMCacheStats",
]

DEFAULT_MAX_MEMORY_BYTES = 512 * 1024 * 1024
THUMBNAIL_SIDE = 96


@dataclass(slots=True, eq=False)  # identity equality: features may be arrays
class MLLMCacheEntry:
    """One image's encoder output and what observers may show about it."""

    image_hash: str
    features: Any
    num_tokens: int
    """Placeholder tokens this image occupies in the prompt."""
    nbytes: int
    width: int | None = None
    height: int | None = None
    thumbnail_png: bytes | None = None
    created: float = 0.0
    """Wall-clock time (``time.time()``) of insertion."""
    last_used: float = 0.0
    hits: int = 0

    def view(self) -> MLLMEntryView:
        """What observers see (``core/snapshot.py``); the full hash is cut to 12 hex digits."""
        thumb = self.thumbnail_png
        return MLLMEntryView(
            hash=self.image_hash[:12],
            width=self.width,
            height=self.height,
            thumbnail_png=thumb,
            thumbnail_base64=base64.b64encode(thumb).decode("ascii") if thumb else None,
            bytes=self.nbytes,
            num_tokens=self.num_tokens,
            hits=self.hits,
            created=self.created,
            last_used=self.last_used,
        )

    def to_dict(self) -> dict:
        """``view()`` as plain data."""
        return self.view().to_dict()


def features_nbytes(features: Any) -> int:
    """Bytes held by ``features``: ``.nbytes``, or the sum over a list/tuple/dict of arrays."""
    if hasattr(features, "nbytes"):
        return int(features.nbytes)
    if isinstance(features, (list, tuple)):
        return sum(features_nbytes(f) for f in features)
    if isinstance(features, dict):
        return sum(features_nbytes(f) for f in features.values())
    raise TypeError(f"features must have .nbytes (an array), got {type(features).__name__}")


class MLLMCacheManager:
    """LRU cache of vision encoder outputs keyed by image content hash, within a byte budget."""

    def __init__(self, max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES) -> None:
        if max_memory_bytes < 0:
            raise ValueError(f"max_memory_bytes must be >= 0, got {max_memory_bytes}")
        self.max_memory_bytes = int(max_memory_bytes)
        self._entries: OrderedDict[str, MLLMCacheEntry] = OrderedDict()  # LRU first, MRU last
        self._memory_used = 0
        self._stats = MLLMCacheStats(max_memory_bytes=self.max_memory_bytes)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, image_hash: object) -> bool:
        """Presence test only: counts no query and leaves the LRU order alone."""
        return image_hash in self._entries

    @property
    def memory_used(self) -> int:
        return self._memory_used

    # ---- lookups and inserts -------------------------------------------------------------

    def get(self, image_hash: str) -> MLLMCacheEntry | None:
        """The cached entry or None; counts a query, and a hit becomes MRU."""
        with self._lock:
            self._stats.queries += 1
            entry = self._entries.get(image_hash)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(image_hash)
            entry.hits += 1
            entry.last_used = time.time()
            self._stats.hits += 1
            self._stats.tokens_saved += entry.num_tokens
            return entry

    def put(
        self,
        image_hash: str,
        features: Any,
        num_tokens: int,
        image: PILImage.Image | None = None,
    ) -> MLLMCacheEntry:
        """Cache ``features`` under ``image_hash`` as MRU, evicting LRU entries until it fits.

        An existing entry under the same hash is replaced (not counted as an eviction). An
        entry larger than the whole budget is returned without being cached (``oversized``
        counts it; the cache is left untouched). ``image`` only supplies size and thumbnail.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        now = time.time()
        entry = MLLMCacheEntry(
            image_hash=image_hash,
            features=features,
            num_tokens=int(num_tokens),
            nbytes=features_nbytes(features),
            created=now,
            last_used=now,
        )
        if image is not None:  # PIL work outside the lock
            entry.width, entry.height = image.size
            entry.thumbnail_png = thumbnail_png(image, THUMBNAIL_SIDE)
        with self._lock:
            if entry.nbytes > self.max_memory_bytes:
                self._stats.oversized += 1
                return entry
            self._drop(image_hash)
            while self._memory_used + entry.nbytes > self.max_memory_bytes:
                _, victim = self._entries.popitem(last=False)
                self._memory_used -= victim.nbytes
                self._stats.evictions += 1
            self._entries[image_hash] = entry
            self._memory_used += entry.nbytes
            return entry

    def get_or_compute(
        self,
        image: ImageSource,
        processor_key: tuple,
        compute_fn: Callable[[PILImage.Image], tuple[Any, int]],
    ) -> tuple[MLLMCacheEntry, bool]:
        """``(entry, hit)`` for ``image``; on a miss ``compute_fn(rgb_image) -> (features,
        num_tokens)`` runs (outside the lock) and its result is cached.

        ``image`` is anything ``vllm_mlx.multimodal.images.load_image`` accepts; it is normalised
        first, so a PIL object and the same file by path share one entry.
        """
        rgb = load_image(image)
        image_hash = image_content_hash(rgb, processor_key)
        entry = self.get(image_hash)
        if entry is not None:
            return entry, True
        features, num_tokens = compute_fn(rgb)
        return self.put(image_hash, features, num_tokens, image=rgb), False

    # ---- removal -------------------------------------------------------------------------

    def remove(self, image_hash: str) -> bool:
        """Drop one entry; True if it was cached."""
        with self._lock:
            return self._drop(image_hash)

    def clear(self) -> None:
        """Drop every entry; the counters are kept."""
        with self._lock:
            self._entries.clear()
            self._memory_used = 0

    def _drop(self, image_hash: str) -> bool:
        entry = self._entries.pop(image_hash, None)
        if entry is None:
            return False
        self._memory_used -= entry.nbytes
        return True

    # ---- observation ---------------------------------------------------------------------

    def stats(self) -> MLLMCacheStats:
        """A copy of the counters with the current occupancy."""
        with self._lock:
            return replace(
                self._stats, memory_used=self._memory_used, num_entries=len(self._entries)
            )

    def entries(self) -> list[MLLMEntryView]:
        """The entries as observers see them, most recently used first."""
        with self._lock:
            return self._entry_views()

    def _entry_views(self) -> list[MLLMEntryView]:
        """Most recently used first; the caller holds the lock."""
        return [e.view() for e in reversed(self._entries.values())]

    def snapshot(self) -> dict:
        """Plain data: ``{"entries": [...] (MRU first), "stats": {...}}``.

        Entries carry ``hash`` (12 hex digits), ``width``, ``height``, ``thumbnail_png``
        (bytes), ``thumbnail_base64`` (str, for JSON), ``bytes``, ``num_tokens``, ``hits``,
        ``created`` and ``last_used``. Everything but ``thumbnail_png`` is JSON-serialisable.
        """
        with self._lock:
            entries = [view.to_dict() for view in self._entry_views()]
            stats = replace(
                self._stats, memory_used=self._memory_used, num_entries=len(self._entries)
            )
        return {"entries": entries, "stats": stats.to_dict()}

    def check_invariants(self) -> None:
        """Raise AssertionError if the byte accounting is broken (for tests)."""
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            if total != self._memory_used:
                raise AssertionError(f"memory_used {self._memory_used} != sum of entries {total}")
            if total > self.max_memory_bytes:
                raise AssertionError(f"{total} bytes cached over the {self.max_memory_bytes} budget")
            s = self._stats
            if s.queries != s.hits + s.misses:
                raise AssertionError(f"queries {s.queries} != hits {s.hits} + misses {s.misses}")


# Legacy names kept for compatibility (the seed exports both).
VLMCacheManager = MLLMCacheManager
VLMCacheStats = MLLMCacheStats

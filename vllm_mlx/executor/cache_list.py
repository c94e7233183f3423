"""mlx-lm's ``CacheList`` (several caches in one layer), flattened for the engine and nested back
for the model.

A layer of some architectures holds several caches in one ``CacheList``: Falcon-H1 and
Baichuan-M1 a state beside their keys and values, DeepSeek-V3.2 and GLM-5 their sparse
indexer's keys beside the latent KV, LongCat-Flash two attentions. Everything the engine keeps
is per member (``attention.layer_specs``, the pools, the state slots); only the model sees the
``CacheList``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import CacheList


def flat_caches(caches: list) -> list:
    """``make_cache()``'s caches with each ``CacheList`` replaced by its members, in order: the
    engine pages each member as a layer of its own (one spec, one pool array or state slot)."""
    return [member for cache in caches for member in (cache.caches if isinstance(cache, CacheList) else (cache,))]


@dataclass(frozen=True)
class CacheNesting:
    """How the flat per-spec caches of a forward call regroup into what the model's layers
    take: ``members[i]`` is None for a plain cache, else the size of layer ``i``'s ``CacheList``."""

    members: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, model) -> CacheNesting:
        make_cache = getattr(model, "make_cache", None)
        caches = make_cache() if make_cache is not None else []
        return cls(tuple(len(c.caches) if isinstance(c, CacheList) else None for c in caches))

    def nest(self, flat: list) -> list:
        """``flat`` (one cache per spec) as the model takes it: the same list when no layer
        holds a ``CacheList``."""
        if all(size is None for size in self.members):
            return flat
        nested, start = [], 0
        for size in self.members:
            nested.append(flat[start] if size is None else CacheList(*flat[start : start + size]))
            start += 1 if size is None else size
        return nested

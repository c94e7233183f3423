"""Multimodal cache: content-hash keys, LRU eviction under a byte budget, stats and snapshots."""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image

from factories import make_image
from vllm_mlx.multimodal.cache import (
    MLLMCacheManager,
    MLLMCacheStats,
    VLMCacheManager,
    VLMCacheStats,
)
from vllm_mlx.multimodal.images import image_content_hash


def features(nbytes: int) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


class Encoder:
    """A fake vision encoder that counts its runs."""

    def __init__(self, nbytes=1000, num_tokens=64):
        self.calls = 0
        self.nbytes = nbytes
        self.num_tokens = num_tokens

    def __call__(self, image):
        assert image.mode == "RGB"
        self.calls += 1
        return features(self.nbytes), self.num_tokens


def test_same_picture_from_every_source_is_one_entry(tmp_path):
    image = make_image()
    out = io.BytesIO()
    image.save(out, format="PNG")
    data = out.getvalue()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()

    cache, encode = MLLMCacheManager(), Encoder()
    entry, hit = cache.get_or_compute(path, ("m",), encode)
    assert not hit and encode.calls == 1
    for source in (str(path), data, url, image, image.convert("RGBA")):
        again, hit = cache.get_or_compute(source, ("m",), encode)
        assert hit and again is entry
    assert encode.calls == 1 and len(cache) == 1
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.misses) == (6, 5, 1)
    assert stats.encoder_runs_skipped == 5 and stats.tokens_saved == 5 * 64
    assert entry.hits == 5 and (entry.width, entry.height) == (32, 24)
    cache.check_invariants()


def test_one_pixel_change_and_processor_key_make_new_entries():
    cache, encode = MLLMCacheManager(), Encoder()
    image = make_image()
    changed = image.copy()
    changed.putpixel((0, 0), (0, 0, 0) if image.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
    cache.get_or_compute(image, ("m",), encode)
    _, hit = cache.get_or_compute(changed, ("m",), encode)
    assert not hit
    _, hit = cache.get_or_compute(image, ("m", "other-resize"), encode)
    assert not hit
    assert encode.calls == 3 and len(cache) == 3


def test_lru_eviction_order_and_counts():
    cache = MLLMCacheManager(max_memory_bytes=300)
    for name in "abc":
        cache.put(name, features(100), num_tokens=10)
    assert cache.get("a") is not None  # a becomes MRU: LRU order is now b, c, a
    cache.put("d", features(100), num_tokens=10)  # evicts b
    assert "b" not in cache and {"a", "c", "d"} <= {h for h in "abcd" if h in cache}
    cache.put("e", features(200), num_tokens=10)  # evicts c then a
    assert [h for h in "abcde" if h in cache] == ["d", "e"]
    assert [e["hash"] for e in cache.snapshot()["entries"]] == ["e", "d"]  # MRU first
    stats = cache.stats()
    assert stats.evictions == 3
    assert stats.memory_used == 300 == cache.memory_used
    assert stats.num_entries == 2
    cache.check_invariants()


def test_contains_counts_nothing_and_keeps_order():
    cache = MLLMCacheManager(max_memory_bytes=200)
    cache.put("a", features(100), 1)
    cache.put("b", features(100), 1)
    assert "a" in cache  # not a use: a stays LRU
    cache.put("c", features(100), 1)
    assert "a" not in cache and cache.stats().queries == 0


def test_stats_add_up():
    cache = MLLMCacheManager(max_memory_bytes=10_000)
    cache.put("x", features(1234), num_tokens=7)
    cache.put("y", features(66), num_tokens=3)
    for key in ["x", "x", "y", "z", "w"]:
        cache.get(key)
    stats = cache.stats()
    assert stats.queries == stats.hits + stats.misses == 5
    assert (stats.hits, stats.misses, stats.tokens_saved) == (3, 2, 17)
    assert stats.hit_rate == pytest.approx(0.6)
    assert stats.memory_used == 1300 and stats.max_memory_bytes == 10_000
    data = stats.to_dict()
    assert data["encoder_runs_skipped"] == 3 and data["hit_rate"] == pytest.approx(0.6)
    assert isinstance(stats, MLLMCacheStats) and MLLMCacheStats().hit_rate == 0.0
    json.dumps(data)


def test_replacing_a_hash_is_not_an_eviction():
    cache = MLLMCacheManager(max_memory_bytes=1000)
    cache.put("x", features(100), 1)
    cache.put("x", features(300), 2)
    stats = cache.stats()
    assert (stats.num_entries, stats.memory_used, stats.evictions) == (1, 300, 0)
    assert cache.get("x").num_tokens == 2


def test_oversize_entry_is_not_cached():
    cache = MLLMCacheManager(max_memory_bytes=500)
    cache.put("small", features(400), 1)
    entry = cache.put("huge", features(501), 1)
    assert entry.nbytes == 501 and "huge" not in cache and "small" in cache
    stats = cache.stats()
    assert (stats.evictions, stats.oversized, stats.memory_used) == (0, 1, 400)
    exact = cache.put("exact", features(500), 1)  # exactly the budget fits
    assert "exact" in cache and cache.get("exact") is exact
    cache.check_invariants()

    encode = Encoder(nbytes=10_000)
    _, hit = cache.get_or_compute(make_image(), (), encode)
    _, hit2 = cache.get_or_compute(make_image(), (), encode)
    assert not hit and not hit2 and encode.calls == 2


def test_zero_budget_caches_nothing():
    cache = MLLMCacheManager(max_memory_bytes=0)
    cache.put("a", features(1), 1)
    assert len(cache) == 0
    with pytest.raises(ValueError):
        MLLMCacheManager(max_memory_bytes=-1)


def test_features_may_be_collections_or_mx_arrays():
    cache = MLLMCacheManager()
    entry = cache.put("t", (features(10), {"k": features(5)}), 1)
    assert entry.nbytes == 15
    with pytest.raises(TypeError):
        cache.put("bad", object(), 1)
    mx = pytest.importorskip("mlx.core")
    entry = cache.put("mx", mx.zeros((2, 3), dtype=mx.float16), 6)
    assert entry.nbytes == 12


def test_remove_and_clear_keep_counters():
    cache = MLLMCacheManager()
    cache.put("a", features(10), 1)
    cache.put("b", features(20), 1)
    cache.get("a")
    assert cache.remove("a") and not cache.remove("a")
    assert cache.stats().memory_used == 20
    cache.clear()
    stats = cache.stats()
    assert (stats.num_entries, stats.memory_used, stats.hits, stats.evictions) == (0, 0, 1, 0)


def test_snapshot_is_plain_data_with_thumbnails():
    cache, encode = MLLMCacheManager(), Encoder(nbytes=256, num_tokens=9)
    big = make_image(400, 100, seed=1)
    entry, _ = cache.get_or_compute(big, ("m",), encode)
    cache.get_or_compute(make_image(20, 30, seed=2), ("m",), encode)
    cache.put("nometa", features(8), 1)
    cache.get(entry.image_hash)

    snap = cache.snapshot()
    entries = snap["entries"]
    assert entries[0]["hash"] == entry.image_hash[:12]  # the hit made it MRU
    first = entries[0]
    assert (first["width"], first["height"], first["bytes"]) == (400, 100, 256)
    assert (first["num_tokens"], first["hits"]) == (9, 1)
    assert first["hash"] == image_content_hash(big, ("m",))[:12]
    for e in entries:
        if e["thumbnail_png"] is None:
            assert e["hash"] == "nometa" and e["thumbnail_base64"] is None
            continue
        assert base64.b64decode(e["thumbnail_base64"]) == e["thumbnail_png"]
        thumb = Image.open(io.BytesIO(e["thumbnail_png"]))
        assert thumb.format == "PNG" and max(thumb.size) <= 96
    assert Image.open(io.BytesIO(first["thumbnail_png"])).size == (96, 24)
    plain = {**snap, "entries": [{k: v for k, v in e.items() if k != "thumbnail_png"} for e in entries]}
    json.dumps(plain)
    assert snap["stats"]["num_entries"] == 3


def test_concurrent_use_keeps_accounting():
    cache = MLLMCacheManager(max_memory_bytes=5_000)

    def worker(offset):
        for i in range(200):
            key = f"k{(i + offset) % 40}"
            if cache.get(key) is None:
                cache.put(key, features(100 + i % 7), 1)
            cache.snapshot() if i % 50 == 0 else None

    threads = [threading.Thread(target=worker, args=(n * 11,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.check_invariants()
    assert cache.stats().queries == 800


def test_legacy_aliases():
    assert VLMCacheManager is MLLMCacheManager and VLMCacheStats is MLLMCacheStats
    import vllm_mlx

    assert vllm_mlx.VLMCacheManager is vllm_mlx.MLLMCacheManager is MLLMCacheManager
    assert vllm_mlx.VLMCacheStats is vllm_mlx.MLLMCacheStats is MLLMCacheStats

"""Typed observations (issue #26): ``EngineCore.snapshot()`` and ``stats()`` are dataclasses whose
``to_dict()`` is exactly the documented ``cache_snapshot()`` and ``get_stats()`` plain data, and
whose ``from_dict()`` rebuilds them from that JSON (as the remote notebook does)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from vllm_mlx import SamplingParams
from vllm_mlx.core.kv.spec import KVGroupView
from vllm_mlx.core.outputs import recent_step_records
from vllm_mlx.core.snapshot import CacheSnapshot, MLLMEntryView, MLLMSnapshot, MLLMStats, SnapshotStats
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.engine.observation import EngineStats
from vllm_mlx.multimodal.cache import MLLMCacheStats

SNAPSHOT_KEYS = ["block_size", "blocks", "requests", "free_queue", "stats", "mllm", "kv_groups", "block_groups"]
BLOCK_KEYS = ["id", "state", "ref_cnt", "owners", "hash", "num_tokens", "token_ids", "text"]
REQUEST_KEYS = ["status", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "num_output_tokens",
                "num_preemptions", "block_ids", "num_disk_tokens"]  # fmt: skip
STATS_KEYS = ["num_blocks", "block_size", "num_used_blocks", "num_cached_free_blocks", "num_free_blocks",
              "num_cached_blocks", "usage", "allocations", "frees", "evictions", "prefix_queries", "prefix_hits",
              "num_state_slots", "num_used_state_slots", "num_state_checkpoints", "num_cached_state_checkpoints",
              "state_checkpoint_evictions", "prefix_hit_rate", "running", "waiting", "preemptions", "steps",
              "prefix_cache", "prefix_cache_tenants"]  # fmt: skip
MLLM_STATS_KEYS = ["queries", "hits", "misses", "tokens_saved", "evictions", "oversized", "memory_used",
                   "max_memory_bytes", "num_entries", "encoder_runs_skipped", "hit_rate", "enabled",
                   "encoder_runs"]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """Mid-generation: two tenants' requests sharing a prefix, a third waiting for a seat."""
    engine = EngineCore(model=str(tiny_model_dir), block_size=4, num_kv_blocks=13, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prefix = list(range(100, 112))
    engine.add_request(prefix + [1, 2], params, "a", cache_salt="tenant-1")
    engine.step()
    engine.add_request(prefix + [3], params, "b", cache_salt="tenant-1")
    engine.add_request([7, 8, 9], params, "c")
    for _ in range(3):
        engine.step()
    yield engine
    engine.shutdown()


def test_snapshot_round_trips_through_json(engine):
    snapshot = engine.snapshot()
    assert snapshot.requests and any(b.state == "used" for b in snapshot.blocks)
    assert snapshot.stats.prefix_cache_tenants and snapshot.stats.prefix_cache.queries
    assert CacheSnapshot.from_dict(snapshot.to_dict()) == snapshot
    assert CacheSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))) == snapshot
    short = engine.snapshot(include_blocks=False)
    assert short.blocks == [] and short.free_queue == [] and short.requests == snapshot.requests
    assert CacheSnapshot.from_dict(json.loads(json.dumps(short.to_dict()))) == short


def test_stats_round_trip_through_json(engine):
    stats = engine.stats()
    assert stats.scheduler.running == 2 and stats.scheduler.waiting == 1 and stats.mllm is None
    assert EngineStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats


def test_the_documented_plain_data_is_the_typed_views_to_dict(engine):
    """``cache_snapshot()`` and ``get_stats()`` keep their keys, in their order (docs/caching.md,
    docs/notebook.md, the server's JSON), and are ``to_dict()`` of the typed reads."""
    plain = engine.cache_snapshot()
    assert plain == engine.snapshot().to_dict()
    assert list(plain) == SNAPSHOT_KEYS
    assert all(list(block) == BLOCK_KEYS for block in plain["blocks"])
    assert list(plain["requests"]) == ["a", "b", "c"]
    assert all(list(view) == REQUEST_KEYS for view in plain["requests"].values())
    assert list(plain["stats"]) == STATS_KEYS
    assert list(plain["mllm"]) == ["entries", "stats"] and list(plain["mllm"]["stats"]) == MLLM_STATS_KEYS
    assert [list(group) for group in plain["kv_groups"]] == [
        ["kind", "window", "layers", "bytes_per_token", "num_blocks", "dtype"]
    ]
    assert [list(group) for group in plain["block_groups"]] == [["window", "num_used_blocks"]]
    stats = engine.get_stats()
    assert stats == engine.stats().to_dict()
    assert list(stats) == ["scheduler", "kv_cache", "structured_outputs"]
    assert list(stats["scheduler"]) == ["running", "waiting", "preemptions", "steps", "kv_cache"]
    assert list(stats["structured_outputs"]) == ["cached", "hits", "misses"]


def test_recent_step_records_are_the_newest_after_a_step(engine):
    last = engine.step_records[-1].step_id
    assert [r.step_id for r in engine.recent_step_records(after=last - 2)] == [last - 1, last]
    assert [r.step_id for r in engine.recent_step_records(after=0, limit=1)] == [last]
    assert engine.recent_step_records(after=last) == []
    assert recent_step_records(engine.step_records, after=0) == list(engine.step_records)


def test_state_groups_and_mllm_entries_round_trip():
    """Parts a text model's snapshot lacks: a recurrent-state layer group, a cached image."""
    state = KVGroupView("recurrent_state", None, [0, 2], 0, "float32", bytes_per_request=4096, state_slots=3,
                        state_checkpoints=4)  # fmt: skip
    assert list(state.to_dict()) == ["kind", "window", "layers", "bytes_per_token", "bytes_per_request",
                                     "state_slots", "state_checkpoints", "dtype"]  # fmt: skip
    assert KVGroupView.from_dict(state.to_dict()) == state
    entry = MLLMEntryView("0123456789ab", 64, 48, None, None, 1024, 4, 2, 1.5, 2.5)
    mllm = MLLMSnapshot([entry], MLLMStats(queries=3, hits=2, misses=1, enabled=True, encoder_runs=1))
    assert MLLMSnapshot.from_dict(json.loads(json.dumps(mllm.to_dict()))) == mllm
    assert mllm.to_dict()["stats"]["hit_rate"] == pytest.approx(2 / 3)
    cache_fields = [f.name for f in fields(MLLMCacheStats)]  # the engine copies them into MLLMStats
    assert [f.name for f in fields(MLLMStats)] == [*cache_fields, "enabled", "encoder_runs"]
    stats = SnapshotStats(num_blocks=12, block_size=4, running=1)
    assert "prefix_cache_tenants" not in stats.to_dict(tenants=False)
    assert SnapshotStats.from_dict(stats.to_dict()) == stats

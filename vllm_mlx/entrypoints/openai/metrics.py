"""Prometheus metrics of one server app, in their own ``CollectorRegistry``.

Counters and latency histograms are fed by the serving code as outputs arrive (``track()``);
the engine's gauges (requests running/waiting, KV usage, prefix-cache hit rate) are read from
the engine's stats at scrape time, so they are never stale. Names follow vLLM's
(``vllm:...``) so existing dashboards work. A per-app registry (not the global one) lets several
apps live in one process, as they do in the tests.

Prefix-cache series (hit rate, queries, hits, cached prompt tokens) are exported only where the
operator discloses hits (``disclose_hits``), and KV usage is otherwise counted from the running
requests' lengths (``cache_disclosure.public_stats``): every one of those numbers moves with a
prefix hit. The per-tenant series (``vllm_mlx:tenant_...``, label ``tenant``) need
``per_tenant`` (``--enable-cache-stats-disclosure``).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm_mlx.core.kv.tenant_stats import TenantCacheStats
from vllm_mlx.core.request import RequestOutput
from vllm_mlx.core.snapshot import SnapshotStats
from vllm_mlx.entrypoints.openai.cache_disclosure import disk_view, visible

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


TENANT_COUNTERS = (  # (``TenantCacheStats`` field, series, help)
    ("queries", "vllm_mlx:tenant_prefix_cache_lookups", "Prefix-cache lookups (request admissions) of the tenant."),
    ("query_tokens", "vllm_mlx:tenant_prefix_cache_queries", "Prompt tokens of the tenant looked up in the prefix cache."),
    ("hits", "vllm_mlx:tenant_prefix_cache_lookup_hits", "Lookups of the tenant that found at least one cached block."),
    ("hit_tokens", "vllm_mlx:tenant_prefix_cache_hits", "Prompt tokens of the tenant found in the prefix cache."),
    ("allocations", "vllm_mlx:tenant_kv_block_allocations", "KV blocks taken for the tenant's new content."),
)


DISK_SERIES = {
    "enabled": (GaugeMetricFamily, "vllm:kv_disk_enabled", "1 while the KV disk tier is on."),
    "budget_bytes": (GaugeMetricFamily, "vllm:kv_disk_budget_bytes", "Bytes the KV disk tier may keep."),
    "bytes_on_disk": (GaugeMetricFamily, "vllm:kv_disk_usage_bytes", "Bytes of KV blocks in the disk tier's folder."),
    "write_budget_left": (
        GaugeMetricFamily, "vllm:kv_disk_write_budget_left_bytes", "Bytes the disk tier may still write this hour.",
    ),
    "blocks_read": (CounterMetricFamily, "vllm:kv_disk_blocks_read", "KV blocks read back from disk (prefix hits)."),
    "bytes_read": (CounterMetricFamily, "vllm:kv_disk_read_bytes", "Bytes of KV read back from disk."),
    "blocks_written": (CounterMetricFamily, "vllm:kv_disk_blocks_written", "KV blocks written to disk."),
    "bytes_written": (CounterMetricFamily, "vllm:kv_disk_written_bytes", "Bytes of KV written to disk."),
    "writes_skipped": (
        CounterMetricFamily, "vllm:kv_disk_writes_skipped", "KV blocks not written: over the write budget.",
    ),
}  # fmt: skip
"""The disk tier's stats as Prometheus series (what ``disk_view`` shows of them)."""


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's stats when Prometheus scrapes."""

    def __init__(self, engine, model_name: str, disclose_hits: bool = False, per_tenant: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.disclose_hits = disclose_hits
        self.per_tenant = per_tenant

    def collect(self):
        try:
            snapshot = self.engine.snapshot(include_blocks=False)
        except Exception:  # a dead engine: /health says so; the scrape still succeeds
            return
        stats = visible(snapshot.stats, snapshot.requests, disclose=self.disclose_hits)
        gauges = [
            ("vllm:num_requests_running", "Requests in the running batch.", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.usage),
        ]
        counters = [("vllm:num_preemptions", "Requests preempted (KV blocks ran out).", stats.preemptions)]
        if isinstance(stats, SnapshotStats):  # disclosed
            hit_rate = "Prompt tokens found in the prefix cache / looked up."
            gauges.append(("vllm:prefix_cache_hit_rate", hit_rate, stats.prefix_hit_rate))
            counters += [
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits),
            ]
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        if isinstance(stats, SnapshotStats) and self.per_tenant:
            yield from self._tenant_families(stats.prefix_cache_tenants)
        yield from self._disk_families()

    def _disk_families(self):
        """The KV disk tier's series, where the engine has one: its budgets always, its
        counters only where prefix hits are disclosed (they move with hits: ``disk_view``)."""
        try:
            disk = self.engine.stats().kv_disk
        except Exception:  # a dead engine, as above
            return
        if disk is None:
            return
        view = disk_view(disk, self.disclose_hits)
        for key, (kind, name, doc) in DISK_SERIES.items():
            if view.get(key) is not None:
                yield self._family(kind, name, doc, float(view[key]))

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _tenant_families(self, tenants: dict[str, TenantCacheStats]):
        for key, name, doc in TENANT_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name", "tenant"])
            for tenant, counters in tenants.items():
                family.add_metric([self.model_name, tenant], getattr(counters, key))
            yield family


class ServerMetrics:
    """Everything ``GET /metrics`` exports for one app."""

    def __init__(self, engine, model_name: str, disclose_hits: bool = False, per_tenant: bool = False) -> None:
        """``disclose_hits``, ``per_tenant``: the prefix-cache series (module docstring)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.cached_tokens = None
        if disclose_hits:
            self.cached_tokens = Counter(
                "vllm:prompt_cached_tokens", "Prompt tokens served from the prefix cache.", labels, registry=r
            )
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Proposed tokens verified (speculative decoding).", labels, registry=r
        )
        self.accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Proposed tokens kept (speculative decoding).", labels, registry=r
        )
        self.request_aborted = Counter(
            "vllm:request_aborted", "Requests aborted before they finished (client disconnects).", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Request submitted to the engine -> first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time between output tokens.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request submitted to the engine -> finished.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.registry.register(EngineStatsCollector(engine, model_name, disclose_hits, per_tenant))

    def track(self) -> RequestTracker:
        """A tracker for one engine request, started now (just after it was submitted)."""
        return RequestTracker(self)

    def render(self) -> bytes:
        """The Prometheus text format (blocks on an engine call: run it off the event loop)."""
        return generate_latest(self.registry)


class RequestTracker:
    """Feeds one engine request's outputs into the histograms and counters."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.monotonic()
        self.num_tokens = self.prompt_tokens = self.cached_tokens = 0
        self.draft_tokens = self.accepted_tokens = 0
        self.finished = False

    def observe(self, output: RequestOutput) -> None:
        m, label = self.metrics, self.metrics.model_name
        now = time.monotonic()
        new = output.num_completion_tokens - self.num_tokens
        if new > 0:
            if self.num_tokens == 0:
                m.ttft.labels(label).observe(now - self.start)
            else:
                for _ in range(new):
                    m.tpot.labels(label).observe((now - self.last) / new)
            self.num_tokens, self.last = output.num_completion_tokens, now
        self.prompt_tokens, self.cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
        self.draft_tokens, self.accepted_tokens = output.metrics.num_draft_tokens, output.metrics.num_accepted_tokens
        if output.finished:
            self.finished = True
            m.e2e.labels(label).observe(now - self.start)
            m.request_success.labels(label, output.finish_reason or "unknown").inc()
            self._count_tokens()

    def abandon(self) -> None:
        """The consumer left before the end (the request is being aborted)."""
        if not self.finished:
            self.finished = True
            self.metrics.request_aborted.labels(self.metrics.model_name).inc()
            self._count_tokens()

    def _count_tokens(self) -> None:
        m, label = self.metrics, self.metrics.model_name
        m.prompt_tokens.labels(label).inc(self.prompt_tokens)
        if m.cached_tokens is not None:
            m.cached_tokens.labels(label).inc(self.cached_tokens)
        m.generation_tokens.labels(label).inc(self.num_tokens)
        m.draft_tokens.labels(label).inc(self.draft_tokens)
        m.accepted_tokens.labels(label).inc(self.accepted_tokens)

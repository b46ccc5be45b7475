"""Prometheus metrics of a worker process.

Each worker owns its own `CollectorRegistry` (no global state), so several
workers can live in one test process. Names are prefixed `pdcluster_`.
Labels stay low-cardinality: reasons, stages and states — never rids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Time per output token: one decode step, finer than the request latencies.
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


_INFO = ("pdcluster", "role", "pdcluster_instance")


class MetricFactory:
    """Declares metrics in one registry, every name under one prefix."""

    def __init__(self, registry: CollectorRegistry, prefix: str, buckets: Sequence[float]) -> None:
        self.registry = registry
        self.prefix = prefix
        self.buckets = tuple(buckets)

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, *labels: str, buckets: Sequence[float] | None = None
    ) -> Histogram:
        return Histogram(
            self.prefix + name,
            doc,
            labels,
            buckets=self.buckets if buckets is None else tuple(buckets),
            registry=self.registry,
        )


class PrefixCacheCounts(Protocol):
    """What the engine reports about its prefix cache (`LLMEngine.prefix_cache_stats`)."""

    @property
    def lookup_tokens(self) -> int: ...
    @property
    def hit_tokens(self) -> int: ...
    @property
    def cached_pages(self) -> int: ...
    @property
    def evicted_pages(self) -> int: ...


class _PrefixCacheCollector(Collector):
    """Reads the engine's counts at scrape time (they live in the engine, as
    the page counts do), so the counters never drift from the cache."""

    def __init__(self, prefix: str, read: Callable[[], PrefixCacheCounts]) -> None:
        self._prefix = prefix
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        p = self._prefix
        yield CounterMetricFamily(
            p + "prefix_cache_lookup_tokens",
            "Known tokens of admitted sequences looked up in the prefix cache",
            value=stats.lookup_tokens,
        )
        yield CounterMetricFamily(
            p + "prefix_cache_hit_tokens",
            "Tokens whose KV the prefix cache served (hit rate: hit / lookup)",
            value=stats.hit_tokens,
        )
        yield CounterMetricFamily(
            p + "prefix_cache_evictions",
            "Cached KV pages evicted to make room (leader rank)",
            value=stats.evicted_pages,
        )
        yield GaugeMetricFamily(
            p + "prefix_cache_pages",
            "KV pages in the prefix cache, referenced or evictable (leader rank)",
            value=stats.cached_pages,
        )


# Finish reasons of a request that ended well; every other reason is a failure.
SUCCESS_REASONS = frozenset({"stop", "length", "prefill_done"})


class WorkerMetrics:
    def __init__(self, role: str, cluster: str = "", instance: str = "") -> None:
        self.role = role
        self.registry = CollectorRegistry()
        m = MetricFactory(self.registry, "pdcluster_", LATENCY_BUCKETS)
        # Which cluster, role and instance this process serves: dashboards and
        # alerts join on it (`* on(instance) group_left(pdcluster, role) pdcluster_worker_info`).
        m.gauge(
            "worker_info", "1, labelled with the worker's cluster, role and instance", *_INFO
        ).labels(cluster, role, instance).set(1)
        self.prompt_tokens = m.counter(
            "prompt_tokens_total", "Prompt tokens of the requests this worker finished", "role"
        ).labels(role)
        self.generation_tokens = m.counter(
            "generation_tokens_total", "Tokens this worker generated (prefill: the first)", "role"
        ).labels(role)
        self.request_success = m.counter(
            "request_success_total",
            "Requests that ended well, by finish reason (stop, length; prefill_done)",
            "role",
            "reason",
        )
        self.request_failure = m.counter(
            "request_failure_total",
            "Requests that ended in an error or were cut off, by failure label",
            "role",
            "reason",
        )
        self.requests_in_flight = m.gauge("requests_in_flight", "Requests being served")
        self.requests_total = m.counter(
            "requests_total", "Requests finished, by finish reason", "reason"
        )
        self.rejected = m.counter(
            "rejected_requests_total", "Requests refused before anything was reserved", "reason"
        )
        self.failures = m.counter(
            "failures_total", "Failed requests and rooms, by reason", "reason"
        )
        self.queue_size = m.gauge("queue_size", "Requests waiting per stage", "stage")
        self.rooms = m.gauge("rooms", "Rooms by KVPoll state", "state")
        self.free_pages = m.gauge("kv_free_pages", "Free KV pages (leader rank)")
        self.total_pages = m.gauge("kv_total_pages", "KV pages (leader rank)")
        self.transfer_bytes = m.counter("transfer_bytes_total", "KV bytes moved", "direction")
        # Decode-side prefix reuse: prompt pages decode already held, so
        # prefill did not send them (their bytes are not in transfer_bytes).
        self.decode_reuse_pages = m.counter(
            "decode_reuse_pages_total", "Prompt KV pages decode reused instead of receiving"
        )
        self.decode_reuse_bytes = m.counter(
            "decode_reuse_bytes_total", "KV bytes decode reused instead of receiving"
        )
        self.transfer_seconds = m.histogram(
            "transfer_seconds", "Time from metadata sent to transfer concluded"
        )
        self.protocol_rejects = m.counter(
            "protocol_rejects_total", "Malformed or unexpected control/KV frames dropped", "reason"
        )
        self.kv_transport = m.gauge(
            "kv_transport_info",
            "1 for the KV backend and the UCX transports it negotiated (nixl; '' before a peer)",
            "backend",
            "transports",
            "tcp_fallback",
        )
        self.kv_rdma_missing = m.gauge(
            "kv_rdma_missing",
            "1 when the manifest asks for RDMA or GPU-direct and UCX negotiated none (nixl)",
        )
        self.engine_stalled = m.gauge(
            "engine_stalled", "1 while work is pending and no engine step finished in time"
        )
        self.ttft_seconds = m.histogram("time_to_first_token_seconds", "TTFT")
        self.tpot_seconds = m.histogram(
            "time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1)",
            buckets=TOKEN_BUCKETS,
        )
        self.queued_prefill_tokens = m.gauge(
            "queued_prefill_tokens",
            "Prompt tokens in the engine not computed yet (waiting and partly prefilled)",
        )

    def count_outcome(self, reason: str) -> None:
        """One finished request: a success or a failure by its label."""
        if reason in SUCCESS_REASONS:
            self.request_success.labels(self.role, reason).inc()
        else:
            self.request_failure.labels(self.role, reason).inc()

    def watch_pages(self, free: Callable[[], int], total: Callable[[], int]) -> None:
        self.free_pages.set_function(free)
        self.total_pages.set_function(total)

    def watch_prefix_cache(self, read: Callable[[], PrefixCacheCounts]) -> None:
        """Export the engine's prefix cache counts (`pdcluster_prefix_cache_*`)."""
        self.registry.register(_PrefixCacheCollector("pdcluster_", read))

"""Prometheus metrics of the router.

Each router app owns its registry, so several routers fit in one test
process. Worker gauges are read from the pool at scrape time: a worker that
discovery removed disappears from /metrics instead of freezing at its last
value. Labels stay low-cardinality: routes, codes, roles, reasons, worker URLs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdcluster.runtime.metrics import MetricFactory
from pdcluster.runtime.router.workers import Worker

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector(Collector):
    def __init__(
        self,
        workers: Callable[[], list[Worker]],
        prefix_pages: Callable[[str], int | None] | None = None,
    ) -> None:
        self._workers = workers
        self._prefix_pages = prefix_pages

    def collect(self) -> Iterator[Metric]:
        outstanding = GaugeMetricFamily(
            "pdcluster_router_worker_outstanding",
            "Legs in flight per worker",
            labels=["worker", "role"],
        )
        healthy = GaugeMetricFamily(
            "pdcluster_router_worker_healthy",
            "1 when the worker is a selection candidate",
            labels=["worker", "role"],
        )
        indexed = GaugeMetricFamily(
            "pdcluster_router_prefix_index_pages",
            "cache_aware: cached pages the router's index holds for the worker "
            "(absent while it is not followed)",
            labels=["worker", "role"],
        )
        for worker in self._workers():
            labels = [worker.url, worker.role.value]
            outstanding.add_metric(labels, worker.outstanding)
            healthy.add_metric(labels, 1.0 if worker.healthy else 0.0)
            pages = None if self._prefix_pages is None else self._prefix_pages(worker.url)
            if pages is not None:
                indexed.add_metric(labels, pages)
        yield outstanding
        yield healthy
        if self._prefix_pages is not None:
            yield indexed


class RouterMetrics:
    def __init__(
        self,
        workers: Callable[[], list[Worker]],
        prefix_pages: Callable[[str], int | None] | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        m = MetricFactory(r, "pdcluster_router_", LATENCY_BUCKETS)
        self.requests = m.counter(
            "requests_total", "Requests answered, by route and HTTP status", "route", "code"
        )
        self.latency = m.histogram(
            "request_duration_seconds",
            "Time from request to the end of the response (streams included)",
            "route",
        )
        # The operator's autoscaler reads it (operator/autoscale/router_metrics.py).
        self.time_to_first_token = m.histogram(
            "time_to_first_token_seconds",
            "PD requests: from the leg plan to the prefill leg's answer (the prefill computes "
            "the first token), as the router sees it",
        )
        self.leg_failures = m.counter(
            "leg_failures_total", "Worker legs that failed, by role and reason", "role", "reason"
        )
        self.aborts = m.counter(
            "aborts_sent_total",
            "abort_request calls sent to workers, by role and reason",
            "role",
            "reason",
        )
        self.health_transitions = m.counter(
            "worker_health_transitions_total", "Workers entering or leaving the pool", "role", "to"
        )
        r.register(_PoolCollector(workers, prefix_pages))

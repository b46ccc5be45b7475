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
from pdcluster.runtime.spec import Role

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _PoolCollector(Collector):
    def __init__(
        self,
        workers: Callable[[], list[Worker]],
        prefix_pages: Callable[[str], int | None] | None = None,
        roles: tuple[Role, ...] = (),
    ) -> None:
        self._workers = workers
        self._prefix_pages = prefix_pages
        self._roles = roles

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
        ready = GaugeMetricFamily(
            "pdcluster_router_ready_workers",
            "Selection candidates per role of the cluster (0 when a role has none)",
            labels=["role"],
        )
        workers = self._workers()
        for role in self._roles:
            ready.add_metric([role.value], sum(w.healthy for w in workers if w.role is role))
        for worker in workers:
            labels = [worker.url, worker.role.value]
            outstanding.add_metric(labels, worker.outstanding)
            healthy.add_metric(labels, 1.0 if worker.healthy else 0.0)
            pages = None if self._prefix_pages is None else self._prefix_pages(worker.url)
            if pages is not None:
                indexed.add_metric(labels, pages)
        yield ready
        yield outstanding
        yield healthy
        if self._prefix_pages is not None:
            yield indexed


# Finish reasons of a request that ended well; every other outcome is a failure.
SUCCESS_REASONS = frozenset({"stop", "length"})


class RouterMetrics:
    def __init__(
        self,
        workers: Callable[[], list[Worker]],
        prefix_pages: Callable[[str], int | None] | None = None,
        *,
        roles: tuple[Role, ...] = (),
        cluster: str = "",
        ttft_slo_s: float | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        m = MetricFactory(r, "pdcluster_router_", LATENCY_BUCKETS)
        m.gauge("info", "1, labelled with the router's cluster", "pdcluster").labels(cluster).set(1)
        if ttft_slo_s is not None:
            # The TTFT alert compares each router's p90 with its own cluster's promise.
            m.gauge(
                "slo_ttft_p90_seconds", "The p90 time to first token the manifest promises"
            ).set(ttft_slo_s)
        self.prompt_tokens = m.counter(
            "prompt_tokens_total", "Prompt tokens of the requests answered (from the decode leg)"
        )
        self.generation_tokens = m.counter(
            "generation_tokens_total", "Tokens generated for the requests answered"
        )
        self.request_success = m.counter(
            "request_success_total", "Requests answered in full, by finish reason", "reason"
        )
        self.request_failure = m.counter(
            "request_failure_total",
            "Requests that ended in an error or were abandoned, by reason",
            "reason",
        )
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
        r.register(_PoolCollector(workers, prefix_pages, roles))

    def count_outcome(self, reason: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """One request ended: a success by finish reason, or a failure by reason."""
        if reason in SUCCESS_REASONS:
            self.request_success.labels(reason).inc()
        else:
            self.request_failure.labels(reason).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if output_tokens:
            self.generation_tokens.inc(output_tokens)

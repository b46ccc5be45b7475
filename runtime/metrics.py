"""Prometheus metrics of a worker process.

Each worker owns its own `CollectorRegistry` (no global state), so several
workers can live in one test process. Names are prefixed `pdcluster_`.
Labels stay low-cardinality: reasons, stages and states — never rids.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Time per output token: one decode step, finer than the request latencies.
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.role = role
        r = self.registry = CollectorRegistry()
        self.requests_in_flight = Gauge(
            "pdcluster_requests_in_flight", "Requests being served", registry=r
        )
        self.requests_total = Counter(
            "pdcluster_requests_total",
            "Requests finished, by finish reason",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "pdcluster_rejected_requests_total",
            "Requests refused before anything was reserved",
            ["reason"],
            registry=r,
        )
        self.failures = Counter(
            "pdcluster_failures_total",
            "Failed requests and rooms, by reason",
            ["reason"],
            registry=r,
        )
        self.queue_size = Gauge(
            "pdcluster_queue_size", "Requests waiting per stage", ["stage"], registry=r
        )
        self.rooms = Gauge("pdcluster_rooms", "Rooms by KVPoll state", ["state"], registry=r)
        self.free_pages = Gauge(
            "pdcluster_kv_free_pages", "Free KV pages (leader rank)", registry=r
        )
        self.total_pages = Gauge("pdcluster_kv_total_pages", "KV pages (leader rank)", registry=r)
        self.transfer_bytes = Counter(
            "pdcluster_transfer_bytes_total", "KV bytes moved", ["direction"], registry=r
        )
        self.transfer_seconds = Histogram(
            "pdcluster_transfer_seconds",
            "Time from metadata sent to transfer concluded",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.protocol_rejects = Counter(
            "pdcluster_protocol_rejects_total",
            "Malformed or unexpected control/KV frames dropped",
            ["reason"],
            registry=r,
        )
        self.kv_transport = Gauge(
            "pdcluster_kv_transport_info",
            "1 for the KV backend and the UCX transports it negotiated (nixl; '' before a peer)",
            ["backend", "transports", "tcp_fallback"],
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "pdcluster_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot_seconds = Histogram(
            "pdcluster_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queued_prefill_tokens = Gauge(
            "pdcluster_queued_prefill_tokens",
            "Prompt tokens in the engine not computed yet (waiting and partly prefilled)",
            registry=r,
        )

    def watch_pages(self, free: Callable[[], int], total: Callable[[], int]) -> None:
        self.free_pages.set_function(free)
        self.total_pages.set_function(total)

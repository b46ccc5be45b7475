"""Operator metrics (Prometheus). One registry per instance so tests can build many."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DETECTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "pdcluster_operator_reconciles_total",
            "Reconcile passes, by result (ok, invalid, error)",
            ["result"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            "pdcluster_operator_reconcile_seconds", "Duration of one reconcile pass", registry=r
        )
        self.actions = Counter(
            "pdcluster_operator_actions_total",
            "Writes performed, by operation and kind",
            ["op", "kind"],
            registry=r,
        )
        self.errors = Counter(
            "pdcluster_operator_errors_total",
            "Failed API calls, by operation and HTTP status",
            ["op", "status"],
            registry=r,
        )
        self.status_writes = Counter(
            "pdcluster_operator_status_writes_total", "Status subresource writes", registry=r
        )
        self.restarts = Counter(
            "pdcluster_operator_instance_restarts_total",
            "Gang restarts of an instance, by role and cause",
            ["role", "cause"],
            registry=r,
        )
        self.failovers = Counter(
            "pdcluster_operator_failovers_total",
            "Lost instances handled by the failover fast path, by role and cause",
            ["role", "cause"],
            registry=r,
        )
        self.detection_seconds = Histogram(
            "pdcluster_operator_failure_detection_seconds",
            "From a pod's failure (API time, whole seconds) to its peers told, by role",
            ["role"],
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.failover_seconds = Histogram(
            "pdcluster_operator_failover_seconds",
            "From the pod event revealing a loss to every peer having answered, by role",
            ["role"],
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.rooms_failed = Counter(
            "pdcluster_operator_rooms_failed_total",
            "Rooms the workers report failed (from /admin/failures), by role and reason",
            ["role", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "pdcluster_operator_queue_depth", "Clusters waiting to be reconciled", registry=r
        )

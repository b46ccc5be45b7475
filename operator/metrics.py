"""Operator metrics (Prometheus). One registry per instance so tests can build many."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DETECTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


PREFIX = "pdcluster_operator_"


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, *labels: str) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=DETECTION_BUCKETS, registry=r)

        self.reconciles = counter(
            "reconciles_total", "Reconcile passes, by result (ok, invalid, error)", "result"
        )
        self.reconcile_seconds = Histogram(
            PREFIX + "reconcile_seconds", "Duration of one reconcile pass", registry=r
        )
        self.actions = counter(
            "actions_total", "Writes performed, by operation and kind", "op", "kind"
        )
        self.errors = counter(
            "errors_total", "Failed API calls, by operation and HTTP status", "op", "status"
        )
        self.status_writes = counter("status_writes_total", "Status subresource writes")
        self.restarts = counter(
            "instance_restarts_total",
            "Gang restarts of an instance, by role and cause",
            "role",
            "cause",
        )
        self.failovers = counter(
            "failovers_total",
            "Lost instances handled by the failover fast path, by role and cause",
            "role",
            "cause",
        )
        self.foreign_pods = counter(
            "foreign_pods_total",
            "Pod events ignored: the pod carries a cluster's labels but its controller "
            "owner is not that PDCluster (another uid)",
        )
        self.detection_seconds = histogram(
            "failure_detection_seconds",
            "From a pod's failure (API time, whole seconds) to its peers told, by role",
            "role",
        )
        self.failover_seconds = histogram(
            "failover_seconds",
            "From the pod event revealing a loss to every peer having answered, by role",
            "role",
        )
        self.rooms_failed = counter(
            "rooms_failed_total",
            "Rooms the workers report failed (from /admin/failures), by role and reason",
            "role",
            "reason",
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Clusters waiting to be reconciled", registry=r
        )

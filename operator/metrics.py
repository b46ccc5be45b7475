"""Operator metrics (Prometheus). One registry per instance so tests can build many."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdcluster.operator.api import PDClusterStatus, parse_time
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.restarts import BUDGET_WINDOW_S

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
        self.events = counter(
            "events_total",
            "Kubernetes Events the operator recorded, by type and reason",
            "type",
            "reason",
        )
        self.autoscaler_decisions = counter(
            "autoscaler_decisions_total",
            "Replica changes the autoscaler applied, by role and direction (up, down)",
            "role",
            "direction",
        )
        cluster_role = ("namespace", "pdcluster", "role")
        self.role_replicas = Gauge(
            PREFIX + "role_replicas",
            "Instances per role of each PDCluster: desired and ready (from its status)",
            (*cluster_role, "state"),
            registry=r,
        )
        self.restart_budget_used = Gauge(
            PREFIX + "restart_budget_used_ratio",
            "Gang restarts in the open budget window over the role's hourly budget (1: spent)",
            cluster_role,
            registry=r,
        )
        self._cluster_labels: dict[tuple[str, str], set[tuple[str, ...]]] = {}

    def observe_status(self, cluster: Cluster, status: PDClusterStatus, now: float) -> None:
        """Per-role replicas and restart budget use of a cluster's newly computed status."""
        key = (cluster.namespace, cluster.name)
        seen = self._cluster_labels.setdefault(key, set())
        for role in ("prefill", "decode", "colocated"):
            role_status = status.role(role)
            spec = getattr(cluster.spec, role)
            if role_status is None or spec is None:
                continue
            labels = (*key, role)
            for state, value in (("desired", role_status.desired), ("ready", role_status.ready)):
                self.role_replicas.labels(*labels, state).set(value)
            budget = spec.restart.budget
            opened = role_status.budget_window_start
            in_window = (
                role_status.restarts_in_window
                if opened is not None and now < parse_time(opened) + BUDGET_WINDOW_S
                else 0
            )
            self.restart_budget_used.labels(*labels).set(
                1.0 if budget == 0 else min(1.0, in_window / budget)
            )
            seen.add(labels)

    def forget_cluster(self, namespace: str, name: str) -> None:
        """A deleted cluster's per-role series leave /metrics."""
        for labels in self._cluster_labels.pop((namespace, name), set()):
            for state in ("desired", "ready"):
                self.role_replicas.remove(*labels, state)
            self.restart_budget_used.remove(*labels)

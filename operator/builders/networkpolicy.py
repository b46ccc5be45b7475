"""NetworkPolicies of a PDCluster: who may open connections to its pods.

- Worker pods (every role) accept connections on any port from the
  cluster's own pods — peers (bootstrap, KV transfer, the dp/tp/pp process
  group) and the router — and on the HTTP port (health, admin API) from the
  operator's pods, when the operator runs in the cluster (its namespace
  given); and on the HTTP port, where `/metrics` is served, from the
  scrapers a `ScrapeSource` names (the operator's setting, the chart's
  monitoring namespace by default); nothing else reaches them.
- Router pods accept connections on the port their Service targets, from
  anywhere: that port is the cluster's API, and who may call it is the
  Service type's and the API keys' business.

A policy only takes effect on a network plugin that enforces
NetworkPolicies; without one it is stored and ignored.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.builders import meta
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.reconcile.cluster import Cluster

API_VERSION = "networking.k8s.io/v1"
WORKER_COMPONENT = "worker"
ROUTER_ROLE = "router"
# Labels of the operator's own pods (the chart's selector labels).
OPERATOR_POD_LABELS = {names.LABEL_NAME: "pdcluster-operator"}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _policy(
    cluster: Cluster, target: str, selector: dict[str, str], ingress: list[dict[str, Any]]
) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": meta.object_meta(
            cluster.ref, names.network_policy_name(cluster.name, target), component="network"
        ),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _tcp(port: int | str) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port}


@dataclass(frozen=True)
class ScrapeSource:
    """Who may scrape the workers' metrics port: pods matching `pod_labels`
    (empty: every pod) in namespaces matching `namespace_labels` (empty:
    every namespace). Label selectors as `matchLabels`."""

    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    pod_labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def namespace(cls, name: str, pod_labels: Mapping[str, str] | None = None) -> ScrapeSource:
        """The pods (matching `pod_labels`) of namespace `name`."""
        return cls({NAMESPACE_NAME_LABEL: name}, dict(pod_labels or {}))

    def peer(self) -> dict[str, Any]:
        return {
            "namespaceSelector": {"matchLabels": dict(self.namespace_labels)},
            "podSelector": {"matchLabels": dict(self.pod_labels)},
        }


def build_network_policies(
    cluster: Cluster, operator_namespace: str = "", scrape: ScrapeSource | None = None
) -> list[Manifest]:
    """The workers' policy and the router's, in that order.

    `operator_namespace`: where the operator's pods run; empty (an operator
    outside the cluster) admits no operator pods. `scrape`: the scrapers
    admitted to the workers' metrics port; None admits none.
    """
    own_pods = {"podSelector": {"matchLabels": names.cluster_selector(cluster.name)}}
    worker_ingress: list[dict[str, Any]] = [{"from": [own_pods]}]
    if operator_namespace:
        operator_pods = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}},
            "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
        }
        worker_ingress.append({"from": [operator_pods], "ports": [_tcp(meta.HTTP_PORT)]})
    if scrape is not None:
        # /metrics shares the HTTP port (health, the worker API); the API itself
        # still wants the cluster token, which scrapers do not hold.
        worker_ingress.append({"from": [scrape.peer()], "ports": [_tcp(meta.HTTP_PORT)]})
    workers = _policy(
        cluster,
        "workers",
        {**names.cluster_selector(cluster.name), names.LABEL_COMPONENT: WORKER_COMPONENT},
        worker_ingress,
    )
    # The router Service targets the container port named "http" (HTTP_PORT).
    router = _policy(
        cluster,
        ROUTER_ROLE,
        names.role_selector(cluster.name, ROUTER_ROLE),
        [{"ports": [_tcp(meta.HTTP_PORT)]}],
    )
    return [workers, router]

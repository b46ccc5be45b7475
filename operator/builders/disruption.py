"""PodDisruptionBudgets and termination grace: what keeps an eviction or a
stop from cutting a role's capacity or its requests short.

- One PodDisruptionBudget per role and one for the router
  (`<cluster>-<role>-budget`), selecting every pod of it (all templates: a
  rollout's old and new instances alike). minAvailable counts pods: all but
  `disruptionBudget.maxUnavailable` of them (one evicted pod breaks its
  whole gang, whose other pods then turn unavailable and hold further
  evictions until it is back), and never fewer than one instance's pods
  while the role has any, so a node drain waits rather than take the
  role's last instance (a role of one instance blocks the drain of its node
  until it is moved or the budget is disabled).
  Integer minAvailable is what Kubernetes allows for pods whose controller
  (the PDCluster) is not a workload it knows. Pods that are not Ready (a
  broken gang) may always be evicted (`unhealthyPodEvictionPolicy:
  AlwaysAllow`), so a budget never holds a dead instance in place.
- `terminationGracePeriodSeconds` of a worker leader pod and of the router
  is the drain budget plus its margin (runtime/spec/disruption.py); pods
  k > 0 of an instance get one margin more, so when all of an instance's
  pods are stopped at once (a node drain, `kubectl delete`) they outlive
  their leader's drain.

Pure module.
"""

from __future__ import annotations

from pdcluster.operator import names
from pdcluster.operator.builders import meta
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.runtime.pod_layout import LEADER_POD
from pdcluster.runtime.spec import DRAIN_MARGIN_SECONDS, Role, RoleSpec

API_VERSION = "policy/v1"
ROUTER = "router"


def worker_grace_period_s(cluster: Cluster, spec: RoleSpec, pod_index: int) -> int:
    """terminationGracePeriodSeconds of pod `pod_index` of an instance of `spec`."""
    grace = spec.drain.grace_period_seconds(cluster.spec.router.request_timeout_seconds)
    return grace if pod_index == LEADER_POD else grace + DRAIN_MARGIN_SECONDS


def router_grace_period_s(cluster: Cluster) -> int:
    router = cluster.spec.router
    return router.drain.grace_period_seconds(router.request_timeout_seconds)


def _budget(cluster: Cluster, target: str, min_available: int) -> Manifest:
    return {
        "apiVersion": API_VERSION,
        "kind": "PodDisruptionBudget",
        "metadata": meta.object_meta(
            cluster.ref,
            names.disruption_budget_name(cluster.name, target),
            component="disruption",
        ),
        "spec": {
            "minAvailable": min_available,
            "selector": {
                "matchLabels": {**names.cluster_selector(cluster.name), names.LABEL_ROLE: target}
            },
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_disruption_budgets(cluster: Cluster, roles: tuple[Role, ...]) -> list[Manifest]:
    """The budgets of `roles` (those the cluster has) and of the router, where enabled."""
    out: list[Manifest] = []
    for role in roles:
        spec = cluster.spec.role_spec(role)
        if spec is None or not spec.disruption_budget.enabled:
            continue
        pods = spec.pod_layout.num_pods
        keep = spec.disruption_budget.min_available_pods(spec.replicas, pods)
        out.append(_budget(cluster, role.value, keep))
    router = cluster.spec.router
    if router.disruption_budget.enabled:
        keep = router.disruption_budget.min_available_pods(router.replicas, 1)
        out.append(_budget(cluster, ROUTER, keep))
    return out

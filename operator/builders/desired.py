"""Everything a PDCluster should own, in one value the planner compares with
what it observes.

Instances are described, not expanded: a role with 1,000 replicas is one
`DesiredRole`, and the planner builds only the instances it has to create.

Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.operator import names
from pdcluster.operator.builders.config import build_config_map, build_runtime_rbac
from pdcluster.operator.builders.disruption import (
    build_disruption_budgets,
    worker_grace_period_s,
)
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.builders.networkpolicy import ScrapeSource, build_network_policies
from pdcluster.operator.builders.router import build_router_deployment, build_router_service
from pdcluster.operator.builders.workers import (
    InstanceManifests,
    build_instance,
    build_resources,
    pod_layout,
    token_secret_for,
)
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.operator.reconcile.revision import compute_cluster_revision, compute_template_hash
from pdcluster.runtime.pod_layout import LEADER_POD
from pdcluster.runtime.spec import GangScheduling, RestartPolicySpec, Role, RolloutSpec


@dataclass(frozen=True)
class DesiredRole:
    role: Role
    replicas: int
    template_hash: str
    pods_per_instance: int
    restart: RestartPolicySpec
    # podGroup: each instance generation gets a PodGroup (builders/scheduling.py).
    gang: GangScheduling = GangScheduling.none
    rollout: RolloutSpec = RolloutSpec()
    # The leader's drain budget plus margin: the grace its deletion is given.
    grace_period_s: int | None = None

    @property
    def uses_pod_groups(self) -> bool:
        return self.gang is GangScheduling.pod_group


@dataclass(frozen=True)
class DesiredState:
    cluster: Cluster
    revision: str
    # Cluster-wide children in apply order (RBAC and config before pods use them).
    objects: tuple[Manifest, ...]
    token_secret: str
    # False when the user names their own Secret: the operator then only checks it exists.
    owns_token_secret: bool
    roles: tuple[DesiredRole, ...]

    def role(self, role: Role) -> DesiredRole | None:
        return next((r for r in self.roles if r.role == role), None)

    def instance(
        self, role: Role, index: int, leader_address: str | None = None
    ) -> InstanceManifests:
        """Instance `index`: its leader pod, and its other pods once `leader_address`
        (the leader pod's IP) is known."""
        return build_instance(self.cluster, role, index, leader_address)


def roles_of(cluster: Cluster) -> tuple[Role, ...]:
    if cluster.spec.is_disaggregated:
        return (Role.prefill, Role.decode)
    return (Role.colocated,)


def build_desired(
    cluster: Cluster, operator_namespace: str = "", scrape: ScrapeSource | None = None
) -> DesiredState:
    """Raises BuildError when the spec cannot produce valid objects.

    `operator_namespace`: where the operator's pods run, and `scrape`: who
    scrapes the workers' metrics, for the NetworkPolicies.
    """
    roles: list[DesiredRole] = []
    for role in roles_of(cluster):
        spec = cluster.spec.role_spec(role)
        assert spec is not None  # roles_of only names roles the spec has
        build_resources(spec, role)  # surface resource errors before anything is applied
        roles.append(
            DesiredRole(
                role=role,
                replicas=spec.replicas,
                template_hash=compute_template_hash(cluster.spec, role),
                pods_per_instance=pod_layout(spec).num_pods,
                restart=spec.restart,
                gang=spec.scheduling.gang,
                rollout=spec.rollout,
                grace_period_s=worker_grace_period_s(cluster, spec, LEADER_POD),
            )
        )
    objects: list[Manifest] = [
        *build_runtime_rbac(cluster),
        *build_network_policies(cluster, operator_namespace, scrape),
        *build_disruption_budgets(cluster, roles_of(cluster)),
        build_config_map(cluster),
        build_router_deployment(cluster),
        build_router_service(cluster),
    ]
    secret = token_secret_for(cluster)
    return DesiredState(
        cluster=cluster,
        revision=compute_cluster_revision(cluster.spec),
        objects=tuple(objects),
        token_secret=secret,
        owns_token_secret=secret == names.token_secret_name(cluster.name),
        roles=tuple(roles),
    )

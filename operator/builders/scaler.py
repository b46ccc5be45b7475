"""The PDClusterRoleScaler of each role: the role's /scale target.

One scaler per role of the cluster, named `<cluster>-<role>`, owned by the
PDCluster (deleting the cluster deletes its scalers). `kubectl scale`, an HPA
or KEDA write its `spec.replicas`; `autoscale/scaler_sync.py` decides how that
value and the PDCluster's `spec.<role>.replicas` follow each other.

`build_role_scaler` renders the object to *create*: its `spec.replicas` starts
at the cluster's value. Applying it again on every reconcile would take
`spec.replicas` back from whoever scaled it, so after creation only the sync
decision moves that field.

Pure module.
"""

from __future__ import annotations

from pdcluster.operator import names
from pdcluster.operator.api import (
    API_VERSION_FULL,
    SCALER_KIND,
    RoleScalerSpec,
    RoleScalerStatus,
)
from pdcluster.operator.builders.desired import roles_of
from pdcluster.operator.builders.meta import Manifest, object_meta
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.runtime.spec import Role

COMPONENT = "scaler"


def build_role_scaler(cluster: Cluster, role: Role) -> Manifest:
    """The scaler of `role`; ValueError when the cluster has no such role."""
    spec = cluster.spec.role_spec(role)
    if spec is None:
        raise ValueError(f"PDCluster {cluster.name} has no {role.value} role to scale")
    body = RoleScalerSpec(cluster=cluster.name, role=role, replicas=spec.replicas)
    return {
        "apiVersion": API_VERSION_FULL,
        "kind": SCALER_KIND,
        "metadata": object_meta(
            cluster.ref,
            names.role_scaler_name(cluster.name, role),
            COMPONENT,
            {names.LABEL_ROLE: role.value},
        ),
        "spec": body.model_dump(mode="json", by_alias=True),
    }


def build_role_scalers(cluster: Cluster) -> tuple[Manifest, ...]:
    """One scaler per role the cluster has (prefill and decode, or colocated)."""
    return tuple(build_role_scaler(cluster, role) for role in roles_of(cluster))


def build_role_scaler_status(
    cluster: Cluster, role: Role, existing: int, synced: int | None
) -> RoleScalerStatus:
    """`existing`: instances of the role that exist (the /scale `status.replicas`);
    `synced`: the replicas both sides agreed on at the last sync."""
    if existing < 0:
        raise ValueError(f"existing instances must be >= 0, got {existing}")
    selector = names.format_selector(names.role_selector(cluster.name, role))
    return RoleScalerStatus(replicas=existing, selector=selector, synced_replicas=synced)

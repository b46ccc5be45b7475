"""Pure manifest builders: one typed `Cluster` in, plain dicts out.

No client, no I/O, no clock: the same cluster always yields the same
manifests, which is what makes server-side apply idempotent and the planner
able to compare desired with observed by hash.
"""

from pdcluster.operator.builders.config import (
    build_config_map,
    build_runtime_rbac,
    build_token_secret,
    render_manifest_yaml,
)
from pdcluster.operator.builders.desired import DesiredRole, DesiredState, build_desired
from pdcluster.operator.builders.meta import BuildError, Manifest, ObjectKey, object_key
from pdcluster.operator.builders.networkpolicy import build_network_policies
from pdcluster.operator.builders.router import build_router_deployment, build_router_service
from pdcluster.operator.builders.scaler import (
    build_role_scaler,
    build_role_scaler_status,
    build_role_scalers,
)
from pdcluster.operator.builders.workers import (
    InstanceKey,
    InstanceManifests,
    build_bootstrap_service,
    build_instance,
    build_worker_pod,
    placed_spec,
    pod_layout,
)
from pdcluster.runtime.pod_layout import PodLayout

__all__ = [
    "BuildError",
    "DesiredRole",
    "DesiredState",
    "InstanceKey",
    "InstanceManifests",
    "Manifest",
    "ObjectKey",
    "PodLayout",
    "build_bootstrap_service",
    "build_config_map",
    "build_desired",
    "build_instance",
    "build_network_policies",
    "build_role_scaler",
    "build_role_scaler_status",
    "build_role_scalers",
    "build_router_deployment",
    "build_router_service",
    "build_runtime_rbac",
    "build_token_secret",
    "build_worker_pod",
    "object_key",
    "placed_spec",
    "pod_layout",
    "render_manifest_yaml",
]

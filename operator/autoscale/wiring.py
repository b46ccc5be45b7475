"""What the per-cluster autoscaling loop reads and writes, decided from API objects.

The loop (`reconcile/autoscaling.py`) lists the cluster's pods and reads each
role's scaler; the functions here turn those raw objects into what to do:

Only worker pods the PDCluster controls (owner uid) count: a pod that merely
carries its labels is never scraped with the cluster token, never names the
Secret the token is read from, and is no instance.

- `scrape_targets(pods)`: per autoscaled role, the `/metrics` URL of each
  Ready instance's leader pod (pod index 0: the pod that serves HTTP), by pod
  name. A pod being deleted, not Ready, without an address or of another
  role is left out: a Ready instance beyond the replicas is being drained and
  is no capacity (`step.py` caps `ready` at replicas the same way).
- `existing_instances(pods)`: per role, the instances that exist (any pod
  of the instance not being deleted): the scaler's /scale `status.replicas`.
- `plan_scaler(cluster, role, scaler, existing)`: the scaler to create (none
  yet), the sync decision (`scaler_sync.py`: which side's replicas win) and
  the scaler's status to write.
- `stale_scalers(scalers, cluster_uid, roles)`: the cluster's scalers of
  roles it no longer has (a switch between PD and colocated), to delete.
- `wait_seconds(step, now)`: how long the loop sleeps after a step.
- `status_patch(cluster, step)`: the step's `status.<role>.autoscaling`
  with the planner's windows (`persisted.py`) and where the metric was read
  (`router_metrics.py`).

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import names
from pdcluster.operator.api import RoleScalerStatus
from pdcluster.operator.autoscale.persisted import status_patch_with_windows
from pdcluster.operator.autoscale.router_metrics import (
    SOURCE_ROUTER,
    SOURCE_WORKERS,
    is_read_from_router,
    status_patch_with_sources,
)
from pdcluster.operator.autoscale.scaler_sync import GpuBudget, ScalerSync, compute_scaler_sync
from pdcluster.operator.autoscale.step import AutoscaleStep
from pdcluster.operator.builders.meta import Manifest
from pdcluster.operator.builders.scaler import build_role_scaler, build_role_scaler_status
from pdcluster.operator.failover.pod_facts import PodFacts, parse_pod_facts
from pdcluster.operator.reconcile.cluster import Cluster, ClusterRef
from pdcluster.runtime.spec import Role

# The loop never sleeps longer than this, so a scaler edited while no role
# autoscales is synced soon even if its watch event was missed.
MAX_WAIT_S = 30.0
# Nor shorter: a step that names a due time already past runs again soon, not in a spin.
MIN_WAIT_S = 0.5


class ScalerObjectError(ValueError):
    """A scaler object does not have the shape its CRD gives it."""


def _leader(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(names.LABEL_POD_INDEX, "0")) == "0"


def _facts(pods: Iterable[Mapping[str, Any]], cluster: ClusterRef) -> list[PodFacts]:
    out = []
    for pod in pods:
        facts = parse_pod_facts(pod)
        if (
            facts is not None
            and (facts.cluster, facts.cluster_uid) == (cluster.name, cluster.uid)
            and not facts.deleting
        ):
            out.append(facts)
    return out


def scrape_targets(
    pods: Iterable[Mapping[str, Any]], cluster: ClusterRef, roles: Iterable[Role]
) -> dict[Role, dict[str, str]]:
    """Per role in `roles`: pod name -> /metrics URL of each Ready instance's leader."""
    wanted = set(roles)
    out: dict[Role, dict[str, str]] = {role: {} for role in wanted}
    listed = [p for p in pods if _leader(p)]
    for facts in _facts(listed, cluster):
        if facts.role in wanted and facts.ready and facts.http_url is not None:
            out[facts.role][facts.name] = f"{facts.http_url}/metrics"
    return out


def token_secret(pods: Iterable[Mapping[str, Any]], cluster: ClusterRef) -> str | None:
    """The Secret the cluster's worker pods read their token from (None: no pod yet)."""
    for facts in _facts(pods, cluster):
        if facts.token_secret:
            return facts.token_secret
    return None


def existing_instances(pods: Iterable[Mapping[str, Any]], cluster: ClusterRef) -> dict[Role, int]:
    """Per role, the number of instances with a pod not being deleted."""
    seen: dict[Role, set[int]] = {}
    for facts in _facts(pods, cluster):
        seen.setdefault(facts.role, set()).add(facts.instance)
    return {role: len(instances) for role, instances in seen.items()}


@dataclass(frozen=True)
class ScalerPlan:
    create: Manifest | None  # the scaler to create first (it did not exist)
    sync: ScalerSync
    status: RoleScalerStatus

    def status_patch(self) -> dict[str, Any]:
        """A merge patch of the scaler's status subresource."""
        return {"status": self.status.to_wire()}


def _scaler_numbers(scaler: Mapping[str, Any]) -> tuple[int, int | None]:
    spec = scaler.get("spec")
    replicas = spec.get("replicas") if isinstance(spec, Mapping) else None
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        name = (scaler.get("metadata") or {}).get("name", "?")
        raise ScalerObjectError(f"scaler {name}: spec.replicas must be an integer >= 0")
    status = scaler.get("status")
    synced = status.get("syncedReplicas") if isinstance(status, Mapping) else None
    if not isinstance(synced, int) or isinstance(synced, bool) or synced < 0:
        synced = None  # a lost or foreign status: counts as "the PDCluster changed"
    return replicas, synced


def gpu_budget(cluster: Cluster, role: Role) -> GpuBudget | None:
    """`spec.autoscaling.maxTotalGPUs` for `role`'s scaler (None: no budget)."""
    spec = cluster.spec
    total, role_spec = spec.autoscaling.max_total_gpus, spec.role_spec(role)
    if total is None or role_spec is None or role not in (Role.prefill, Role.decode):
        return None  # the budget counts prefill and decode GPUs only
    others = sum(
        s.replicas * s.gpus_per_instance
        for r in (Role.prefill, Role.decode)
        if r is not role and (s := spec.role_spec(r)) is not None
    )
    return GpuBudget(total, role_spec.gpus_per_instance, others)


def plan_scaler(
    cluster: Cluster, role: Role, scaler: Mapping[str, Any] | None, existing: int
) -> ScalerPlan:
    """The writes that create `role`'s scaler if needed and make both sides agree.

    ValueError when the cluster has no such role or the scaler is malformed.
    """
    role_spec = cluster.spec.role_spec(role)
    if role_spec is None:
        raise ValueError(f"PDCluster {cluster.name} has no {role.value} role to scale")
    create = None
    if scaler is None:
        create = build_role_scaler(cluster, role)
        scaler_replicas, synced = role_spec.replicas, None
    else:
        scaler_replicas, synced = _scaler_numbers(scaler)
    sync = compute_scaler_sync(
        role,
        role_spec.replicas,
        scaler_replicas,
        synced,
        role_spec.autoscaling,
        gpu_budget(cluster, role),
    )
    if create is not None and sync.scaler_replicas is not None:
        create = {**create, "spec": {**create["spec"], "replicas": sync.scaler_replicas}}
        sync = ScalerSync(
            cluster_replicas=sync.cluster_replicas,
            scaler_replicas=None,
            synced=sync.synced,
            reason=sync.reason,
            events=sync.events,
        )
    status = build_role_scaler_status(cluster, role, existing, sync.synced)
    return ScalerPlan(create=create, sync=sync, status=status)


def stale_scalers(
    scalers: Iterable[Mapping[str, Any]], cluster_uid: str, roles: Iterable[Role]
) -> list[tuple[str, str]]:
    """(name, uid) of each scaler owned by the cluster whose role it no longer has."""
    kept = {role.value for role in roles}
    out = []
    for scaler in scalers:
        meta = scaler.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        owned = any(isinstance(o, Mapping) and o.get("uid") == cluster_uid for o in owners)
        role = (scaler.get("spec") or {}).get("role")
        if owned and role not in kept and meta.get("name") and not meta.get("deletionTimestamp"):
            out.append((str(meta["name"]), str(meta.get("uid", ""))))
    return out


def wait_seconds(step: AutoscaleStep | None, now: float) -> float:
    """Seconds until the loop's next pass after `step` (None: no role autoscales)."""
    if step is None or step.next_due_at is None:
        return MAX_WAIT_S
    return min(MAX_WAIT_S, max(MIN_WAIT_S, step.next_due_at - now))


def status_patch(cluster: Cluster, step: AutoscaleStep) -> dict[str, Any]:
    """The merge patch of the status subresource that writes `step`'s decisions."""
    sources = {
        role: SOURCE_ROUTER if is_read_from_router(cluster, role) else SOURCE_WORKERS
        for role in step.statuses
    }
    return status_patch_with_sources(status_patch_with_windows(step), sources)

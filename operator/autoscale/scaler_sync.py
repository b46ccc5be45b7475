"""Keep a role's PDClusterRoleScaler and the PDCluster's replicas equal.

Two places hold one role's replicas: `spec.<role>.replicas` of the PDCluster
(what the user applies, what the built-in autoscaler patches) and
`spec.replicas` of the role's scaler (what `kubectl scale`, an HPA or KEDA
write through /scale). The scaler's `status.syncedReplicas` records the value
both held at the last sync, so a sync sees which side moved since.

The rule, one table (`WINNER`), read by `decide_scaler_sync`:

| changed since the last sync | value taken |
|---|---|
| neither (both equal the record) | nothing to do |
| the PDCluster only | the PDCluster's, copied to the scaler |
| the scaler only | the scaler's, copied to the PDCluster |
| both, to different values | **the scaler's** (with a `ReplicasConflict` Event) |

Both sides at one value is agreement, whatever changed. No record yet (a
scaler just created, or one whose status was lost) counts as "the PDCluster
changed": the cluster's spec is the source the scaler was built from.
The scaler wins a conflict because it is the one place a scale decision is
made on purpose (a person's `kubectl scale`, an HPA's step), while a
PDCluster edit often re-applies a whole manifest that was not about replicas.

With the role's `autoscaling` set, the value taken is clamped to
`[minReplicas, maxReplicas]` and both sides get the bound (a
`ReplicasClamped` Event); the built-in planner clamps the same way, so the
two never disagree. With `spec.autoscaling.maxTotalGPUs` set, a value taken
from the scaler is also held to the budget (`GpuBudget`): the role may grow
only into the GPUs the other roles leave, as the planner does, whether or
not the role autoscales itself (a `kubectl scale` or an HPA could otherwise
spend what the budget forbids); it is never lowered below the replicas the
PDCluster already has. Otherwise nothing is clamped: hands off.

Pure module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdcluster.runtime.autoscale.planner import DecisionEvent
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec


class Changed(enum.StrEnum):
    """Which side's replicas differ from the last synced value."""

    neither = "neither"
    cluster = "cluster"
    scaler = "scaler"
    both = "both"


class Side(enum.StrEnum):
    cluster = "cluster"
    scaler = "scaler"


# Whose value is taken; None: nothing moved.
WINNER: dict[Changed, Side | None] = {
    Changed.neither: None,
    Changed.cluster: Side.cluster,
    Changed.scaler: Side.scaler,
    Changed.both: Side.scaler,
}


class SyncReason(enum.StrEnum):
    in_sync = "InSync"
    from_cluster = "FromCluster"
    from_scaler = "FromScaler"
    conflict = "ReplicasConflict"  # both changed: the scaler won
    clamped = "ReplicasClamped"


@dataclass(frozen=True)
class GpuBudget:
    """`spec.autoscaling.maxTotalGPUs` as one role's scaler sees it."""

    max_total_gpus: int
    gpus_per_instance: int  # of the role being synced
    others_gpus: int  # what the PDCluster's other roles hold (replicas x GPUs)

    def max_replicas(self) -> int:
        """The most instances of the role the budget leaves room for."""
        return max(0, self.max_total_gpus - self.others_gpus) // self.gpus_per_instance


@dataclass(frozen=True)
class ScalerSync:
    """What to write. None: leave that side as it is."""

    cluster_replicas: int | None  # patch spec.<role>.replicas of the PDCluster
    scaler_replicas: int | None  # patch spec.replicas of the scaler
    synced: int  # the scaler's status.syncedReplicas after the writes
    reason: SyncReason
    events: tuple[DecisionEvent, ...] = ()

    @property
    def is_noop(self) -> bool:
        return self.cluster_replicas is None and self.scaler_replicas is None


def changed_since(synced: int | None, cluster_replicas: int, scaler_replicas: int) -> Changed:
    """Which side moved away from the last synced value (None: no record)."""
    if synced is None:
        return Changed.cluster
    moved_cluster, moved_scaler = cluster_replicas != synced, scaler_replicas != synced
    if moved_cluster and moved_scaler:
        return Changed.both
    if moved_cluster:
        return Changed.cluster
    return Changed.scaler if moved_scaler else Changed.neither


def decide_scaler_sync(
    role: Role,
    cluster_replicas: int,
    scaler_replicas: int,
    changed: Changed,
    autoscaling: RoleAutoscalingSpec | None,
    budget: GpuBudget | None = None,
) -> ScalerSync:
    """The writes that make both sides equal; ValueError on inconsistent input."""
    if min(cluster_replicas, scaler_replicas) < 0:
        raise ValueError(
            f"replicas must be >= 0: cluster {cluster_replicas}, scaler {scaler_replicas}"
        )
    winner = WINNER[changed]
    if winner is None and cluster_replicas != scaler_replicas:
        raise ValueError(
            f"{role.value}: neither side changed, yet the cluster has {cluster_replicas} "
            f"and the scaler {scaler_replicas}"
        )
    if cluster_replicas == scaler_replicas:
        value, reason = cluster_replicas, SyncReason.in_sync
    elif winner is Side.cluster:
        value, reason = cluster_replicas, SyncReason.from_cluster
    else:
        value = scaler_replicas
        reason = SyncReason.conflict if changed is Changed.both else SyncReason.from_scaler
    events: list[DecisionEvent] = []
    if reason is SyncReason.conflict:
        events.append(
            DecisionEvent(
                "Normal",
                reason.value,
                f"{role.value}: PDCluster replicas {cluster_replicas} and scaler replicas "
                f"{scaler_replicas} both changed since the last sync: the scaler wins",
            )
        )
    if autoscaling is not None:
        lo, hi = autoscaling.min_replicas, autoscaling.max_replicas
        bound = min(max(value, lo), hi)
        if bound != value:
            events.append(
                DecisionEvent(
                    "Normal",
                    SyncReason.clamped.value,
                    f"{role.value}: replicas {value} from the {(winner or Side.cluster).value} "
                    f"is outside autoscaling bounds [{lo}, {hi}]: set to {bound}",
                )
            )
            value, reason = bound, SyncReason.clamped
    if budget is not None and winner is Side.scaler:
        cap = max(budget.max_replicas(), min(value, cluster_replicas))
        if value > cap:
            events.append(
                DecisionEvent(
                    "Normal",
                    SyncReason.clamped.value,
                    f"{role.value}: replicas {value} from the scaler would need "
                    f"{value * budget.gpus_per_instance} GPUs with {budget.others_gpus} held "
                    f"by the other roles, over autoscaling.maxTotalGPUs "
                    f"({budget.max_total_gpus}): set to {cap}",
                )
            )
            value, reason = cap, SyncReason.clamped
    return ScalerSync(
        cluster_replicas=value if value != cluster_replicas else None,
        scaler_replicas=value if value != scaler_replicas else None,
        synced=value,
        reason=reason,
        events=tuple(events),
    )


def compute_scaler_sync(
    role: Role,
    cluster_replicas: int,
    scaler_replicas: int,
    synced: int | None,
    autoscaling: RoleAutoscalingSpec | None,
    budget: GpuBudget | None = None,
) -> ScalerSync:
    """`decide_scaler_sync` with `changed` read from the scaler's last synced value."""
    changed = changed_since(synced, cluster_replicas, scaler_replicas)
    return decide_scaler_sync(role, cluster_replicas, scaler_replicas, changed, autoscaling, budget)

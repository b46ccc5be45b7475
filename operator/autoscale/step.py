"""One autoscaling interval of a PDCluster, as one pure function.

`compute_autoscale_step(cluster, status, scrapes, history, now)` composes
`samples` (metric text → one sample per role) and `planner` (samples →
decisions) and returns everything the caller then writes: the replicas
patches, the Events, and `status.<role>.autoscaling`. The caller (the loop
per PDCluster, `reconcile/autoscaling.py`) fetches the scrapes, applies the
result, and keeps the returned history for the next call — only once the
patches were applied, as the planner requires; a failed write means the next
call gets the old history again (its latency deltas then span two intervals,
which is harmless).

Inputs:
- `cluster`, `status`: the PDCluster's validated spec and its stored status.
  Per role, replicas = `spec.<role>.replicas`; ready = `status.<role>.ready`
  (at most replicas: a Ready instance beyond them is being drained and is no
  capacity); starting = replicas - ready (an instance not created yet, still
  starting or being restarted is capacity on the move, which holds
  scale-downs).
- `scrapes`: per role, the `/metrics` body of each Ready instance's leader
  pod (the pod that serves HTTP), keyed by pod name, with the time it was
  fetched. A body that is not Prometheus text is left out and named in
  `unreadable` (and in the role's MetricMissing message, if it comes to that).

Intervals: a role is decided when its `intervalSeconds` passed since its
last decision (`DUE_EARLY_S` early is on time: a timer fires a little early
or late); a role not due counts in the GPU budget but gets no decision, its
previous scrapes are kept, and `next_due_at` says when to call again.

First interval: a p90 metric needs two scrapes of an instance (the buckets'
difference). When none of a role's scraped pods has a previous scrape (the
first interval, or every pod replaced), "no sample" is expected: the role
holds with reason `FirstInterval` and no `MetricMissing` Event.

Events keep the planner's reasons (`ScaledUp`, `ScaledDown`,
`ReplicasClamped`, `CappedByBudget`, `MetricMissing`, `MetricStale`,
`NoReadyInstance`); each message names the metric, its value, the target and
the decision.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdcluster.operator.api import PDClusterStatus, RoleAutoscalingStatus, format_time
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.runtime.autoscale.planner import (
    Decision,
    DecisionEvent,
    DecisionReason,
    PlannerHistory,
    RoleObservation,
    compute_plan,
)
from pdcluster.runtime.autoscale.samples import MetricsText, RoleReading, WorkerScrape, read_role
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec

# A role whose interval ends this close after `now` is decided now.
DUE_EARLY_S = 0.5

# Not a planner reason: the step's own, for a p90 that has no interval yet.
FIRST_INTERVAL = "FirstInterval"

# Planner events whose message already says metric, target and decision.
_COMPLETE_EVENTS = frozenset({"ScaledUp", "ScaledDown", DecisionReason.capped_by_budget.value})
_SCALED_ROLES = (Role.prefill, Role.decode)
_MISSING = DecisionReason.metric_missing.value


# A pod's /metrics body and when it was fetched.
PodScrape = MetricsText


@dataclass(frozen=True)
class AutoscaleHistory:
    planner: PlannerHistory = field(default_factory=PlannerHistory)
    # Each role's scrapes at its last decision, by pod name (the p90 deltas start there).
    scrapes: Mapping[Role, Mapping[str, WorkerScrape]] = field(default_factory=dict)
    decided_at: Mapping[Role, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplicasPatch:
    role: Role
    replicas: int

    def body(self) -> dict[str, Any]:
        """A merge patch of the PDCluster."""
        return {"spec": {self.role.value: {"replicas": self.replicas}}}


@dataclass(frozen=True)
class AutoscaleStep:
    patches: tuple[ReplicasPatch, ...]
    events: tuple[DecisionEvent, ...]
    # status.<role>.autoscaling to write; None clears it (autoscaling was turned off).
    statuses: Mapping[Role, RoleAutoscalingStatus | None]
    history: AutoscaleHistory
    next_due_at: float | None  # None: no role autoscales
    unreadable: tuple[str, ...] = ()  # "<pod>: <why>" of bodies that were not metrics text

    def status_patch(self) -> dict[str, Any]:
        """A merge patch of the status subresource (only the roles decided now)."""
        roles: dict[str, Any] = {}
        for role, status in self.statuses.items():
            wire = None if status is None else status.model_dump(by_alias=True, exclude_none=True)
            roles[role.value] = {"autoscaling": wire}
        return {"status": roles}


def _is_due(role: Role, interval_s: float, history: AutoscaleHistory, now: float) -> bool:
    last = history.decided_at.get(role)
    return last is None or now >= last + interval_s - DUE_EARLY_S


def roles_due(cluster: Cluster, history: AutoscaleHistory, now: float) -> tuple[Role, ...]:
    """The autoscaled roles whose interval ended by `now`: the only ones worth scraping."""
    out = []
    for role in _SCALED_ROLES if cluster.spec.is_disaggregated else ():
        cfg = _autoscaling(cluster, role)
        if cfg is not None and _is_due(role, cfg.interval_seconds, history, now):
            out.append(role)
    return tuple(out)


def compute_autoscale_step(
    cluster: Cluster,
    status: PDClusterStatus,
    scrapes: Mapping[Role, Mapping[str, PodScrape]],
    history: AutoscaleHistory,
    now: float,
) -> AutoscaleStep:
    """This interval's patches, Events and status for every autoscaled role that is due."""
    spec = cluster.spec
    observations: dict[Role, RoleObservation] = {}
    readings: dict[Role, RoleReading[str]] = {}
    unreadable: dict[Role, list[str]] = {}
    cleared: dict[Role, RoleAutoscalingStatus | None] = {}
    for role in _SCALED_ROLES if spec.is_disaggregated else ():
        role_spec = spec.role_spec(role)
        assert role_spec is not None  # a disaggregated spec has both roles
        stored = status.role(role.value)
        ready = min(stored.ready if stored else 0, role_spec.replicas)
        cfg = role_spec.autoscaling
        if cfg is None and stored is not None and stored.autoscaling is not None:
            cleared[role] = None
        due = cfg is not None and _is_due(role, cfg.interval_seconds, history, now)
        reading = None
        if cfg is not None and due:
            reading = read_role(
                cfg.target.metric, history.scrapes.get(role, {}), scrapes.get(role, {})
            )
            readings[role] = reading
            unreadable[role] = [f"{pod}: {why}" for pod, why in reading.unreadable]
        observations[role] = RoleObservation(
            replicas=role_spec.replicas,
            ready=ready,
            starting=role_spec.replicas - ready,
            gpus_per_instance=role_spec.gpus_per_instance,
            autoscaling=cfg if due else None,
            sample=None if reading is None else reading.sample,
        )
    plan = compute_plan(observations, spec.autoscaling.max_total_gpus, now, history.planner)

    patches: list[ReplicasPatch] = []
    events: list[DecisionEvent] = []
    statuses: dict[Role, RoleAutoscalingStatus | None] = dict(cleared)
    for role, decision in plan.decisions.items():
        reason: str = decision.reason.value
        message = decision.message
        role_events = [_event_with_numbers(decision, e) for e in decision.events]
        if decision.reason is DecisionReason.metric_missing:
            if role in readings and readings[role].is_first_interval:
                reason = FIRST_INTERVAL
                message = f"first scrape of every instance: the {decision.metric.value} "
                message += "needs a previous one; deciding from the next interval"
                role_events = [e for e in role_events if e.reason != _MISSING]
            elif unreadable.get(role):
                extra = f"; unreadable /metrics: {', '.join(unreadable[role])}"
                message += extra
                role_events = [replace(e, message=e.message + extra) for e in role_events]
        events.extend(role_events)
        if decision.is_change:
            patches.append(ReplicasPatch(role, decision.desired))
        statuses[role] = _role_status(decision, reason, message, status, observations[role], now)

    kept = AutoscaleHistory(
        planner=PlannerHistory({**history.planner.roles, **plan.history.roles}),
        scrapes={**history.scrapes, **{r: rd.scrapes for r, rd in readings.items()}},
        decided_at={**history.decided_at, **{role: now for role in plan.decisions}},
    )
    due_times = [
        kept.decided_at[role] + cfg.interval_seconds
        for role in observations
        if (cfg := _autoscaling(cluster, role)) is not None and role in kept.decided_at
    ]
    return AutoscaleStep(
        patches=tuple(patches),
        events=tuple(events),
        statuses=statuses,
        history=kept,
        next_due_at=min(due_times) if due_times else None,
        unreadable=tuple(u for role in unreadable for u in unreadable[role]),
    )


def _autoscaling(cluster: Cluster, role: Role) -> RoleAutoscalingSpec | None:
    spec = cluster.spec.role_spec(role)
    return None if spec is None else spec.autoscaling


def _event_with_numbers(decision: Decision, event: DecisionEvent) -> DecisionEvent:
    if event.reason in _COMPLETE_EVENTS:
        return event
    value = "missing" if decision.value is None else f"{decision.value:.4g}"
    if decision.is_change:
        outcome = f"replicas {decision.current} -> {decision.desired}"
    else:
        outcome = f"replicas held at {decision.current}"
    numbers = f"{decision.metric.value} {value}, target {decision.target:.4g}; {outcome}"
    return replace(event, message=f"{event.message} ({numbers})")


def _role_status(
    decision: Decision,
    reason: str,
    message: str,
    status: PDClusterStatus,
    obs: RoleObservation,
    now: float,
) -> RoleAutoscalingStatus:
    stored = status.role(decision.role.value)
    prev = stored.autoscaling if stored is not None else None
    if obs.sample is not None:
        last_value: float | None = obs.sample.value
        last_value_time: str | None = format_time(obs.sample.at)
    elif prev is not None and prev.metric == decision.metric.value:
        last_value, last_value_time = prev.last_value, prev.last_value_time
    else:
        last_value, last_value_time = None, None
    if decision.is_change:
        last_scale_time: str | None = format_time(now)
    else:
        last_scale_time = prev.last_scale_time if prev is not None else None
    return RoleAutoscalingStatus(
        metric=decision.metric.value,
        target=decision.target,
        last_value=last_value,
        last_value_time=last_value_time,
        current=decision.current,
        desired=decision.desired,
        reason=reason,
        message=message[:1024],
        last_decision_time=format_time(now),
        last_scale_time=last_scale_time,
    )

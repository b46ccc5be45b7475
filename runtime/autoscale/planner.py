"""The autoscaling planner: each role's desired replicas from what was observed.

`compute_plan(observations, max_total_gpus, now, history)` is a pure
function; the caller scrapes, applies the decisions, and keeps the returned
history for the next call (only once the decisions were applied: a desired
value the caller did not write would read as a manual change next time).

One interval, per role with `autoscaling` set (a role without it gets no
decision, but its GPUs count in the budget):

1. Bounds. replicas outside [minReplicas, maxReplicas] (a manual change) →
   desired = the nearest bound at once, reason `ReplicasClamped`; the
   history restarts there. A bound wins over the budget and the starting
   hold. A manual change inside the bounds is accepted: the history restarts
   at it, so the windows keep the planner from undoing it at once.
2. Metric. No sample → hold (`MetricMissing`); a sample older than
   `STALE_AFTER_INTERVALS` intervals → hold (`MetricStale`); no Ready
   instance → hold (`NoReadyInstance`). Each hold carries a Warning event.
3. Recommendation. ratio = value / target. |ratio - 1| <= tolerance → the
   current replicas. Otherwise ceil(ready * ratio), never below the current
   replicas when ratio > 1 and never above when ratio < 1 — so capacity is
   only the Ready instances: one that is starting is already counted in
   replicas and is not added twice. Clamped to [min, max], then recorded.
4. Stabilization (as the Kubernetes HPA does it). The recommendations form
   a step function of time. up = min of it over the last scaleUp window,
   down = max of it over the last scaleDown window. up > replicas → scale up
   to up; down < replicas → scale down to down; else hold. A first call
   records the current replicas first, so the planner never acts on a window
   it has not seen; a spike shorter than the window never scales.
   Consequence (tested): after a change in one direction, a change in the
   other direction waits at least that direction's window.
5. Step: at most maxStep instances added or removed per interval.
6. Starting hold: no scale-down while an instance of *either* role is
   starting (replicas > ready): the cluster's capacity is still moving.
7. Budget (`maxTotalGPUs`, one GPU per rank). GPUs in use = sum over roles
   of replicas * GPUs per instance (a scale-down frees its GPUs from the
   next interval, once replicas dropped). Increases are granted in order of
   pressure (value / target, highest first; a tie goes to decode, whose
   shortage stalls requests already admitted), each as far as the free GPUs
   allow; a role that gets less than it asked for has reason
   `CappedByBudget` and a Warning event. Clamps to minReplicas are granted
   before any metric increase.

Invariants (tested over random traces): desired within [min, max]; a
metric increase never takes the GPUs in use above the budget; no
metric-driven scale-down while an instance is starting; no direction change
inside a window.

Pure module: no clock, no I/O; `now` and the samples' times are seconds on
one clock chosen by the caller.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from pdcluster.runtime.spec import AutoscalingMetric, Role, RoleAutoscalingSpec

# A sample older than this many intervals is stale: the planner holds.
STALE_AFTER_INTERVALS = 3

# Budget priority among equal pressures: first in this tuple wins.
BUDGET_TIE_ORDER = (Role.decode, Role.prefill)


class DecisionReason(enum.StrEnum):
    scale_up = "ScaleUp"
    scale_down = "ScaleDown"
    within_tolerance = "WithinTolerance"
    stabilizing = "Stabilizing"  # the recommendation moved, its window is not full yet
    clamped = "ReplicasClamped"
    metric_missing = "MetricMissing"
    metric_stale = "MetricStale"
    no_ready_instance = "NoReadyInstance"
    held_while_starting = "ScaleDownHeldWhileStarting"
    capped_by_budget = "CappedByBudget"


@dataclass(frozen=True)
class Sample:
    """One metric value of a role (already per instance where the metric is) and when."""

    value: float
    at: float


@dataclass(frozen=True)
class RoleObservation:
    replicas: int  # spec.<role>.replicas now
    ready: int  # instances Ready
    starting: int  # instances created and not Ready yet
    gpus_per_instance: int
    autoscaling: RoleAutoscalingSpec | None
    sample: Sample | None = None

    def __post_init__(self) -> None:
        if min(self.replicas, self.ready, self.starting) < 0 or self.gpus_per_instance < 1:
            raise ValueError(f"counts must be >= 0 and gpus_per_instance >= 1: {self}")


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class RoleHistory:
    recommendations: tuple[Recommendation, ...] = ()
    last_desired: int | None = None


@dataclass(frozen=True)
class PlannerHistory:
    roles: Mapping[Role, RoleHistory] = field(default_factory=dict)


@dataclass(frozen=True)
class DecisionEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    role: Role
    current: int
    desired: int
    reason: DecisionReason
    message: str
    metric: AutoscalingMetric
    target: float
    value: float | None  # the sample's value; None when there was none
    events: tuple[DecisionEvent, ...] = ()

    @property
    def is_change(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Plan:
    decisions: Mapping[Role, Decision]
    history: PlannerHistory


def compute_plan(
    observations: Mapping[Role, RoleObservation],
    max_total_gpus: int | None,
    now: float,
    history: PlannerHistory,
) -> Plan:
    """Every autoscaled role's Decision for this interval, and the history to keep."""
    num_starting = sum(o.starting for o in observations.values())
    decisions: dict[Role, Decision] = {}
    histories: dict[Role, RoleHistory] = {}
    pressures: dict[Role, float] = {}
    for role, obs in observations.items():
        if obs.autoscaling is None:
            continue
        past = history.roles.get(role, RoleHistory())
        decision, kept, pressure = _decide_role(role, obs, now, past, num_starting)
        decisions[role], histories[role], pressures[role] = decision, kept, pressure
    if max_total_gpus is not None:
        decisions = _apply_budget(observations, decisions, pressures, max_total_gpus)
    histories = {
        role: replace(h, last_desired=decisions[role].desired) for role, h in histories.items()
    }
    return Plan(decisions, PlannerHistory(histories))


def _decide_role(
    role: Role, obs: RoleObservation, now: float, past: RoleHistory, num_starting: int
) -> tuple[Decision, RoleHistory, float]:
    cfg = obs.autoscaling
    assert cfg is not None
    target = cfg.target
    cur = obs.replicas
    value = obs.sample.value if obs.sample is not None else None

    def decide(
        desired: int, reason: DecisionReason, message: str, *events: DecisionEvent
    ) -> Decision:
        return Decision(
            role, cur, desired, reason, message, target.metric, target.value, value, events
        )

    def hold(reason: DecisionReason, message: str) -> tuple[Decision, RoleHistory, float]:
        warning = DecisionEvent("Warning", reason.value, f"{role.value}: {message}")
        return decide(cur, reason, message, warning), past, 0.0

    lo, hi = cfg.min_replicas, cfg.max_replicas
    if not lo <= cur <= hi:
        bound = min(max(cur, lo), hi)
        message = f"replicas {cur} is outside autoscaling bounds [{lo}, {hi}]: set to {bound}"
        event = DecisionEvent("Normal", DecisionReason.clamped.value, f"{role.value}: {message}")
        seeded = RoleHistory((Recommendation(now, bound),))
        return decide(bound, DecisionReason.clamped, message, event), seeded, math.inf
    if not past.recommendations or (past.last_desired is not None and past.last_desired != cur):
        # First look, or a manual change inside the bounds: the windows start here.
        past = RoleHistory((Recommendation(now, cur),))
    sample = obs.sample
    if sample is None:
        return hold(DecisionReason.metric_missing, f"no {target.metric.value} sample: holding")
    age = now - sample.at
    if age > STALE_AFTER_INTERVALS * cfg.interval_seconds:
        return hold(
            DecisionReason.metric_stale,
            f"the last {target.metric.value} sample is {age:.0f}s old: holding",
        )
    if obs.ready == 0:
        return hold(DecisionReason.no_ready_instance, "no Ready instance to measure: holding")

    ratio = sample.value / target.value
    if abs(ratio - 1) <= cfg.tolerance:
        raw = cur
    elif ratio > 1:
        raw = max(cur, math.ceil(obs.ready * ratio))
    else:
        raw = min(cur, math.ceil(obs.ready * ratio))
    raw = min(max(raw, lo), hi)
    window = max(cfg.scale_up.stabilization_seconds, cfg.scale_down.stabilization_seconds)
    recs = _prune((*past.recommendations, Recommendation(now, raw)), now - window)
    kept = RoleHistory(recs, past.last_desired)
    up = min(_window_values(recs, now - cfg.scale_up.stabilization_seconds))
    down = max(_window_values(recs, now - cfg.scale_down.stabilization_seconds))
    about = (
        f"{target.metric.value} {sample.value:.4g} vs target {target.value:.4g} "
        f"(tolerance {cfg.tolerance:.0%}, {obs.ready} ready)"
    )
    if up > cur:
        desired = min(up, cur + cfg.max_step)
        event = DecisionEvent("Normal", "ScaledUp", f"{role.value} {cur} -> {desired}: {about}")
        return decide(desired, DecisionReason.scale_up, about, event), kept, ratio
    if down < cur:
        if num_starting:
            message = f"{about}; scale-down held: {num_starting} instance(s) starting"
            return decide(cur, DecisionReason.held_while_starting, message), kept, ratio
        desired = max(down, cur - cfg.max_step)
        event = DecisionEvent("Normal", "ScaledDown", f"{role.value} {cur} -> {desired}: {about}")
        return decide(desired, DecisionReason.scale_down, about, event), kept, ratio
    reason = DecisionReason.within_tolerance if raw == cur else DecisionReason.stabilizing
    return decide(cur, reason, about), kept, ratio


def _window_values(recs: tuple[Recommendation, ...], start: float) -> list[int]:
    """The step function over (start, now]: the value in force at `start`, then later ones."""
    before = [r.replicas for r in recs if r.at <= start]
    return before[-1:] + [r.replicas for r in recs if r.at > start]


def _prune(recs: tuple[Recommendation, ...], start: float) -> tuple[Recommendation, ...]:
    """Drop what no window reaches: keep the one in force at `start` and everything after."""
    older = [i for i, r in enumerate(recs) if r.at <= start]
    return recs[older[-1] :] if older else recs


def _apply_budget(
    observations: Mapping[Role, RoleObservation],
    decisions: dict[Role, Decision],
    pressures: Mapping[Role, float],
    budget: int,
) -> dict[Role, Decision]:
    free = budget - sum(o.replicas * o.gpus_per_instance for o in observations.values())
    growing = [r for r, d in decisions.items() if d.desired > d.current]
    growing.sort(key=lambda r: (-pressures[r], BUDGET_TIE_ORDER.index(r)))
    out = dict(decisions)
    for role in growing:
        d, gpus = decisions[role], observations[role].gpus_per_instance
        want = d.desired - d.current
        if d.reason is DecisionReason.clamped:  # a bound wins over the budget
            free -= want * gpus
            continue
        grant = max(0, min(want, free // gpus))
        free -= grant * gpus
        if grant == want:
            continue
        desired = d.current + grant
        message = (
            f"{d.message}; capped by maxTotalGPUs ({budget}): {d.current + want} wanted, "
            f"{desired} fit"
        )
        capped = DecisionEvent(
            "Warning", DecisionReason.capped_by_budget.value, f"{role.value}: {message}"
        )
        events = tuple(e for e in d.events if e.reason != "ScaledUp" or grant)
        if grant:
            events = tuple(
                replace(e, message=f"{role.value} {d.current} -> {desired}: {message}")
                if e.reason == "ScaledUp"
                else e
                for e in events
            )
        out[role] = replace(
            d,
            desired=desired,
            reason=DecisionReason.capped_by_budget,
            message=message,
            events=(*events, capped),
        )
    return out

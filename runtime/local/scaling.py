"""Local mode's autoscaling step: the operator's planner over local instances.

`compute_local_step(config, instances, scrapes, history, now)` is one
interval of `pdcluster up`: the instances of each role (ready, starting,
draining), the `/metrics` text of each ready one, and the previous history
in; the instances to start and to drain, the log lines (the operator's
`ScaledUp`/`ScaledDown`/... Events) and the next history out.

- replicas of a role = its ready + starting instances; one being drained is
  already gone (the planner decided it), and counts as no capacity;
- samples come from `runtime/autoscale/samples.py`, exactly as the operator
  reads them; a p90 needs two scrapes of an instance, so the first interval
  of every instance holds without a `MetricMissing` warning;
- a hold's Warning (`MetricMissing`, ...) is logged when the role enters
  that hold, not again each interval it stays there (stderr is no Event
  stream that aggregates);
- a scale-up starts the lowest free instance numbers; a scale-down drains the
  highest-numbered ready instances (instance 0 is the last to go);
- the planner's history is kept only with the step, so the caller applies
  the actions before the next call (a desired value not applied would read
  as a manual change).

Pure module: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.runtime.autoscale.planner import (
    DecisionReason,
    PlannerHistory,
    RoleObservation,
    compute_plan,
)
from pdcluster.runtime.autoscale.samples import MetricsText, RoleReading, WorkerScrape, read_role
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec

SCALED_ROLES = (Role.prefill, Role.decode)


@dataclass(frozen=True)
class RoleConfig:
    autoscaling: RoleAutoscalingSpec | None
    gpus_per_instance: int  # ranks of one instance (one GPU each in production)


@dataclass(frozen=True)
class ScalingConfig:
    roles: Mapping[Role, RoleConfig]
    max_total_gpus: int | None = None

    @property
    def is_enabled(self) -> bool:
        return any(c.autoscaling is not None for c in self.roles.values())


@dataclass(frozen=True)
class RoleInstances:
    """Instance numbers of one role by phase."""

    ready: frozenset[int] = frozenset()
    starting: frozenset[int] = frozenset()
    draining: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if (
            self.ready & self.starting
            or self.ready & self.draining
            or self.starting & self.draining
        ):
            raise ValueError(f"an instance is in two phases: {self}")

    @property
    def replicas(self) -> int:
        return len(self.ready) + len(self.starting)


# An instance's /metrics body and when it was fetched.
Scrape = MetricsText


@dataclass(frozen=True)
class _InstanceAction:
    """What to do to one instance, named by role and number."""

    role: Role
    instance: int


class StartInstance(_InstanceAction):
    """Start the instance (a free number: the lowest not in use)."""


class DrainInstance(_InstanceAction):
    """Drain the instance and stop it (a ready one: the highest-numbered)."""


ScaleAction = StartInstance | DrainInstance


@dataclass(frozen=True)
class ScalingHistory:
    planner: PlannerHistory = field(default_factory=PlannerHistory)
    # Each role's parsed scrapes at its last decision, by instance number.
    scrapes: Mapping[Role, Mapping[int, WorkerScrape]] = field(default_factory=dict)
    decided_at: Mapping[Role, float] = field(default_factory=dict)
    reasons: Mapping[Role, DecisionReason] = field(default_factory=dict)  # the last decision's


@dataclass(frozen=True)
class ScalingStep:
    actions: tuple[ScaleAction, ...]
    lines: tuple[str, ...]  # what to log: "<Type> <Reason>: <message>"
    history: ScalingHistory
    next_due_at: float | None  # None: no role autoscales


def roles_due(config: ScalingConfig, history: ScalingHistory, now: float) -> tuple[Role, ...]:
    """The autoscaled roles whose interval ended by `now` (the only ones to scrape)."""
    out = []
    for role in SCALED_ROLES:
        cfg = config.roles[role].autoscaling if role in config.roles else None
        last = history.decided_at.get(role)
        if cfg is not None and (last is None or now >= last + cfg.interval_seconds):
            out.append(role)
    return tuple(out)


def compute_local_step(
    config: ScalingConfig,
    instances: Mapping[Role, RoleInstances],
    scrapes: Mapping[Role, Mapping[int, Scrape]],
    history: ScalingHistory,
    now: float,
) -> ScalingStep:
    """This interval's starts, drains and log lines for every autoscaled role that is due."""
    due = set(roles_due(config, history, now))
    lines: list[str] = []
    observations: dict[Role, RoleObservation] = {}
    readings: dict[Role, RoleReading[int]] = {}
    for role, rc in config.roles.items():
        have = instances.get(role, RoleInstances())
        cfg = rc.autoscaling if role in due else None
        reading = None
        if cfg is not None:
            ready_scrapes = {i: s for i, s in scrapes.get(role, {}).items() if i in have.ready}
            reading = read_role(cfg.target.metric, history.scrapes.get(role, {}), ready_scrapes)
            readings[role] = reading
            for instance, why in reading.unreadable:
                lines.append(f"Warning UnreadableMetrics: {role.value}-{instance}: {why}")
        observations[role] = RoleObservation(
            replicas=have.replicas,
            ready=len(have.ready),
            starting=len(have.starting),
            gpus_per_instance=rc.gpus_per_instance,
            autoscaling=cfg,
            sample=None if reading is None else reading.sample,
        )
    plan = compute_plan(observations, config.max_total_gpus, now, history.planner)

    actions: list[ScaleAction] = []
    for role, decision in plan.decisions.items():
        first = role in readings and readings[role].is_first_interval
        quiet = decision.reason is DecisionReason.metric_missing and first
        repeated = history.reasons.get(role) is decision.reason
        for event in () if quiet else decision.events:
            if not (repeated and event.type == "Warning"):
                lines.append(f"{event.type} {event.reason}: {event.message}")
        have = instances.get(role, RoleInstances())
        if decision.desired > decision.current:
            taken = have.ready | have.starting | have.draining
            free = (i for i in range(len(taken) + decision.desired) if i not in taken)
            for _ in range(decision.desired - decision.current):
                actions.append(StartInstance(role, next(free)))
        elif decision.desired < decision.current:
            for instance in sorted(have.ready, reverse=True)[: decision.current - decision.desired]:
                actions.append(DrainInstance(role, instance))

    decided_at = {**history.decided_at, **{role: now for role in plan.decisions}}
    kept = ScalingHistory(
        planner=PlannerHistory({**history.planner.roles, **plan.history.roles}),
        scrapes={**history.scrapes, **{r: rd.scrapes for r, rd in readings.items()}},
        decided_at=decided_at,
        reasons={**history.reasons, **{r: d.reason for r, d in plan.decisions.items()}},
    )
    due_times = [
        decided_at[role] + cfg.interval_seconds
        for role, rc in config.roles.items()
        if (cfg := rc.autoscaling) is not None and role in decided_at
    ]
    return ScalingStep(
        actions=tuple(actions),
        lines=tuple(lines),
        history=kept,
        next_due_at=min(due_times) if due_times else None,
    )

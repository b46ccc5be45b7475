"""A small cluster simulator that drives the autoscaling planner over a load trace.

Each role's instances start when the planner adds them and turn Ready
`startup_s` later; a scale-down removes the youngest instance at once (the
drain is the operator's business, not the planner's). The metric a role
reports is its load divided by its Ready instances, sampled at each tick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pdcluster.runtime.autoscale.planner import (
    Decision,
    PlannerHistory,
    RoleObservation,
    Sample,
    compute_plan,
)
from pdcluster.runtime.spec import (
    AutoscalingMetric,
    AutoscalingTarget,
    Role,
    RoleAutoscalingSpec,
    ScaleDownSpec,
    ScaleUpSpec,
)

METRIC = {Role.prefill: AutoscalingMetric.queued_prefill_tokens_per_instance}
METRIC[Role.decode] = AutoscalingMetric.running_requests_per_instance


def scaling(
    role: Role = Role.prefill,
    *,
    lo: int = 1,
    hi: int = 4,
    target: float = 10.0,
    up_s: float = 30.0,
    down_s: float = 300.0,
    step: int = 1,
    tolerance: float = 0.1,
    interval_s: float = 15.0,
) -> RoleAutoscalingSpec:
    return RoleAutoscalingSpec(
        min_replicas=lo,
        max_replicas=hi,
        interval_seconds=interval_s,
        target=AutoscalingTarget(metric=METRIC[role], value=target),
        tolerance=tolerance,
        scale_up=ScaleUpSpec(stabilization_seconds=up_s),
        scale_down=ScaleDownSpec(stabilization_seconds=down_s),
        max_step=step,
    )


@dataclass
class SimRole:
    autoscaling: RoleAutoscalingSpec | None
    starts: list[float]  # start time of each instance, oldest first
    gpus_per_instance: int = 1

    def observe(self, now: float, startup_s: float, load: float | None) -> RoleObservation:
        ready = sum(1 for s in self.starts if now - s >= startup_s)
        sample = None if load is None else Sample(load / max(ready, 1), now)
        return RoleObservation(
            replicas=len(self.starts),
            ready=ready,
            starting=len(self.starts) - ready,
            gpus_per_instance=self.gpus_per_instance,
            autoscaling=self.autoscaling,
            sample=sample,
        )

    def set_replicas(self, n: int, now: float) -> None:
        while len(self.starts) < n:
            self.starts.append(now)
        del self.starts[n:]


@dataclass
class Step:
    at: float
    observations: dict[Role, RoleObservation]
    decisions: Mapping[Role, Decision]


@dataclass
class Sim:
    roles: dict[Role, SimRole]
    max_total_gpus: int | None = None
    startup_s: float = 20.0
    interval_s: float = 15.0
    history: PlannerHistory = field(default_factory=PlannerHistory)
    steps: list[Step] = field(default_factory=list)

    def run(
        self,
        load: Callable[[Role, float], float | None],
        duration_s: float,
        start_s: float = 0.0,
    ) -> list[Step]:
        """Tick every interval over [start_s, start_s + duration_s); apply every decision."""
        now = start_s
        while now < start_s + duration_s:
            self.tick(now, {role: load(role, now) for role in self.roles})
            now += self.interval_s
        return self.steps

    def tick(self, now: float, loads: Mapping[Role, float | None]) -> Step:
        obs = {r: s.observe(now, self.startup_s, loads.get(r)) for r, s in self.roles.items()}
        plan = compute_plan(obs, self.max_total_gpus, now, self.history)
        for role, decision in plan.decisions.items():
            self.roles[role].set_replicas(decision.desired, now)
        self.history = plan.history
        step = Step(now, obs, plan.decisions)
        self.steps.append(step)
        return step

    def replicas(self, role: Role) -> int:
        return len(self.roles[role].starts)


def fixed_role(replicas: int) -> SimRole:
    return SimRole(None, [-1e9] * replicas)


def scaled_role(spec: RoleAutoscalingSpec, replicas: int = 1, gpus: int = 1) -> SimRole:
    return SimRole(spec, [-1e9] * replicas, gpus)

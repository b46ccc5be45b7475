"""The autoscaling planner over load traces, and its invariants over random ones."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.runtime.autoscale.planner import (
    STALE_AFTER_INTERVALS,
    DecisionReason,
    PlannerHistory,
    Recommendation,
    RoleHistory,
    RoleObservation,
    Sample,
    compute_plan,
)
from pdcluster.runtime.spec import Role, RoleAutoscalingSpec
from tests.operator.autoscale_sim import Sim, Step, fixed_role, scaled_role, scaling

P, D = Role.prefill, Role.decode


def replicas_over_time(steps: list[Step], role: Role) -> list[tuple[float, int]]:
    return [(s.at, s.decisions[role].desired) for s in steps]


def changes(steps: list[Step], role: Role) -> list[tuple[float, int]]:
    """(time, +1 | -1) of every interval where the role's replicas moved."""
    out = []
    for s in steps:
        d = s.decisions.get(role)
        if d is not None and d.is_change:
            out.append((s.at, 1 if d.desired > d.current else -1))
    return out


def test_a_load_step_scales_up_one_step_per_interval_after_the_up_window() -> None:
    sim = Sim({P: scaled_role(scaling(P, hi=4, up_s=30)), D: fixed_role(1)})
    steps = sim.run(lambda role, t: 10.0 if t < 300 else 30.0, duration_s=600)
    ups = changes(steps, P)
    assert [c for _, c in ups] == [1, 1]  # 1 -> 2 -> 3: 30 load / 10 per instance
    assert sim.replicas(P) == 3
    # The first increase waits for a full window of high recommendations.
    assert 300 + 30 <= ups[0][0] <= 300 + 30 + sim.interval_s
    first_up = next(s for s in steps if s.at == ups[0][0])
    (event,) = first_up.decisions[P].events
    assert event.reason == "ScaledUp" and "queuedPrefillTokensPerInstance 30" in event.message


def test_a_load_drop_scales_down_only_after_the_down_window() -> None:
    sim = Sim({P: scaled_role(scaling(P, hi=4, down_s=300, step=2), replicas=3), D: fixed_role(1)})
    steps = sim.run(lambda role, t: 30.0 if t < 600 else 10.0, duration_s=1200)
    downs = changes(steps, P)
    assert [c for _, c in downs] == [-1]  # one move of two instances: 3 -> 1
    assert sim.replicas(P) == 1
    assert 600 + 300 <= downs[0][0] <= 600 + 300 + sim.interval_s
    assert next(s for s in steps if s.at == downs[0][0]).decisions[P].events[0].reason == (
        "ScaledDown"
    )


def test_a_spike_shorter_than_the_up_window_does_not_scale() -> None:
    sim = Sim({P: scaled_role(scaling(P, up_s=60)), D: fixed_role(1)})
    steps = sim.run(lambda role, t: 50.0 if 300 <= t < 345 else 10.0, duration_s=900)
    assert changes(steps, P) == []
    assert any(s.decisions[P].reason is DecisionReason.stabilizing for s in steps)


def test_a_dip_shorter_than_the_down_window_does_not_scale_down() -> None:
    sim = Sim({P: scaled_role(scaling(P, down_s=300), replicas=2), D: fixed_role(1)})
    steps = sim.run(lambda role, t: 1.0 if 300 <= t < 540 else 20.0, duration_s=1200)
    assert changes(steps, P) == []


def test_sinusoidal_load_changes_direction_at_most_once_per_half_period() -> None:
    period = 1800.0
    sim = Sim({P: scaled_role(scaling(P, hi=4, up_s=60, down_s=300)), D: fixed_role(1)})

    def load(role: Role, t: float) -> float:
        return 25.0 + 15.0 * math.sin(2 * math.pi * t / period)

    steps = sim.run(load, duration_s=4 * period)
    moves = changes(steps, P)
    assert {c for _, c in moves} == {1, -1}  # it does follow the load both ways
    turns = [t for (_, a), (t, b) in zip(moves, moves[1:], strict=False) if a != b]
    assert len(turns) >= 6
    # Half periods from one load extreme to the next (crest at P/4, trough at 3P/4, ...).
    for k in range(8):
        start = period / 4 + k * period / 2
        assert sum(1 for t in turns if start <= t < start + period / 2) <= 1, turns


def test_budget_goes_to_the_role_under_more_pressure() -> None:
    obs = {
        P: RoleObservation(2, 2, 0, 1, scaling(P, up_s=0), Sample(30.0, 0.0)),  # ratio 3
        D: RoleObservation(2, 2, 0, 1, scaling(D, up_s=0), Sample(15.0, 0.0)),  # ratio 1.5
    }
    plan = compute_plan(obs, 5, 0.0, PlannerHistory())
    assert plan.decisions[P].desired == 3 and plan.decisions[P].reason is DecisionReason.scale_up
    capped = plan.decisions[D]
    assert capped.desired == 2 and capped.reason is DecisionReason.capped_by_budget
    assert [e.reason for e in capped.events] == ["CappedByBudget"]
    assert "maxTotalGPUs (5)" in capped.message


def test_budget_tie_goes_to_decode_and_an_instance_too_big_for_what_is_left_waits() -> None:
    def obs(p_gpus: int) -> dict[Role, RoleObservation]:
        return {
            P: RoleObservation(1, 1, 0, p_gpus, scaling(P, up_s=0), Sample(20.0, 0.0)),
            D: RoleObservation(1, 1, 0, 1, scaling(D, up_s=0), Sample(20.0, 0.0)),
        }

    plan = compute_plan(obs(1), 3, 0.0, PlannerHistory())
    assert (plan.decisions[D].desired, plan.decisions[P].desired) == (2, 1)
    # Enough GPUs are free for a decode instance but not for a 2-GPU prefill one.
    plan = compute_plan(obs(2), 5, 0.0, PlannerHistory())
    assert (plan.decisions[D].desired, plan.decisions[P].desired) == (2, 1)
    assert plan.decisions[P].reason is DecisionReason.capped_by_budget


def test_a_role_gets_part_of_its_increase_when_only_part_fits() -> None:
    obs = {P: RoleObservation(1, 1, 0, 1, scaling(P, up_s=0, step=3), Sample(40.0, 0.0))}
    decision = compute_plan(obs, 3, 0.0, PlannerHistory()).decisions[P]
    assert (decision.desired, decision.reason) == (3, DecisionReason.capped_by_budget)
    scaled, capped = decision.events
    assert scaled.reason == "ScaledUp" and scaled.message.startswith("prefill 1 -> 3:")
    assert capped.reason == "CappedByBudget" and "4 wanted, 3 fit" in capped.message


def test_budget_counts_a_role_without_autoscaling() -> None:
    sim = Sim({P: scaled_role(scaling(P, hi=4, up_s=0)), D: fixed_role(2)}, max_total_gpus=4)
    steps = sim.run(lambda role, t: 100.0, duration_s=300)
    assert sim.replicas(P) == 2  # 2 decode + 2 prefill = the budget
    assert steps[-1].decisions[P].reason is DecisionReason.capped_by_budget


def test_no_scale_down_while_an_instance_of_either_role_is_starting() -> None:
    quiet = Sample(1.0, 0.0)
    history = PlannerHistory({P: RoleHistory((Recommendation(-1000.0, 1),), 2)})
    own = {
        P: RoleObservation(2, 1, 1, 1, scaling(P, down_s=0), quiet),
        D: RoleObservation(1, 1, 0, 1, None),
    }
    plan = compute_plan(own, None, 0.0, history)
    assert plan.decisions[P].desired == 2
    assert plan.decisions[P].reason is DecisionReason.held_while_starting
    other = {
        P: RoleObservation(2, 2, 0, 1, scaling(P, down_s=0), quiet),
        D: RoleObservation(2, 1, 1, 1, None),
    }
    assert compute_plan(other, None, 0.0, history).decisions[P].desired == 2
    both_ready = {**other, D: RoleObservation(2, 2, 0, 1, None)}
    assert compute_plan(both_ready, None, 0.0, history).decisions[P].desired == 1


def test_scale_up_counts_only_ready_instances_as_capacity() -> None:
    # 2 replicas, 1 Ready at 1.5x its target: one more instance is already on its way.
    history = PlannerHistory({P: RoleHistory((Recommendation(-1000.0, 2),), 2)})
    obs = {P: RoleObservation(2, 1, 1, 1, scaling(P, up_s=0), Sample(15.0, 0.0))}
    assert compute_plan(obs, None, 0.0, history).decisions[P].desired == 2
    # Both Ready and still at 1.5x: now a third.
    obs = {P: RoleObservation(2, 2, 0, 1, scaling(P, up_s=0), Sample(15.0, 0.0))}
    assert compute_plan(obs, None, 0.0, history).decisions[P].desired == 3


def test_autoscaling_off_makes_no_decision() -> None:
    obs = {P: RoleObservation(7, 7, 0, 1, None, Sample(100.0, 0.0))}
    assert compute_plan(obs, 2, 0.0, PlannerHistory()).decisions == {}


@pytest.mark.parametrize(("manual", "bound"), [(9, 4), (0, 1)])
def test_a_manual_change_outside_the_bounds_is_clamped_with_an_event(
    manual: int, bound: int
) -> None:
    sim = Sim({P: scaled_role(scaling(P, lo=1, hi=4)), D: fixed_role(1)})
    sim.run(lambda role, t: 10.0, duration_s=60)
    sim.roles[P].set_replicas(manual, 60.0)
    step = sim.tick(60.0, {P: 10.0, D: 10.0})
    decision = step.decisions[P]
    assert (decision.current, decision.desired) == (manual, bound)
    assert decision.reason is DecisionReason.clamped
    assert [e.reason for e in decision.events] == ["ReplicasClamped"]
    assert f"outside autoscaling bounds [1, 4]: set to {bound}" in decision.message


def test_a_manual_change_inside_the_bounds_holds_for_the_down_window() -> None:
    sim = Sim({P: scaled_role(scaling(P, hi=4, down_s=300)), D: fixed_role(1)})
    sim.run(lambda role, t: 10.0, duration_s=300)
    sim.roles[P].set_replicas(3, 300.0)  # kubectl edit: 1 -> 3 under the same load
    steps = sim.run(lambda role, t: 10.0, duration_s=600, start_s=300.0)
    held = [s for s in steps if 300 <= s.at < 600]
    assert all(s.decisions[P].desired == 3 for s in held)
    assert sim.replicas(P) == 1  # then the load wins, one step at a time


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (None, DecisionReason.metric_missing),
        (Sample(99.0, -STALE_AFTER_INTERVALS * 15.0 - 1), DecisionReason.metric_stale),
    ],
)
def test_a_missing_or_stale_metric_holds_with_a_warning(
    sample: Sample | None, reason: DecisionReason
) -> None:
    history = PlannerHistory({P: RoleHistory((Recommendation(-1000.0, 2),), 2)})
    obs = {P: RoleObservation(2, 2, 0, 1, scaling(P, up_s=0, down_s=0), sample)}
    plan = compute_plan(obs, None, 0.0, history)
    decision = plan.decisions[P]
    assert (decision.desired, decision.reason) == (2, reason)
    ((kind, event_reason),) = [(e.type, e.reason) for e in decision.events]
    assert (kind, event_reason) == ("Warning", reason.value)
    assert plan.history.roles[P].recommendations == history.roles[P].recommendations


def test_a_sample_just_inside_the_stale_limit_is_used() -> None:
    history = PlannerHistory({P: RoleHistory((Recommendation(-1000.0, 2),), 2)})
    fresh = Sample(99.0, -STALE_AFTER_INTERVALS * 15.0)
    obs = {P: RoleObservation(2, 2, 0, 1, scaling(P, up_s=0), fresh)}
    assert compute_plan(obs, None, 0.0, history).decisions[P].reason is DecisionReason.scale_up


def test_bad_observation_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="counts must be >= 0"):
        RoleObservation(-1, 0, 0, 1, None)


# ---- random traces --------------------------------------------------------


@st.composite
def role_settings(draw: st.DrawFn, role: Role) -> RoleAutoscalingSpec:
    lo = draw(st.integers(1, 3))
    return scaling(
        role,
        lo=lo,
        hi=draw(st.integers(lo, 6)),
        up_s=draw(st.sampled_from([0.0, 15.0, 45.0, 90.0])),
        down_s=draw(st.sampled_from([0.0, 30.0, 120.0, 300.0])),
        step=draw(st.integers(1, 3)),
        tolerance=draw(st.sampled_from([0.0, 0.1, 0.3])),
    )


loads = st.one_of(st.none(), st.integers(0, 80).map(float))
traces = st.lists(st.tuples(loads, loads, st.integers(-2, 8)), min_size=5, max_size=40)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p_cfg=role_settings(P),
    d_cfg=st.one_of(st.none(), role_settings(D)),
    p_gpus=st.integers(1, 2),
    budget=st.one_of(st.none(), st.integers(2, 12)),
    startup_s=st.sampled_from([0.0, 20.0, 60.0]),
    trace=traces,
)
def test_random_traces_keep_the_invariants(
    p_cfg: RoleAutoscalingSpec,
    d_cfg: RoleAutoscalingSpec | None,
    p_gpus: int,
    budget: int | None,
    startup_s: float,
    trace: list[tuple[float | None, float | None, int]],
) -> None:
    sim = Sim(
        {P: scaled_role(p_cfg, replicas=p_cfg.min_replicas, gpus=p_gpus), D: scaled_role(d_cfg)}
        if d_cfg is not None
        else {P: scaled_role(p_cfg, replicas=p_cfg.min_replicas, gpus=p_gpus), D: fixed_role(1)},
        max_total_gpus=budget,
        startup_s=startup_s,
    )
    last_change: dict[Role, tuple[float, int]] = {}
    for i, (p_load, d_load, manual) in enumerate(trace):
        now = i * sim.interval_s
        if manual >= 0 and i % 7 == 6:  # now and then somebody edits prefill's replicas
            sim.roles[P].set_replicas(manual, now)
            last_change.pop(P, None)
        step = sim.tick(now, {P: p_load, D: d_load})
        used = sum(o.replicas * o.gpus_per_instance for o in step.observations.values())
        num_starting = sum(o.starting for o in step.observations.values())
        for role, d in step.decisions.items():
            cfg = step.observations[role].autoscaling
            assert cfg is not None
            assert cfg.min_replicas <= d.desired <= cfg.max_replicas
            if d.reason is DecisionReason.clamped:
                last_change.pop(role, None)
                continue
            if d.desired > d.current and budget is not None:
                grown = {False: 0, True: 0}  # GPUs added, by "is a clamp to minReplicas"
                for r, x in step.decisions.items():
                    if x.desired > x.current:
                        added = (x.desired - x.current) * step.observations[r].gpus_per_instance
                        grown[x.reason is DecisionReason.clamped] += added
                assert used + sum(grown.values()) <= max(budget, used + grown[True])
            if d.desired < d.current:
                assert num_starting == 0
            if d.is_change:
                direction = 1 if d.desired > d.current else -1
                if role in last_change and last_change[role][1] != direction:
                    window = cfg.scale_up if direction > 0 else cfg.scale_down
                    assert now - last_change[role][0] >= window.stabilization_seconds
                last_change[role] = (now, direction)

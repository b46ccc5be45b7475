"""The planner's windows survive an operator restart: written to status.<role>.autoscaling
with each decision, restored from it when the loop starts without a history."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator.api import PDClusterStatus, parse_status
from pdcluster.operator.autoscale.persisted import (
    MAX_RECOMMENDATIONS,
    build_recommendations,
    compress,
    format_point_time,
    parse_point_time,
    restore_history,
    status_patch_with_windows,
)
from pdcluster.operator.autoscale.step import AutoscaleHistory
from pdcluster.runtime.autoscale.planner import PlannerHistory, Recommendation, RoleHistory
from pdcluster.runtime.spec import Role

from .test_autoscale_step import INTERVAL, Trace, autoscaling

P, D = Role.prefill, Role.decode
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: the loop's clock is epoch seconds


def decode_down_spec() -> dict[str, Any]:
    return {
        "prefill": {"replicas": 1},
        "decode": {
            "replicas": 2,
            "autoscaling": autoscaling(
                "runningRequestsPerInstance", 4, scaleDown={"stabilizationSeconds": 60}
            ),
        },
    }


def run_decode_down(restart_at: float | None, restore: bool) -> list[tuple[float, int]]:
    """Load high until T0+15, then low; (time, replicas) of every scale. At `restart_at`
    the operator restarts: its memory is gone, the stored status stays."""
    trace = Trace(decode_down_spec(), patch_of=status_patch_with_windows)
    scales = []
    for k in range(12):
        now = T0 + k * INTERVAL
        if restart_at is not None and now == restart_at:
            trace.history = restore_history(trace.status) if restore else AutoscaleHistory()
        for w in trace.workers[D]:
            w.requests_in_flight.set(4 if now < T0 + 15 else 1)
        out = trace.step(now)
        scales += [(now - T0, p.replicas) for p in out.patches]
    return scales


def test_a_restart_inside_the_scale_down_window_keeps_the_window() -> None:
    without_restart = run_decode_down(None, restore=False)
    assert without_restart == [(75.0, 1)]
    # Restarted at t=45, 30 s into the 60 s window: the same decision at the same time.
    assert run_decode_down(T0 + 45, restore=True) == without_restart
    # Without the stored windows the restart would start a new 60 s window.
    assert run_decode_down(T0 + 45, restore=False) == [(105.0, 1)]


def test_the_status_carries_the_windows_and_reads_back() -> None:
    trace = Trace(decode_down_spec(), patch_of=status_patch_with_windows)
    for k in range(3):
        for w in trace.workers[D]:
            w.requests_in_flight.set(4 if k == 0 else 1)
        out = trace.step(T0 + k * INTERVAL)
    wire = status_patch_with_windows(out)["status"]["decode"]["autoscaling"]
    # t=0 recommends 2 (the current replicas), t=15 and t=30 recommend 1: two points.
    assert wire["recommendations"] == [
        {"time": "2026-01-01T00:00:00.000Z", "replicas": 2},
        {"time": "2026-01-01T00:00:15.000Z", "replicas": 1},
    ]
    stored = trace.status.role("decode")
    assert stored is not None and stored.autoscaling is not None
    restored = restore_history(trace.status).planner.roles[D]
    assert restored.recommendations == (Recommendation(T0, 2), Recommendation(T0 + 15, 1))
    assert restored.last_desired == stored.autoscaling.desired == 2
    assert P not in restore_history(trace.status).planner.roles
    # The wire form survives the status model (what the reconcile carries over).
    assert parse_status(trace.status.to_wire()) == trace.status


def test_a_role_turned_off_clears_its_status_and_nothing_is_restored() -> None:
    trace = Trace(decode_down_spec(), patch_of=status_patch_with_windows)
    trace.step(T0)
    trace.spec["decode"].pop("autoscaling")
    out = trace.step(T0 + INTERVAL)
    assert status_patch_with_windows(out) == {"status": {"decode": {"autoscaling": None}}}
    assert restore_history(trace.status) == AutoscaleHistory()


def status_with(points: Any, desired: int = 2) -> PDClusterStatus:
    auto = {
        "metric": "runningRequestsPerInstance",
        "target": 4,
        "current": 2,
        "desired": desired,
        "reason": "Stabilizing",
        "lastDecisionTime": "2026-01-01T00:00:30Z",
        "recommendations": points,
    }
    return parse_status({"decode": {"desired": 2, "autoscaling": auto}})


@pytest.mark.parametrize(
    "points",
    [
        [{"time": "yesterday", "replicas": 1}],
        [{"time": "2026-01-01T00:00:15.000+01:00", "replicas": 1}],
        [
            {"time": "2026-01-01T00:00:15.000Z", "replicas": 1},
            {"time": "2026-01-01T00:00:00.000Z", "replicas": 2},
        ],
        [],
        None,
    ],
    ids=["not-a-time", "not-utc", "out-of-order", "empty", "absent"],
)
def test_windows_that_do_not_read_start_afresh_and_leave_the_status_alone(points: Any) -> None:
    status = status_with(points)
    before = status.to_wire()
    assert restore_history(status) == AutoscaleHistory()
    assert status.to_wire() == before


def test_whole_second_times_are_read_too() -> None:
    status = status_with([{"time": "2026-01-01T00:00:15Z", "replicas": 1}], desired=3)
    assert restore_history(status).planner.roles[D] == RoleHistory(
        (Recommendation(T0 + 15, 1),), last_desired=3
    )


def test_too_long_a_history_is_not_written() -> None:
    alternating = tuple(Recommendation(T0 + i, 1 + i % 2) for i in range(MAX_RECOMMENDATIONS + 1))
    assert build_recommendations(RoleHistory(alternating)) is None
    assert build_recommendations(RoleHistory(alternating[:MAX_RECOMMENDATIONS])) is not None
    assert build_recommendations(RoleHistory()) is None
    assert build_recommendations(None) is None
    # Repeats do not count: a long steady history is one point.
    steady = tuple(Recommendation(T0 + i, 2) for i in range(10 * MAX_RECOMMENDATIONS))
    assert build_recommendations(RoleHistory(steady)) == [
        {"time": "2026-01-01T00:00:00.000Z", "replicas": 2}
    ]


def value_at(recs: tuple[Recommendation, ...], t: float) -> int | None:
    before = [r.replicas for r in recs if r.at <= t]
    return before[-1] if before else None


@given(
    st.lists(
        st.tuples(st.floats(0, 600, allow_nan=False), st.integers(0, 4)), min_size=1, max_size=40
    )
)
def test_compressing_keeps_the_step_function(raw: list[tuple[float, int]]) -> None:
    recs = tuple(Recommendation(T0 + at, n) for at, n in sorted(raw))
    small = compress(recs)
    assert all(a.replicas != b.replicas for a, b in zip(small, small[1:], strict=False))
    for t in [r.at for r in recs] + [T0 - 1, T0 + 700]:
        assert value_at(small, t) == value_at(recs, t)


@given(st.floats(0, 4_000_000_000, allow_nan=False))
def test_a_point_time_reads_back_to_the_millisecond(epoch: float) -> None:
    assert parse_point_time(format_point_time(epoch)) == pytest.approx(epoch, abs=1e-3)


def test_the_planner_history_round_trips_through_the_wire_form() -> None:
    history = RoleHistory((Recommendation(T0, 2), Recommendation(T0 + 15.25, 1)), last_desired=2)
    points = build_recommendations(history)
    assert points is not None
    status = status_with(points)
    assert restore_history(status).planner == PlannerHistory({D: history})

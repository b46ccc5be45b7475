"""Event aggregation and the restart ledger's round trip through the status."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator.api import RoleStatus
from pdcluster.operator.kube.events import EventAggregator, EventKey, build_event, event_name
from pdcluster.operator.reconcile.cluster import ClusterRef
from pdcluster.operator.reconcile.restarts import (
    BUDGET_WINDOW_S,
    RestartLedger,
    ledger_from_status,
    ledger_status_fields,
)
from pdcluster.runtime.spec import RestartPolicySpec

REF = ClusterRef("demo", "team-a", "uid-1", 3)
KEY = EventKey("uid-1", "Warning", "ForeignObject", "Service/demo-router is not ours")


def test_repeats_are_counted_not_written_until_the_interval_passes() -> None:
    agg = EventAggregator(min_interval_s=30)
    first = agg.record(KEY, 100.0, "demo.x")
    assert first is not None and first.create and first.count == 1
    assert [agg.record(KEY, 100.0 + i, "demo.x") for i in range(1, 20)] == [None] * 19
    write = agg.record(KEY, 131.0, "demo.x")
    assert write is not None and not write.create and write.count == 21
    assert write.first == 100.0 and write.last == 131.0


def test_flush_writes_piled_up_counts_once_and_forgets_idle_entries() -> None:
    agg = EventAggregator(min_interval_s=30, forget_after_s=600)
    agg.record(KEY, 0.0, "demo.x")
    agg.record(KEY, 5.0, "demo.x")
    assert agg.flush(10.0) == []
    ((key, write),) = agg.flush(40.0)
    assert key == KEY and write.count == 2
    assert agg.flush(80.0) == []  # nothing new since
    agg.flush(1000.0)
    assert len(agg) == 0


def test_different_messages_are_different_events_and_names_are_stable() -> None:
    other = EventKey("uid-1", "Warning", "ForeignObject", "ConfigMap/demo-config is not ours")
    assert event_name(REF, KEY) != event_name(REF, other)
    assert event_name(REF, KEY) == event_name(REF, KEY)
    agg = EventAggregator()
    agg.record(KEY, 0.0, "a")
    assert agg.record(other, 0.0, "b") is not None
    agg.forget_object("uid-1")
    assert len(agg) == 0


def test_event_body_points_at_the_cluster() -> None:
    write = EventAggregator().record(KEY, 0.0, "demo.x")
    assert write is not None
    body = build_event(REF, KEY, write, "pdcluster-operator", "host-1")
    assert body["involvedObject"] == {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "name": "demo",
        "namespace": "team-a",
        "uid": "uid-1",
    }
    assert body["type"] == "Warning" and body["reason"] == "ForeignObject"
    assert body["count"] == 1 and body["firstTimestamp"] == "1970-01-01T00:00:00Z"


POLICY = RestartPolicySpec(backoff_seconds=1, max_backoff_seconds=8, budget=3)


def test_budget_window_counts_restarts_and_reopens_after_an_hour() -> None:
    ledger = RestartLedger()
    for i in range(3):
        assert ledger.can_restart(POLICY, 10.0 + i)
        ledger = ledger.record(0, 10.0 + i)
    assert not ledger.can_restart(POLICY, 20.0)
    assert ledger.budget_reopens_at(20.0) == 10.0 + BUDGET_WINDOW_S
    assert ledger.can_restart(POLICY, 10.0 + BUDGET_WINDOW_S)
    assert ledger.record(0, 10.0 + BUDGET_WINDOW_S).in_window == 1


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10_000)), max_size=30))
def test_ledger_survives_the_status_round_trip(restarts) -> None:
    ledger, now = RestartLedger(), 1_000_000.0
    for index, dt in restarts:
        now += dt
        ledger = ledger.record(index, now)
    fields = ledger_status_fields(ledger)
    back = ledger_from_status(RoleStatus(**fields))
    assert back.total == ledger.total and back.backoff == ledger.backoff
    assert back.restarts_in_window(now) == ledger.restarts_in_window(now)
    for index in range(6):
        assert back.recreate_at(index, POLICY) == ledger.recreate_at(index, POLICY)


def test_scaled_away_and_ready_instances_leave_the_ledger() -> None:
    ledger = RestartLedger().record(0, 5.0).record(3, 6.0)
    assert set(ledger.forget_from(2).backoff) == {0}
    assert set(ledger.mark_ready(0).backoff) == {3}
    assert ledger.mark_ready(7) is ledger


def test_unreadable_ledger_times_are_dropped() -> None:
    status = RoleStatus(
        restarts=4,
        restarts_in_window=2,
        budget_window_start="yesterday",
        backoff=[{"index": 1, "consecutiveRestarts": 2, "lastRestartTime": "noon"}],
    )
    ledger = ledger_from_status(status)
    assert ledger.total == 4 and ledger.window_start is None and ledger.backoff == {}

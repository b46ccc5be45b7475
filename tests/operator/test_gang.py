"""decide_gang: one multi-pod instance is kept, restarted whole, waited on or given up."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.operator.reconcile.gang import (
    GangDecision,
    GangPod,
    GangStep,
    PodState,
    decide_gang,
    pod_state_from_status,
)
from pdcluster.operator.reconcile.restarts import BUDGET_WINDOW_S, RestartLedger, backoff_delay
from pdcluster.runtime.spec import RestartPolicySpec

NOW = 1_000_000.0
POLICY = RestartPolicySpec(backoffSeconds=2, maxBackoffSeconds=60, budget=3)
GRACE = POLICY.not_ready_grace_seconds

S = PodState


def pods(*states: PodState, since: float | None = None) -> dict[int, GangPod]:
    return {
        k: GangPod(f"p{k}", s, since if s is S.not_ready else None) for k, s in enumerate(states)
    }


def decide(
    size: int, members: dict[int, GangPod], ledger: RestartLedger | None = None
) -> GangDecision:
    return decide_gang(
        size, members, index=0, now=NOW, policy=POLICY, ledger=ledger or RestartLedger()
    )


def spent_ledger() -> RestartLedger:
    ledger = RestartLedger()
    for _ in range(POLICY.budget):
        ledger = ledger.record(1, NOW - 10)
    return ledger


@pytest.mark.parametrize(
    ("states", "step", "reason"),
    [
        ((S.ready, S.ready), GangStep.keep, "all pods ready"),
        ((S.ready, S.starting), GangStep.keep, "1 of 2 pods not ready"),
        ((S.pending_first_start, S.pending_first_start), GangStep.keep, "2 of 2 pods not ready"),
        ((S.ready, S.ended), GangStep.restart, "pod p1 ended"),
        ((S.lost, S.ready), GangStep.restart, "pod p0 is lost"),
        ((S.ready, S.ended, S.pending_first_start), GangStep.wait, "still pending its first"),
        ((S.ready, S.terminating), GangStep.wait, "being deleted"),
        ((S.ended, S.terminating), GangStep.wait, "being deleted"),
    ],
)
def test_the_gang_table(states: tuple[PodState, ...], step: GangStep, reason: str) -> None:
    decided = decide(len(states), pods(*states))
    assert decided.step == step
    assert reason in decided.reason


def test_a_restart_deletes_every_pod_of_the_instance_and_names_the_faulty_one() -> None:
    decided = decide(3, pods(S.ready, S.ended, S.ready))
    assert decided.delete == ("p0", "p1", "p2")
    assert decided.faulty_pod == "p1"


def test_not_ready_restarts_only_once_the_grace_has_passed() -> None:
    within = decide(2, pods(S.ready, S.not_ready, since=NOW - GRACE + 5))
    assert within.step == GangStep.keep
    assert within.not_before == NOW + 5  # look again when the grace ends
    past = decide(2, pods(S.ready, S.not_ready, since=NOW - GRACE))
    assert past.step == GangStep.restart and "not ready for 30s" in past.reason
    unknown = decide(2, pods(S.ready, S.not_ready, since=None))
    assert unknown.step == GangStep.restart and "since unknown" in unknown.reason


def test_a_missing_pod_is_lost_once_the_gang_formed_and_created_while_it_forms() -> None:
    formed = decide(3, {0: GangPod("p0", S.ready), 2: GangPod("p2", S.not_ready, NOW)})
    assert formed.step == GangStep.restart
    assert "pod index 1 of a running gang is gone" in formed.reason
    assert formed.delete == ("p0", "p2") and formed.faulty_pod is None
    forming = decide(3, {1: GangPod("p1", S.starting)})
    assert (forming.step, forming.create) == (GangStep.create, (0, 2))


def test_an_empty_instance_waits_for_its_back_off_then_is_created_whole() -> None:
    ledger = RestartLedger().record(0, NOW)
    delay = backoff_delay(POLICY, 1)
    waiting = decide_gang(2, {}, index=0, now=NOW + delay - 1, policy=POLICY, ledger=ledger)
    assert (waiting.step, waiting.not_before) == (GangStep.wait, NOW + delay)
    due = decide_gang(2, {}, index=0, now=NOW + delay, policy=POLICY, ledger=ledger)
    assert (due.step, due.create) == (GangStep.create, (0, 1))
    # Another instance's back-off is not this one's.
    other = decide_gang(2, {}, index=5, now=NOW, policy=POLICY, ledger=ledger)
    assert other.step == GangStep.create


def test_a_spent_budget_gives_up_until_the_window_closes() -> None:
    ledger = spent_ledger()
    decided = decide(2, pods(S.ready, S.ended), ledger)
    assert decided.step == GangStep.give_up and decided.delete == ()
    assert decided.not_before == NOW - 10 + BUDGET_WINDOW_S
    assert "budget (3/hour) is spent" in decided.reason
    later = decide_gang(
        2,
        pods(S.ready, S.ended),
        index=0,
        now=NOW - 10 + BUDGET_WINDOW_S,
        policy=POLICY,
        ledger=ledger,
    )
    assert later.step == GangStep.restart


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one pod"):
        decide(0, {})
    with pytest.raises(ValueError, match=r"pod indexes \[2\] are outside an instance of 2"):
        decide(2, pods(S.ready, S.ready, S.ready))


states = st.sampled_from(list(PodState))
gangs = st.integers(1, 6).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.dictionaries(
            st.integers(0, size - 1),
            st.builds(
                GangPod,
                name=st.just(""),
                state=states,
                not_ready_since=st.one_of(st.none(), st.floats(NOW - 120, NOW)),
            ),
        ),
    )
)
ledgers = st.lists(st.integers(0, 3), max_size=5).map(lambda restarts: _ledger_with(restarts))


def _ledger_with(indexes: list[int]) -> RestartLedger:
    ledger = RestartLedger()
    for i in indexes:
        ledger = ledger.record(i, NOW - 5)
    return ledger


def _named(members: dict[int, GangPod]) -> dict[int, GangPod]:
    return {k: GangPod(f"p{k}", p.state, p.not_ready_since) for k, p in members.items()}


@given(gangs, ledgers)
def test_no_restart_while_a_pod_is_pending_its_first_start(
    gang: tuple[int, dict[int, GangPod]], ledger: RestartLedger
) -> None:
    size, members = gang
    decided = decide(size, _named(members), ledger)
    if any(p.state is S.pending_first_start for p in members.values()):
        assert decided.step != GangStep.restart


@given(gangs, ledgers)
def test_a_restart_is_always_of_the_whole_instance_and_within_the_budget(
    gang: tuple[int, dict[int, GangPod]], ledger: RestartLedger
) -> None:
    size, members = gang
    members = _named(members)
    decided = decide(size, members, ledger)
    if decided.step == GangStep.restart:
        assert decided.delete == tuple(members[k].name for k in sorted(members))
        assert ledger.can_restart(POLICY, NOW)
    else:
        assert decided.delete == ()
    if decided.step == GangStep.give_up:
        assert not ledger.can_restart(POLICY, NOW)
    if decided.step == GangStep.create:
        assert set(decided.create).isdisjoint(members)
    if decided.step == GangStep.keep:  # kept: every pod there, none faulty
        assert set(members) == set(range(size))
        assert all(
            p.state in (S.ready, S.starting, S.pending_first_start, S.not_ready)
            for p in members.values()
        )


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_crashes_in_a_row_never_restart_more_than_the_budget_per_hour(
    crashed: list[int],
) -> None:
    """A crash pass, then the executor records what was restarted: over any run
    inside one hour the ledger never counts more restarts than the budget."""
    ledger = RestartLedger()
    restarts = 0
    for t, index in enumerate(crashed):
        decided = decide_gang(
            2, pods(S.ready, S.ended), index=index, now=NOW + t, policy=POLICY, ledger=ledger
        )
        if decided.step == GangStep.restart:
            ledger = ledger.record(index, NOW + t)
            restarts += 1
        else:
            assert decided.step == GangStep.give_up
    assert restarts == min(len(crashed), POLICY.budget)


def _status(phase: str, started: bool | None = None, ready: str | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if started is not None:
        status["containerStatuses"] = [{"name": "worker", "started": started}]
    if ready is not None:
        status["conditions"] = [
            {"type": "Ready", "status": ready, "lastTransitionTime": "2026-01-01T00:00:10Z"}
        ]
    return status


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ({}, S.pending_first_start),
        (_status("Pending"), S.pending_first_start),
        (_status("Pending", started=False), S.pending_first_start),
        (_status("Running", started=False, ready="False"), S.starting),
        (_status("Running"), S.starting),
        (_status("Running", started=True, ready="True"), S.ready),
        (_status("Running", started=True, ready="False"), S.not_ready),
        (_status("Running", started=True), S.not_ready),
        (_status("Failed", started=True), S.ended),
        (_status("Succeeded"), S.ended),
        (_status("Unknown", started=True, ready="True"), S.lost),
    ],
)
def test_pod_state_from_status(status: dict[str, Any], state: PodState) -> None:
    assert pod_state_from_status(status)[0] == state
    assert pod_state_from_status(status, terminating=True)[0] == S.terminating


def test_not_ready_since_is_when_the_ready_condition_turned_false() -> None:
    status = _status("Running", started=True, ready="False")
    assert pod_state_from_status(status) == (S.not_ready, 1767225610.0)

"""Peer liveness (pure): the state table, the heartbeat, verdicts and the machine.

Decode decides everything about its prefill peers in `peer_liveness`: when
to probe, when a peer is unreachable, which verdict gates a new room, what
an operator report or a revival does to sockets, caches and quarantined
pages. Here: every state × event of the table, the heartbeat's schedule and
detection bound, idle peers, revival, and a model-based run of the whole
machine checked against its invariants.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdcluster.runtime.pd.peer_liveness import (
    TRANSITIONS,
    CheckRestart,
    DeclareUnreachable,
    DropSockets,
    FailHeldRooms,
    FailPeerRooms,
    ForgetIdle,
    ForgetRoute,
    Gate,
    HeartbeatTracker,
    LivenessAction,
    LivenessError,
    PeerAnswers,
    PeerEvent,
    PeerLiveness,
    PeerState,
    PeerVerdicts,
    ProbeResult,
    ReleaseRestarted,
    ResumeHeld,
    StartProbe,
    next_state,
)

PEER = "10.0.0.5:8998"
OLD, BUSY = "10.0.0.5:8998", "10.0.0.6:8998"


# ------------------------------------------------------------ heartbeat


def test_dead_after_threshold_consecutive_failures_and_success_resets() -> None:
    hb = HeartbeatTracker(interval_s=5.0, failure_threshold=2)
    hb.add(PEER, 0.0)
    assert hb.due(0.0) == [PEER]
    assert hb.on_result(PEER, False, 1.0) is ProbeResult.FAILING
    assert hb.due(4.9) == [] and hb.due(5.0) == [PEER]
    assert hb.on_result(PEER, True, 5.1) is ProbeResult.OK and hb.failures(PEER) == 0
    hb.due(10.0)
    assert hb.on_result(PEER, False, 10.5) is ProbeResult.FAILING
    hb.due(15.0)
    assert hb.on_result(PEER, False, 15.5) is ProbeResult.DEAD and hb.is_dead(PEER)
    hb.due(20.0)
    assert hb.on_result(PEER, False, 20.5) is ProbeResult.STILL_DEAD  # DEAD is reported once
    hb.due(25.0)
    assert hb.on_result(PEER, True, 25.1) is ProbeResult.RECOVERED and not hb.is_dead(PEER)


def test_no_second_probe_while_one_is_in_flight() -> None:
    hb = HeartbeatTracker(interval_s=1.0)
    hb.add(PEER, 0.0)
    assert hb.due(0.0) == [PEER]
    assert hb.due(3.0) == []
    hb.on_result(PEER, True, 3.0)
    assert hb.due(3.0) == [PEER]


def test_results_for_removed_peers_are_ignored() -> None:
    hb = HeartbeatTracker()
    hb.add(PEER, 0.0)
    hb.due(0.0)
    hb.remove(PEER)
    assert hb.on_result(PEER, False, 1.0) is ProbeResult.IGNORED and hb.peers() == []


@pytest.mark.parametrize(
    "kwargs",
    [{"interval_s": 0.0}, {"failure_threshold": 0}, {"interval_s": 1.0, "probe_timeout_s": 2.0}],
)
def test_bad_settings_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HeartbeatTracker(**kwargs)  # type: ignore[arg-type]


@given(
    interval=st.floats(0.2, 10.0),
    threshold=st.integers(1, 4),
    hang_at=st.floats(0.0, 30.0),
    wakes_per_interval=st.integers(4, 50),
)
def test_a_hung_peer_is_declared_dead_within_the_design_bound(
    interval: float, threshold: int, hang_at: float, wakes_per_interval: int
) -> None:
    """Simulate an I/O loop waking every `wake_step`; probes time out after probe_timeout_s."""
    wake_step = interval / wakes_per_interval
    hb = HeartbeatTracker(interval_s=interval, failure_threshold=threshold)
    hb.add(PEER, 0.0)
    pending: list[tuple[float, bool]] = []  # (result time, ok)
    now = 0.0
    dead_at = None
    while dead_at is None and now < hang_at + 100 * interval:
        for when, ok in list(pending):
            if when <= now:
                pending.remove((when, ok))
                if hb.on_result(PEER, ok, now) is ProbeResult.DEAD:
                    dead_at = now
        for _ in hb.due(now):
            if now < hang_at:
                pending.append((now + 0.001, True))
            else:
                pending.append((now + hb.probe_timeout_s, False))
        now += wake_step
    assert dead_at is not None
    # docs/design.md §8: interval × threshold + 1 s (plus the loop's own wake-up granularity).
    assert dead_at - hang_at <= interval * threshold + 1.0 + 2 * wake_step


# ------------------------------------------------------------ idle peers


def test_a_peer_no_room_uses_is_dropped_after_the_idle_period() -> None:
    hb = HeartbeatTracker(interval_s=1.0, idle_s=30.0)
    hb.add(OLD, 0.0)
    hb.add(BUSY, 0.0)
    assert hb.prune_idle(29.9, {BUSY}) == []
    assert hb.prune_idle(30.0, {BUSY}) == [OLD]
    assert hb.peers() == [BUSY]
    assert OLD not in hb.due(100.0)


def test_use_restarts_the_idle_clock() -> None:
    hb = HeartbeatTracker(idle_s=30.0)
    hb.add(OLD, 0.0)
    assert hb.prune_idle(20.0, {OLD}) == []  # a room used it at t=20
    assert hb.prune_idle(49.9, set()) == []
    assert hb.prune_idle(50.0, set()) == [OLD]


def test_a_probe_in_flight_keeps_the_peer_until_its_result() -> None:
    hb = HeartbeatTracker(interval_s=5.0, idle_s=10.0)
    hb.add(OLD, 0.0)
    assert hb.due(10.0) == [OLD]
    assert hb.prune_idle(10.5, set()) == []  # kept while the probe runs...
    assert hb.on_result(OLD, True, 10.6) is ProbeResult.OK
    assert hb.prune_idle(20.4, set()) == []  # ...and idle from then on
    assert hb.prune_idle(20.5, set()) == [OLD]
    assert hb.on_result(OLD, True, 20.7) is ProbeResult.IGNORED


def test_the_next_room_brings_it_back_with_a_probe_due_at_once() -> None:
    hb = HeartbeatTracker(interval_s=5.0, idle_s=10.0)
    hb.add(OLD, 0.0)
    for _ in range(2):
        hb.due(hb.next_wakeup() or 0.0)
        hb.on_result(OLD, False, 0.1)
    assert hb.is_dead(OLD)
    assert hb.prune_idle(60.0, set()) == [OLD]
    hb.add(OLD, 61.0)
    assert hb.due(61.0) == [OLD]
    assert hb.failures(OLD) == 0 and not hb.is_dead(OLD)  # a fresh start


@pytest.mark.parametrize("idle_s", [0.0, -1.0])
def test_the_idle_period_must_be_positive(idle_s: float) -> None:
    with pytest.raises(ValueError, match="idle_s"):
        HeartbeatTracker(idle_s=idle_s)


# ------------------------------------------------------------ revival
# A peer seen alive by other means (a /route answer between two probes) is
# reported DEAD again when it dies again, not STILL_DEAD from the last outage.


def fail_until_dead(hb: HeartbeatTracker, now: float) -> tuple[ProbeResult, float]:
    result = ProbeResult.OK
    for _ in range(hb.failure_threshold):
        now += hb.interval_s
        assert hb.due(now) == ["p"]
        result = hb.on_result("p", False, now)
    return result, now


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_revived_peer_dies_again_loudly(threshold: int) -> None:
    hb = HeartbeatTracker(0.5, threshold)
    hb.add("p", 0.0)
    assert hb.due(0.0) == ["p"]
    assert hb.on_result("p", True, 0.0) is ProbeResult.OK
    result, now = fail_until_dead(hb, 0.0)
    assert result is ProbeResult.DEAD
    hb.mark_alive("p")  # a /route reply between two probes
    assert not hb.is_dead("p") and hb.failures("p") == 0
    result, now = fail_until_dead(hb, now)
    assert result is ProbeResult.DEAD


def test_mark_alive_keeps_the_probe_in_flight() -> None:
    hb = HeartbeatTracker(0.5, 2)
    hb.add("p", 0.0)
    assert hb.due(0.0) == ["p"]
    hb.mark_alive("p")
    hb.mark_alive("unknown")  # not watched: nothing to do
    assert hb.due(10.0) == []  # the probe sent at 0.0 has not answered yet
    assert hb.on_result("p", True, 10.0) is ProbeResult.OK


# ---------------------------------------------------------------- heartbeat.hasten


@pytest.mark.parametrize(
    ("last_start", "in_flight", "hasten_at", "due_at"),
    [
        (None, False, 1.0, 0.0),  # never probed: already due
        (0.0, False, 0.1, 0.25),  # not before probe_timeout_s after the last start
        (0.0, False, 2.0, 2.0),  # long after: at once
        (0.0, True, 2.0, None),  # one in flight: nothing more
    ],
)
def test_hasten_brings_the_next_probe_forward_within_limits(
    last_start: float | None, in_flight: bool, hasten_at: float, due_at: float | None
) -> None:
    hb = HeartbeatTracker(interval_s=5.0, failure_threshold=2, probe_timeout_s=0.25)
    hb.add(PEER, 0.0)
    if last_start is not None:
        assert hb.due(last_start) == [PEER]
        if not in_flight:
            hb.on_result(PEER, False, last_start + 0.01)
    hb.hasten(PEER, hasten_at)
    if due_at is None:
        assert hb.due(hasten_at + 10) == []
        return
    assert hb.next_wakeup() == pytest.approx(max(due_at, 0.0))
    assert hb.due(max(due_at, hasten_at)) == [PEER]


def test_hasten_unknown_peer_is_a_no_op() -> None:
    hb = HeartbeatTracker()
    hb.hasten(PEER, 1.0)
    assert hb.peers() == [] and hb.next_wakeup() is None


@given(
    calls=st.lists(st.floats(0.0, 0.2), min_size=1, max_size=50),
    timeout=st.floats(0.05, 1.0),
)
def test_hastened_probes_never_closer_than_the_probe_timeout(
    calls: list[float], timeout: float
) -> None:
    """However many rooms ask, probes of one peer start at least probe_timeout_s apart."""
    hb = HeartbeatTracker(interval_s=5.0, probe_timeout_s=timeout)
    hb.add(PEER, 0.0)
    now, starts = 0.0, []
    for step in calls:
        now += step
        hb.hasten(PEER, now)
        if hb.due(now):
            starts.append(now)
            hb.on_result(PEER, False, now)  # refused at once, like a dead port
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(g >= timeout - 1e-9 for g in gaps)


# ------------------------------------------------------------ the state table

# Written out, not read from TRANSITIONS: every state × event, None = refused.
EXPECTED: dict[tuple[PeerState, PeerEvent], PeerState | None] = {
    (PeerState.ALIVE, PeerEvent.PROBE_OK): PeerState.ALIVE,
    (PeerState.ALIVE, PeerEvent.PROBE_FAILED): PeerState.FAILING,
    (PeerState.ALIVE, PeerEvent.PROBE_FAILED_LAST): PeerState.UNREACHABLE,
    (PeerState.ALIVE, PeerEvent.ANSWERED): PeerState.ALIVE,
    (PeerState.FAILING, PeerEvent.PROBE_OK): PeerState.ALIVE,
    (PeerState.FAILING, PeerEvent.PROBE_FAILED): PeerState.FAILING,
    (PeerState.FAILING, PeerEvent.PROBE_FAILED_LAST): PeerState.UNREACHABLE,
    (PeerState.FAILING, PeerEvent.ANSWERED): PeerState.ALIVE,
    (PeerState.UNREACHABLE, PeerEvent.PROBE_OK): PeerState.ALIVE,
    (PeerState.UNREACHABLE, PeerEvent.PROBE_FAILED): None,  # its count is past the threshold
    (PeerState.UNREACHABLE, PeerEvent.PROBE_FAILED_LAST): PeerState.UNREACHABLE,
    (PeerState.UNREACHABLE, PeerEvent.ANSWERED): PeerState.ALIVE,
}


def test_the_expectations_cover_every_state_and_event() -> None:
    assert set(EXPECTED) == {(s, e) for s in PeerState for e in PeerEvent}
    assert set(TRANSITIONS) == set(PeerState)


@pytest.mark.parametrize(
    ("state", "event"), sorted(EXPECTED, key=lambda k: (k[0].value, k[1].value))
)
def test_every_state_and_event_moves_or_is_refused(state: PeerState, event: PeerEvent) -> None:
    expected = EXPECTED[(state, event)]
    if expected is None:
        with pytest.raises(LivenessError, match=f"{state.name} on {event.name}"):
            next_state(state, event)
    else:
        assert next_state(state, event) is expected


# ProbeResult of each probe outcome from each state (threshold 2; FAILING = one failure).
@pytest.mark.parametrize(
    ("failures_before", "ok", "result", "state_after"),
    [
        (0, True, ProbeResult.OK, PeerState.ALIVE),
        (0, False, ProbeResult.FAILING, PeerState.FAILING),
        (1, True, ProbeResult.OK, PeerState.ALIVE),
        (1, False, ProbeResult.DEAD, PeerState.UNREACHABLE),
        (2, True, ProbeResult.RECOVERED, PeerState.ALIVE),
        (2, False, ProbeResult.STILL_DEAD, PeerState.UNREACHABLE),
    ],
)
def test_each_probe_outcome_reports_what_it_did(
    failures_before: int, ok: bool, result: ProbeResult, state_after: PeerState
) -> None:
    hb = HeartbeatTracker(interval_s=1.0, failure_threshold=2)
    hb.add(PEER, 0.0)
    now = 0.0
    for _ in range(failures_before):
        hb.due(now)
        hb.on_result(PEER, False, now)
        now += 1.0
    hb.due(now)
    assert hb.on_result(PEER, ok, now) is result
    assert hb.state(PEER) is state_after


# ------------------------------------------------------------ verdicts


def test_an_operator_report_refuses_then_expires_and_a_heartbeat_verdict_holds() -> None:
    v = PeerVerdicts()
    v.declare(PEER, "prefill_pod_lost", 10.0, until_recovered=False, bootstrap_s=5.0)
    assert v.gate(PEER, 14.9) == (Gate.REFUSE, "prefill_pod_lost")
    assert v.gate(PEER, 15.0) == (Gate.PROCEED, None) and v.down(15.0) == {}
    v.declare(PEER, "prefill_unreachable", 20.0, until_recovered=True, bootstrap_s=5.0)
    assert v.gate(PEER, 1e9) == (Gate.HOLD, "prefill_unreachable")
    v.recovered(PEER)
    assert v.gate(PEER, 1e9) == (Gate.PROCEED, None)


def test_overlapping_verdicts_keep_the_first_reason_and_the_longer_limits() -> None:
    v = PeerVerdicts()
    v.declare(PEER, "prefill_pod_lost", 0.0, until_recovered=False, bootstrap_s=5.0)
    v.declare(PEER, "prefill_unreachable", 1.0, until_recovered=True, bootstrap_s=5.0)
    assert v.gate(PEER, 4.0) == (Gate.REFUSE, "prefill_pod_lost")  # still refused
    assert v.gate(PEER, 100.0) == (Gate.HOLD, "prefill_pod_lost")  # then held, unbounded
    [(peer, verdict)] = list(v.current(100.0))
    assert peer == PEER and verdict.until == math.inf and verdict.refuse_until == 5.0


def test_a_report_by_host_covers_every_instance_on_it() -> None:
    v = PeerVerdicts()
    v.declare("10.0.0.5", "prefill_pod_lost", 0.0, until_recovered=False, bootstrap_s=5.0)
    assert v.reason_for(PEER, 1.0) == "prefill_pod_lost"
    assert v.reason_for(BUSY, 1.0) is None


# ------------------------------------------------------------ the machine, by example

A_RANKS = ("10.0.0.5:7001", "10.0.0.5:7002")


def machine(*, one_sided: bool, threshold: int = 2) -> PeerLiveness:
    return PeerLiveness(
        HeartbeatTracker(interval_s=1.0, failure_threshold=threshold),
        bootstrap_s=5.0,
        one_sided=one_sided,
    )


def test_a_dead_peer_fails_held_rooms_and_is_declared_unreachable_once() -> None:
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    assert m.tick(0.0, {PEER}) == [StartProbe(PEER, 0.5)]
    assert m.on_probe(PEER, False, 0.5) == [FailHeldRooms(PEER)]
    assert m.tick(1.0, {PEER}) == [StartProbe(PEER, 0.5)]
    assert m.on_probe(PEER, False, 1.5) == [FailHeldRooms(PEER), DeclareUnreachable(PEER)]
    m.tick(2.0, {PEER})
    assert m.on_probe(PEER, False, 2.5) == [FailHeldRooms(PEER)]


def test_a_heartbeat_loss_over_tcp_drops_the_sockets_and_fails_the_rooms() -> None:
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    acts = m.lost(
        PEER,
        "prefill_unreachable",
        1.0,
        definitive=False,
        until_recovered=True,
        rooms=[(PEER, A_RANKS[0]), (BUSY, "10.0.0.6:7001")],
        routes={PEER: [A_RANKS[1]]},
    )
    assert acts[0] == ForgetRoute(PEER)
    assert isinstance(acts[1], DropSockets) and set(acts[1].endpoints) == set(A_RANKS)
    assert acts[2:] == [FailPeerRooms(PEER, "prefill_unreachable", False, True)]
    assert m.quarantined() == {}


def test_a_one_sided_loss_quarantines_until_a_definitive_one() -> None:
    m = machine(one_sided=True)
    m.watch(PEER, 0.0)
    acts = m.lost(PEER, "prefill_pod_lost", 1.0, definitive=False, rooms=[(PEER, *A_RANKS)])
    assert not any(isinstance(a, DropSockets) for a in acts)  # the ABORTs must get through
    assert m.quarantined() == {PEER: frozenset(A_RANKS)}
    acts = m.lost(PEER, "prefill_pod_lost", 2.0, definitive=True, rooms=[(PEER, *A_RANKS)])
    assert isinstance(acts[0], DropSockets) and set(acts[0].endpoints) == set(A_RANKS)
    assert m.quarantined() == {}


def test_a_quarantined_instance_back_on_new_endpoints_releases_the_old_ones() -> None:
    m = machine(one_sided=True)
    m.watch(PEER, 0.0)
    m.lost(PEER, "prefill_unreachable", 1.0, definitive=False, rooms=[(PEER, *A_RANKS)])
    assert m.on_route_answer(PEER, 2.0)[-1] == CheckRestart(PEER)
    assert m.restart_checked(PEER, None) == []  # no answer: nothing decided
    assert m.restart_checked(PEER, [A_RANKS[0], "10.0.0.5:7003"]) == [ReleaseRestarted(A_RANKS[1])]
    m.keep_quarantined(PEER, waiting={A_RANKS[0]})
    assert m.quarantined() == {PEER: frozenset({A_RANKS[0]})}
    m.keep_quarantined(PEER, waiting=set())  # no room waits any more: settled
    assert m.quarantined() == {}


def test_only_an_answer_to_a_later_request_undoes_a_report() -> None:
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    assert m.tick(0.0, {PEER}) == [StartProbe(PEER, 0.5)]  # in flight before the report
    m.lost(PEER, "prefill_pod_lost", 0.2, definitive=False)  # NotReady: it may resume
    assert m.on_probe(PEER, True, 0.3) == []  # started before: proves nothing
    assert m.on_route_answer(PEER, 0.1) == []
    assert m.on_route_answer(PEER, 0.4) == [PeerAnswers(PEER), ResumeHeld((PEER, PEER))]


# ------------------------------------------------------------ a definitive report: a new start

OLD_START, NEW_START = "start-1", "start-2"


def reported_gone(start: str | None = OLD_START) -> PeerLiveness:
    """A machine that saw PEER answer as `start` (None: naming none), then got a
    definitive report on it at 1.0."""
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    m.on_probe(PEER, True, 0.1, start)
    m.lost(PEER, "prefill_pod_lost", 1.0, definitive=True)
    return m


def probe(m: PeerLiveness, start: str | None, at: float, ok: bool = True) -> list[LivenessAction]:
    """Start the next probe of PEER at `at`; it answers at once, naming `start`."""
    m.hold(PEER, at)
    assert StartProbe(PEER, 0.5) in m.tick(at, {PEER})
    return m.on_probe(PEER, ok, at + 0.01, start)


def test_a_new_start_answering_ends_a_definitive_report() -> None:
    m = reported_gone()
    assert probe(m, NEW_START, 1.5) == [
        PeerAnswers(PEER),
        ForgetRoute(PEER),
        ResumeHeld((PEER, PEER)),
    ]


@pytest.mark.parametrize(
    ("seen", "answers", "why"),
    [
        (OLD_START, OLD_START, "the same start: the old process still answering"),
        (OLD_START, None, "an answer naming no start proves nothing"),
        (None, NEW_START, "no start seen before the report: nothing to tell it from"),
    ],
)
def test_no_proof_of_a_new_start_leaves_a_definitive_report_to_expire(
    seen: str | None, answers: str | None, why: str
) -> None:
    m = reported_gone(seen)
    for at in (1.5, 2.5, 3.5, 4.5):
        assert probe(m, answers, at) == [], why
    # The report expires after bootstrap_s (5 s), the room table's verdict with
    # it: nothing of it is left to undo.
    assert probe(m, answers, 7.0) == []


def test_a_probe_started_before_the_report_proves_nothing_even_from_a_new_start() -> None:
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    m.on_probe(PEER, True, 0.1, OLD_START)
    m.tick(1.0, {PEER})  # in flight when the report comes
    m.lost(PEER, "prefill_pod_lost", 1.2, definitive=True)
    assert m.on_probe(PEER, True, 1.3, NEW_START) == []
    # Nor does it make the new start the one the report is about: a later answer proves it.
    assert ResumeHeld((PEER, PEER)) in probe(m, NEW_START, 2.0)


def test_a_zombie_answer_does_not_undo_a_heartbeat_death_under_a_report() -> None:
    """Heartbeat death, then the report; the old process answers: both stand.
    The new start then ends both at once."""
    m = machine(one_sided=False, threshold=1)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    m.on_probe(PEER, True, 0.1, OLD_START)
    assert DeclareUnreachable(PEER) in probe(m, None, 1.0, ok=False)
    m.lost(PEER, "prefill_unreachable", 1.01, definitive=False, until_recovered=True)
    m.lost(PEER, "prefill_pod_lost", 1.2, definitive=True)
    assert probe(m, OLD_START, 1.5) == []
    assert probe(m, OLD_START, 2.5) == []
    assert probe(m, NEW_START, 3.5)[-1] == ResumeHeld((PEER, PEER))
    assert probe(m, NEW_START, 4.5) == []  # nothing left to undo


def test_a_report_newer_than_the_answering_request_keeps_the_heartbeat_death() -> None:
    """The probe that finds an unreachable peer answering started before a new
    report: it undoes nothing (before, it cleared the report with the death)."""
    m = machine(one_sided=False, threshold=1)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    assert DeclareUnreachable(PEER) in m.on_probe(PEER, False, 0.1, None)
    m.lost(PEER, "prefill_unreachable", 0.1, definitive=False, until_recovered=True)
    m.tick(1.0, {PEER})
    m.lost(PEER, "prefill_pod_lost", 1.2, definitive=False)
    assert m.on_probe(PEER, True, 1.3, OLD_START) == []
    # The next answer (its request after both) undoes them together.
    assert probe(m, OLD_START, 2.0)[-1] == ResumeHeld((PEER, PEER))


def test_a_second_report_keeps_the_starts_the_first_was_about() -> None:
    """A report's start stays no proof when another report on the peer follows."""
    m = reported_gone(OLD_START)
    m.lost(PEER, "prefill_pod_lost", 1.1, definitive=True)  # the same start, again
    assert probe(m, OLD_START, 1.5) == []
    assert probe(m, NEW_START, 2.5)[-1] == ResumeHeld((PEER, PEER))


def test_a_report_by_host_needs_a_new_start_of_the_instance_answering() -> None:
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    m.on_probe(PEER, True, 0.1, OLD_START)
    m.lost("10.0.0.5", "prefill_pod_lost", 1.0, definitive=True)
    assert probe(m, OLD_START, 1.5) == []
    assert probe(m, NEW_START, 2.5)[-1] == ResumeHeld((PEER, "10.0.0.5"))


def test_an_idle_peer_forgets_its_start() -> None:
    """A peer forgotten as idle and added back has no start it could be told from."""
    m = machine(one_sided=False)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    m.on_probe(PEER, True, 0.1, OLD_START)
    assert ForgetIdle(PEER) in m.tick(1000.0, set())
    m.watch(PEER, 1000.0)
    m.lost(PEER, "prefill_pod_lost", 1000.0, definitive=True)
    assert probe(m, NEW_START, 1000.5) == []


def test_a_probe_answering_an_unreachable_peer_revives_it_fresh() -> None:
    m = machine(one_sided=False, threshold=1)
    m.watch(PEER, 0.0)
    m.tick(0.0, {PEER})
    assert m.on_probe(PEER, False, 0.5) == [FailHeldRooms(PEER), DeclareUnreachable(PEER)]
    m.tick(1.0, {PEER})
    assert m.on_probe(PEER, True, 1.1) == [
        PeerAnswers(PEER),
        ForgetRoute(PEER),
        ResumeHeld((PEER,)),
    ]
    assert m.heartbeat.state(PEER) is PeerState.ALIVE and m.heartbeat.failures(PEER) == 0


def test_quarantine_keeps_an_idle_peer_watched() -> None:
    m = machine(one_sided=True)
    m.watch(PEER, 0.0)
    m.lost(PEER, "prefill_unreachable", 0.0, definitive=False, rooms=[(PEER, *A_RANKS)])
    acts = m.tick(1000.0, set())
    assert not any(isinstance(a, ForgetIdle) for a in acts) and StartProbe(PEER, 0.5) in acts
    m.on_probe(PEER, False, 1000.5)
    m.lost(PEER, "prefill_pod_lost", 1000.5, definitive=True)
    assert ForgetIdle(PEER) in m.tick(2000.0, set())


# ------------------------------------------------------------ the machine, by model

INSTANCES = (OLD, BUSY)
RANKS = {OLD: ("10.0.0.5:7001", "10.0.0.5:7002"), BUSY: ("10.0.0.6:7001",)}
BOOT_S = 5.0


class LivenessModel(RuleBasedStateMachine):
    """Drive one decode rank's liveness with any interleaving of events."""

    @initialize(one_sided=st.booleans(), threshold=st.integers(1, 3))
    def start(self, one_sided: bool, threshold: int) -> None:
        self.m = machine(one_sided=one_sided, threshold=threshold)
        self.verdicts = PeerVerdicts()  # as the room table keeps them
        self.now = 0.0
        self.in_flight: dict[str, float] = {}  # peer -> when its probe started
        self.reports: dict[str, float] = {}  # operator report -> when
        self.answered_after: dict[str, float] = {}  # latest start of a request it answered
        # Definitive reports: peer -> (when, every start named there before it).
        self.gone: dict[str, tuple[float, frozenset[str]]] = {}
        # peer -> latest start of a request answered by a start none of its
        # definitive reports saw: the only answer that may undo one.
        self.new_start_after: dict[str, float] = {}
        self.serving = dict.fromkeys(INSTANCES, 0)  # each instance's start, counted
        self.named: dict[str, set[str]] = {p: set() for p in INSTANCES}  # starts it named
        # peer -> the start its latest answer named, while watched (what the
        # machine may tell a new start from), and whether every definitive
        # report standing on it had one.
        self.latest: dict[str, str] = {}
        self.known_start: dict[str, bool] = {}
        self.unreachable: set[str] = set()  # declared, not answered since
        self.dead_since: dict[str, float] = {}  # latest heartbeat death
        self.rooms: set[str] = set()

    def perform(self, acts: list[LivenessAction]) -> None:
        for act in acts:
            if isinstance(act, StartProbe):
                assert act.peer not in self.in_flight, "two probes of one peer in flight"
                self.in_flight[act.peer] = self.now
            elif isinstance(act, DeclareUnreachable):
                assert act.peer not in self.unreachable, "one outage reported twice"
                self.unreachable.add(act.peer)
                self.dead_since[act.peer] = self.now
                self.perform(
                    self.m.lost(
                        act.peer,
                        "prefill_unreachable",
                        self.now,
                        definitive=False,
                        until_recovered=True,
                        rooms=[(p, *RANKS[p]) for p in self.rooms],
                    )
                )
            elif isinstance(act, FailPeerRooms):
                self.verdicts.declare(
                    act.peer,
                    act.reason,
                    self.now,
                    until_recovered=act.until_recovered,
                    bootstrap_s=BOOT_S,
                )
            elif isinstance(act, ResumeHeld):
                for peer in act.peers:
                    self.verdicts.recovered(peer)
                    # Forget the reports this answer may undo (the invariants
                    # below catch one it may not: its verdict is gone too early).
                    at = self.reports.get(peer)
                    if at is not None and self.answered_after.get(peer, -1.0) >= at:
                        self.reports.pop(peer)
                    gone = self.gone.get(peer)
                    if gone is not None and self.new_start_after.get(peer, -1.0) >= gone[0]:
                        self.gone.pop(peer)
            elif isinstance(act, PeerAnswers):
                self.unreachable.discard(act.peer)
                # A revived peer starts fresh.
                assert self.m.heartbeat.failures(act.peer) == 0
                assert self.m.heartbeat.state(act.peer) in (PeerState.ALIVE, None)
            elif isinstance(act, DropSockets):
                for endpoint in act.endpoints:
                    assert not any(endpoint in e for e in self.m.quarantined().values()), (
                        "a quarantined endpoint's socket dropped"
                    )
            elif isinstance(act, ForgetIdle):
                assert act.peer not in self.rooms and not self.m.is_quarantined(act.peer)
                self.latest.pop(act.peer, None)
                self.in_flight.pop(act.peer, None)
                self.unreachable.discard(act.peer)

    @rule(peer=st.sampled_from(INSTANCES))
    def open_room(self, peer: str) -> None:
        self.rooms.add(peer)
        self.m.watch(peer, self.now)
        self.m.hold(peer, self.now)

    @rule(peer=st.sampled_from(INSTANCES))
    def close_room(self, peer: str) -> None:
        self.rooms.discard(peer)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 6.0, 400.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.perform(self.m.tick(self.now, self.rooms))

    @rule(peer=st.sampled_from(INSTANCES))
    def restart(self, peer: str) -> None:
        """A new process at the same address: its answers name another start."""
        self.serving[peer] += 1

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), ok=st.booleans(), names_start=st.booleans())
    def probe_answers(self, data: st.DataObject, ok: bool, names_start: bool) -> None:
        peer = data.draw(st.sampled_from(sorted(self.in_flight)))
        started = self.in_flight.pop(peer)
        self.now += 0.01
        # Whoever serves now answers (the old process until a restart: a zombie
        # after a definitive report); an older server names no start.
        start = f"{peer}#{self.serving[peer]}" if names_start else None
        gone = self.gone.get(peer)
        if ok:
            # The outage ended for the heartbeat, whatever verdict still stands:
            # its next death is reported again.
            self.unreachable.discard(peer)
            self.answered_after[peer] = max(self.answered_after.get(peer, -1.0), started)
            if gone is not None and started >= gone[0] and start and start not in gone[1]:
                self.new_start_after[peer] = max(self.new_start_after.get(peer, -1.0), started)
        # A new start answering a request sent after every report on it (and
        # every death of it), where this rank knew the start they were about.
        proves_new_start = (
            ok
            and start is not None
            and gone is not None
            and self.now < gone[0] + BOOT_S
            and self.known_start.get(peer, False)
            and start not in gone[1]
            and started >= self.reports.get(peer, math.inf)
            and started >= self.dead_since.get(peer, -1.0)
        )
        self.perform(self.m.on_probe(peer, ok, self.now, start))
        if ok and start is not None:
            self.named[peer].add(start)
        if ok and peer in self.m.peers():
            if start is None:
                self.latest.pop(peer, None)
            else:
                self.latest[peer] = start
        if proves_new_start:
            # A new start answered a request sent after every report on it: it is used again.
            assert self.verdicts.gate(peer, self.now)[0] is not Gate.REFUSE, "new start refused"

    @rule(peer=st.sampled_from(INSTANCES), ago=st.sampled_from([0.0, 0.5, 3.0]))
    def route_answers(self, peer: str, ago: float) -> None:
        started = self.now - ago
        self.answered_after[peer] = max(self.answered_after.get(peer, -1.0), started)
        self.perform(self.m.on_route_answer(peer, started))

    @rule(peer=st.sampled_from(INSTANCES), gone=st.booleans())
    def operator_reports(self, peer: str, gone: bool) -> None:
        self.reports[peer] = self.now
        if gone:
            old = self.gone.get(peer)
            live = old is not None and old[0] > self.now - BOOT_S
            before = frozenset(self.named[peer]) | (old[1] if old else frozenset())
            self.gone[peer] = (self.now, before)
            known = peer in self.m.peers() and peer in self.latest
            self.known_start[peer] = known and (self.known_start.get(peer, True) or not live)
        self.perform(
            self.m.lost(
                peer,
                "prefill_pod_lost",
                self.now,
                definitive=gone,
                rooms=[(p, *RANKS[p]) for p in self.rooms],
                routes={w: RANKS[w] for w in self.m.watched_by(peer)},
            )
        )
        if gone:
            assert not self.m.is_quarantined(peer), "a gone peer still quarantined"

    @precondition(lambda self: bool(self.m.quarantined()))
    @rule(data=st.data(), moved=st.booleans())
    def restart_check_answers(self, data: st.DataObject, moved: bool) -> None:
        peer = data.draw(st.sampled_from(sorted(self.m.quarantined())))
        old = self.m.quarantined()[peer]
        now_at = ["10.0.0.9:7001"] if moved else list(old)
        released = self.m.restart_checked(peer, now_at)
        # Quarantined pages are released only for endpoints the instance left.
        assert {a.endpoint for a in released if isinstance(a, ReleaseRestarted)} == (
            old - set(now_at)
        )
        self.m.keep_quarantined(peer, waiting=set(RANKS[peer]) if peer in self.rooms else set())

    @invariant()
    def a_reported_peer_gets_no_rooms_until_it_answers_a_later_request(self) -> None:
        if not hasattr(self, "m"):
            return
        for peer, at in self.reports.items():
            answered = self.answered_after.get(peer, -1.0)
            if self.now < at + BOOT_S and answered < at:
                assert self.verdicts.gate(peer, self.now)[0] is Gate.REFUSE

    @invariant()
    def a_peer_reported_gone_gets_no_rooms_until_a_new_start_answers(self) -> None:
        """Its old process answering (a zombie), or a server naming no start, never ends it."""
        if not hasattr(self, "m"):
            return
        for peer, (at, _) in self.gone.items():
            if self.now < at + BOOT_S and self.new_start_after.get(peer, -1.0) < at:
                assert self.verdicts.gate(peer, self.now)[0] is Gate.REFUSE

    @invariant()
    def state_matches_the_failure_count(self) -> None:
        if not hasattr(self, "m"):
            return
        hb = self.m.heartbeat
        for peer in hb.peers():
            n, state = hb.failures(peer), hb.state(peer)
            if state is PeerState.ALIVE:
                assert n == 0
            elif state is PeerState.FAILING:
                assert 0 < n < hb.failure_threshold
            else:
                assert n >= hb.failure_threshold

    @invariant()
    def quarantine_only_on_a_one_sided_transport(self) -> None:
        if hasattr(self, "m") and not self.m.one_sided:
            assert self.m.quarantined() == {}


TestLivenessModel = LivenessModel.TestCase
TestLivenessModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

"""Idle prefill peers leave the heartbeat (pure).

A decode rank probes the prefill instances its rooms use. One that no room
(and no quarantine) needed for `idle_s` stops being probed — after a
scale-down or a rollout it would otherwise be probed, and its bootstrap
client kept, for the life of the process. The next room on it adds it back
with its first probe due at once.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd.heartbeat import HeartbeatTracker, Verdict

OLD, BUSY = "10.0.0.5:8998", "10.0.0.6:8998"


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
    assert hb.on_result(OLD, True, 10.6) is Verdict.OK
    assert hb.prune_idle(20.4, set()) == []  # ...and idle from then on
    assert hb.prune_idle(20.5, set()) == [OLD]
    assert hb.on_result(OLD, True, 20.7) is Verdict.IGNORED


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

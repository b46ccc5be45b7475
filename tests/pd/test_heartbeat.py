"""Heartbeat tracker: threshold, reset on success, detection time bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd.heartbeat import HeartbeatTracker, Verdict

PEER = "10.0.0.5:8998"


def test_dead_after_threshold_consecutive_failures_and_success_resets() -> None:
    hb = HeartbeatTracker(interval_s=5.0, failure_threshold=2)
    hb.add(PEER, 0.0)
    assert hb.due(0.0) == [PEER]
    assert hb.on_result(PEER, False, 1.0) is Verdict.FAILING
    assert hb.due(4.9) == [] and hb.due(5.0) == [PEER]
    assert hb.on_result(PEER, True, 5.1) is Verdict.OK and hb.failures(PEER) == 0
    hb.due(10.0)
    assert hb.on_result(PEER, False, 10.5) is Verdict.FAILING
    hb.due(15.0)
    assert hb.on_result(PEER, False, 15.5) is Verdict.DEAD and hb.is_dead(PEER)
    hb.due(20.0)
    assert hb.on_result(PEER, False, 20.5) is Verdict.STILL_DEAD  # DEAD is reported once
    hb.due(25.0)
    assert hb.on_result(PEER, True, 25.1) is Verdict.RECOVERED and not hb.is_dead(PEER)


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
    assert hb.on_result(PEER, False, 1.0) is Verdict.IGNORED and hb.peers() == []


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
                if hb.on_result(PEER, ok, now) is Verdict.DEAD:
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

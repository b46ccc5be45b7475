"""Pure: a peer seen alive by other means is reported DEAD again when it dies again.

Decode also learns that a prefill instance is back from a fresh `/route`
answer, which can come between two probes. If the instance then dies before
the next probe, the heartbeat must still report a new DEAD verdict (which
fails its rooms), not carry on with STILL_DEAD from the previous outage.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd.heartbeat import HeartbeatTracker, Verdict


def fail_until_verdict(hb: HeartbeatTracker, now: float) -> tuple[Verdict, float]:
    verdict = Verdict.OK
    for _ in range(hb.failure_threshold):
        now += hb.interval_s
        assert hb.due(now) == ["p"]
        verdict = hb.on_result("p", False, now)
    return verdict, now


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_revived_peer_dies_again_loudly(threshold: int) -> None:
    hb = HeartbeatTracker(0.5, threshold)
    hb.add("p", 0.0)
    assert hb.due(0.0) == ["p"]
    assert hb.on_result("p", True, 0.0) is Verdict.OK
    verdict, now = fail_until_verdict(hb, 0.0)
    assert verdict is Verdict.DEAD
    hb.mark_alive("p")  # a /route reply between two probes
    assert not hb.is_dead("p") and hb.failures("p") == 0
    verdict, now = fail_until_verdict(hb, now)
    assert verdict is Verdict.DEAD


def test_mark_alive_keeps_the_probe_in_flight() -> None:
    hb = HeartbeatTracker(0.5, 2)
    hb.add("p", 0.0)
    assert hb.due(0.0) == ["p"]
    hb.mark_alive("p")
    hb.mark_alive("unknown")  # not watched: nothing to do
    assert hb.due(10.0) == []  # the probe sent at 0.0 has not answered yet
    assert hb.on_result("p", True, 10.0) is Verdict.OK

"""A new room for a prefill declared dead fails at once, until the peer answers again.

Without this a room opened just after a heartbeat verdict (or the
operator's report) fetched /route from the dead server, retried, and failed
seconds later with a different reason. Table-driven over who declared the
peer dead, how the room names it, how long ago, and whether it came back.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.decode_rooms import DecodeRoomTable
from pdcluster.runtime.pd.heartbeat import HeartbeatTracker
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.settings import RoomSettings
from tests.pd.sim import BOOTSTRAP, Net

S = RoomSettings(bootstrap_s=6.0, waiting_s=10.0, release_s=3.0)
OTHER = "127.0.0.9:8998"


def decode_table() -> DecodeRoomTable:
    table: DecodeRoomTable = next(iter(Net(settings=S).decode.values()))
    return table


@dataclass(frozen=True)
class Case:
    name: str
    declared: str  # the peer string of the verdict
    reason: str
    heartbeat: bool  # heartbeat verdict (until recovered) or operator report (bootstrap_s)
    room_peer: str  # the instance the new room is for
    after_s: float  # room opened this long after the verdict
    recovered: bool  # peer_recovered called in between
    expect: str | None  # the room's failure reason, or None: it goes on to /route


CASES = [
    Case("heartbeat, at once", BOOTSTRAP, "prefill_unreachable", True, BOOTSTRAP, 0.0, False,
         "prefill_unreachable"),
    Case("heartbeat, long after bootstrap_s", BOOTSTRAP, "prefill_unreachable", True, BOOTSTRAP,
         10 * S.bootstrap_s, False, "prefill_unreachable"),
    Case("heartbeat, recovered", BOOTSTRAP, "prefill_unreachable", True, BOOTSTRAP, 0.5, True,
         None),
    Case("heartbeat, another instance", BOOTSTRAP, "prefill_unreachable", True, OTHER, 0.0,
         False, None),
    Case("operator, within bootstrap_s", BOOTSTRAP, "pod_deleted", False, BOOTSTRAP, 1.0, False,
         "pod_deleted"),
    Case("operator, after bootstrap_s", BOOTSTRAP, "pod_deleted", False, BOOTSTRAP, S.bootstrap_s,
         False, None),
    Case("operator, by pod IP", "127.0.0.1", "prefill_pod_lost", False, BOOTSTRAP, 1.0, False,
         "prefill_pod_lost"),
    Case("operator, recovered", BOOTSTRAP, "pod_deleted", False, BOOTSTRAP, 1.0, True, None),
    Case("operator, other host", "127.0.0.9", "pod_deleted", False, BOOTSTRAP, 1.0, False, None),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_new_room_on_a_declared_dead_peer(case: Case) -> None:
    table = decode_table()
    table.fail_peer(case.declared, case.reason, 100.0, until_recovered=case.heartbeat)
    if case.recovered:
        table.peer_recovered(case.declared)
    now = 100.0 + case.after_s
    table.add_room(7, "rid-7", case.room_peer, now)
    acts = table.fail_if_peer_dead(7, now)
    if case.expect is None:
        assert acts == [] and table.state(7) is KVPoll.Bootstrapping
        assert table.peer_verdict(case.room_peer, now) is None
    else:
        # Failed and gone at once: nothing was sent, no pages were held.
        assert acts == [A.RoomFailed(7, "rid-7", case.expect)]
        assert 7 not in table
        assert table.peer_verdict(case.room_peer, now) == case.expect


def test_a_second_verdict_keeps_the_first_reason_and_the_longer_limit() -> None:
    table = decode_table()
    table.fail_peer(BOOTSTRAP, "prefill_unreachable", 0.0, until_recovered=True)
    table.fail_peer(BOOTSTRAP, "pod_deleted", 1.0)  # operator, bounded: must not shorten it
    assert table.peers_down(100.0) == {BOOTSTRAP: "prefill_unreachable"}
    table.peer_recovered(BOOTSTRAP)
    assert table.peers_down(100.0) == {}


def test_an_expired_verdict_does_not_lend_its_reason() -> None:
    table = decode_table()
    table.fail_peer(BOOTSTRAP, "pod_deleted", 0.0)
    table.fail_peer(BOOTSTRAP, "prefill_unreachable", S.bootstrap_s + 1, until_recovered=True)
    assert table.peer_verdict(BOOTSTRAP, 1000.0) == "prefill_unreachable"


# ---------------------------------------------------------------- heartbeat.hasten

PEER = BOOTSTRAP


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

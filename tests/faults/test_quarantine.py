"""Pure tests: a heartbeat verdict does not free pages a one-sided writer may still write.

Over shm a prefill rank writes into decode's memory without decode taking
part. A heartbeat that stops answering says the peer is unreachable, not
that it is gone: a SIGSTOPped process resumes and finishes the writes it had
started. So on a one-sided transport `fail_peer(..., definitive=False)`
fails the rooms (clients hear at once) but keeps their pages until the
prefill acknowledges the ABORT or a definitive verdict arrives; over tcp the
receiver drops a resumed writer's frames, so any verdict frees them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import Abort, AbortAck, decode
from pdcluster.runtime.pd.settings import RoomSettings
from tests.pd.sim import BOOTSTRAP, Net, d_endpoint, p_endpoint

SETTINGS = RoomSettings(bootstrap_s=5.0, waiting_s=10.0, release_s=2.0, tombstone_s=100.0)
D0, P0 = RankCoord(), RankCoord()
ROOM, RID, PAGES = 77, "req-q", [3, 4, 5]


def transferring(one_sided: bool) -> Net:
    """One room whose prefill rank has writes in flight into decode's pages."""
    net = Net(one_sided=one_sided, settings=SETTINGS)
    net.open_decode(ROOM, RID, 0.0)
    net.pump(0.0)
    net.open_prefill(ROOM, RID, 12, 0.0)  # 3 pages of 4 tokens
    net.assign(ROOM, PAGES, 0.1)
    net.pump(0.1)
    net.handle(p_endpoint(P0), net.prefill[P0].writes_enqueued(ROOM, 2, 0.2))
    net.pump(0.2)
    assert net.decode[D0].state(ROOM) is KVPoll.Transferring
    return net


def released(acts: list[A.Action]) -> bool:
    return any(isinstance(a, A.ReleasePages) for a in acts)


def aborts(net: Net) -> list[Abort]:
    wire = net.wires[(d_endpoint(D0), p_endpoint(P0))]
    return [m for m in (decode(f) for f in wire) if isinstance(m, Abort)]


@pytest.mark.parametrize("one_sided", [True, False])
def test_heartbeat_verdict_fails_rooms_at_once(one_sided: bool) -> None:
    net = transferring(one_sided)
    acts = net.handle(
        d_endpoint(D0),
        net.decode[D0].fail_peer(BOOTSTRAP, "prefill_unreachable", 1.0, definitive=False),
    )
    assert [a.reason for a in acts if isinstance(a, A.RoomFailed)] == ["prefill_unreachable"]
    if one_sided:
        # Not gone, maybe hung: asked to stop, and the pages wait for its answer.
        assert not released(acts)
        assert len(aborts(net)) == 1
        assert net.decode[D0].state(ROOM) is KVPoll.Failed
    else:
        assert released(acts)
        assert aborts(net) == []


def test_one_sided_pages_outlast_every_timer_until_the_ack() -> None:
    net = transferring(one_sided=True)
    table = net.decode[D0]
    net.handle(
        d_endpoint(D0), table.fail_peer(BOOTSTRAP, "prefill_unreachable", 1.0, definitive=False)
    )
    for now in (2.0, 50.0, 10_000.0):
        # Further verdicts and every timer: still held.
        acts = table.fail_peer(BOOTSTRAP, "prefill_unreachable", now, definitive=False)
        acts += table.tick(now)
        assert not released(net.handle(d_endpoint(D0), acts))
    # The process wakes up: it reads the ABORT, drains its two writes, acks.
    net.pump(10_001.0)
    net.handle(p_endpoint(P0), net.prefill[P0].writes_done(ROOM, 2, True, 10_001.0))
    net.pump(10_001.0)
    assert len(net.actions(d_endpoint(D0), A.ReleasePages)) == 1
    assert ROOM not in table


@pytest.mark.parametrize("reason", ["pod_deleted", "prefill_restarted"])
def test_a_definitive_verdict_frees_quarantined_pages(reason: str) -> None:
    net = transferring(one_sided=True)
    table = net.decode[D0]
    net.kill(p_endpoint(P0))
    net.handle(
        d_endpoint(D0), table.fail_peer(BOOTSTRAP, "prefill_unreachable", 1.0, definitive=False)
    )
    assert not net.actions(d_endpoint(D0), A.ReleasePages)
    acts = net.handle(d_endpoint(D0), table.fail_peer(p_endpoint(P0), reason, 2.0))
    assert released(acts)
    assert ROOM not in table


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.sampled_from(["verdict", "tick", "stale_ack", "definitive", "resume"]), max_size=12
    )
)
def test_one_sided_pages_free_only_on_ack_or_definitive(steps: list[str]) -> None:
    net = transferring(one_sided=True)
    table = net.decode[D0]
    net.handle(
        d_endpoint(D0), table.fail_peer(BOOTSTRAP, "prefill_unreachable", 1.0, definitive=False)
    )
    now, drained, definitive = 1.0, False, False
    for step in steps:
        now += 7.0
        acts: list[A.Action] = []
        if step == "verdict":
            acts = table.fail_peer(BOOTSTRAP, "prefill_unreachable", now, definitive=False)
        elif step == "tick":
            acts = table.tick(now)
        elif step == "stale_ack":
            gen = 0  # the room's generation is 1: an older one
            acts = table.on_message(AbortAck(room=ROOM, rank=P0, generation=gen), now)
        elif step == "definitive":
            definitive = True
            acts = table.fail_peer(BOOTSTRAP, "pod_deleted", now)
        elif step == "resume" and not drained:
            drained = True
            net.pump(now)
            net.handle(p_endpoint(P0), net.prefill[P0].writes_done(ROOM, 2, True, now))
            net.pump(now)
        net.handle(d_endpoint(D0), acts)
        freed = bool(net.actions(d_endpoint(D0), A.ReleasePages))
        assert freed == (drained or definitive), (steps, step)
    assert len(net.actions(d_endpoint(D0), A.ReleasePages)) <= 1

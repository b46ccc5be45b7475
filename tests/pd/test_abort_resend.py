"""A lost ABORT (or a lost ack) on a one-sided transport is sent again (pure).

Over shm a failed room keeps its pages until every source acked its ABORT or
is declared gone — never on a timeout alone. One lost message would then
hold the pages forever, so the table sends the ABORT again every
`abort_resend_interval_s` (default `release_s / 4`) to each source that has
neither acked nor been declared dead; prefill acks a repeat again.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.messages import Abort, decode
from pdcluster.runtime.pd.settings import RoomSettings

from .sim import BOOTSTRAP, Net, d_endpoint, p_endpoint

D0 = P0 = RankCoord()
ROOM = 66
RID = "rid-00000066"
S = RoomSettings(bootstrap_s=5.0, waiting_s=10.0, release_s=2.0)
EVERY = S.abort_resend_interval_s  # 0.5 s


def failed(one_sided: bool = True, shape: InstanceShape | None = None) -> Net:
    """A room mid-transfer, aborted at t=1 with every ABORT lost on the wire."""
    net = Net(settings=S, one_sided=one_sided, prefill_shape=shape or InstanceShape())
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)
    net.assign(ROOM, [10, 11], 0.0)
    net.pump(0.0)
    for rank, table in net.prefill.items():
        net.handle(p_endpoint(rank), table.writes_enqueued(ROOM, 1, 0.5))
    net.handle(d_endpoint(D0), net.decode[D0].abort(ROOM, "client_disconnected", 1.0))
    assert lose_aborts(net) == len(net.prefill)
    return net


def lose_aborts(net: Net) -> int:
    """Drop the ABORTs on decode's wires; how many there were."""
    lost = 0
    for (origin, _), wire in net.wires.items():
        if origin == d_endpoint(D0):
            lost += sum(isinstance(decode(f), Abort) for f in wire)
            wire.clear()
    return lost


def aborts_in(acts: list[A.Action]) -> list[str]:
    return sorted(
        a.endpoint for a in acts if isinstance(a, A.Send) and isinstance(a.message, Abort)
    )


def released(net: Net) -> list[A.ReleasePages]:
    return net.actions(d_endpoint(D0), A.ReleasePages)


def test_the_default_interval_is_a_quarter_of_the_release_timeout() -> None:
    assert RoomSettings(release_s=10.0).abort_resend_interval_s == 2.5
    assert RoomSettings(abort_resend_s=0.2).abort_resend_interval_s == 0.2
    with pytest.raises(ValueError, match="abort_resend_s"):
        RoomSettings(abort_resend_s=0.0)


def test_a_lost_abort_is_resent_until_acked_then_the_pages_are_released() -> None:
    net = failed()
    table = net.decode[D0]
    assert aborts_in(table.tick(1.0 + EVERY - 0.01)) == []  # not due yet
    net.handle(d_endpoint(D0), table.tick(1.0 + EVERY))
    assert lose_aborts(net) == 1  # sent again, and lost again
    net.handle(d_endpoint(D0), table.tick(1.0 + 2 * EVERY))
    net.pump(2.1)  # this one arrives: prefill owes an ack once its write drained
    assert released(net) == []
    net.handle(p_endpoint(P0), net.prefill[P0].writes_done(ROOM, 1, True, 2.2))
    net.pump(2.2)
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]
    assert aborts_in(table.tick(100.0)) == []  # the room is gone: nothing more is sent


def test_a_lost_ack_is_answered_again_by_the_resent_abort() -> None:
    net = failed()
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.tick(1.0 + EVERY))
    net.deliver((d_endpoint(D0), p_endpoint(P0)), 1.5)  # this ABORT arrives
    net.handle(p_endpoint(P0), net.prefill[P0].writes_done(ROOM, 1, True, 1.6))
    assert len(net.prefill[P0]) == 0  # drained and acked: prefill is done with the room
    net.wires[(p_endpoint(P0), d_endpoint(D0))].clear()  # the ack is lost
    net.pump(1.6)
    assert released(net) == []
    net.handle(d_endpoint(D0), table.tick(1.0 + 2 * EVERY))
    net.pump(2.0)
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]


def test_only_sources_that_have_not_acked_get_it_again() -> None:
    net = failed(shape=InstanceShape(tp=2))
    table = net.decode[D0]
    first, second = (p_endpoint(RankCoord(tp=tp)) for tp in (0, 1))
    net.handle(d_endpoint(D0), table.tick(1.0 + EVERY))
    net.wires[(d_endpoint(D0), second)].clear()  # the second source's copy is lost again
    net.pump(1.5)
    net.handle(first, net.prefill[RankCoord(tp=0)].writes_done(ROOM, 1, True, 1.6))
    net.pump(1.6)
    assert aborts_in(table.tick(1.0 + 2 * EVERY)) == [second]


def test_no_resend_to_a_source_declared_gone() -> None:
    net = failed()
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.2))
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "peer_dead")]
    assert aborts_in(table.tick(1.0 + 10 * EVERY)) == []


def test_a_heartbeat_verdict_keeps_resending_while_the_pages_are_held() -> None:
    # A hung peer may resume: its pages stay held, and the ABORT keeps coming.
    net = failed()
    table = net.decode[D0]
    net.handle(
        d_endpoint(D0), table.fail_peer(BOOTSTRAP, "prefill_unreachable", 1.2, definitive=False)
    )
    assert released(net) == []
    assert aborts_in(table.tick(1.0 + EVERY)) == [p_endpoint(P0)]


def test_tcp_does_not_resend_its_pages_go_at_the_release_timeout() -> None:
    net = failed(one_sided=False)
    table = net.decode[D0]
    assert aborts_in(table.tick(1.0 + EVERY)) == []
    net.handle(d_endpoint(D0), table.tick(1.0 + S.release_s))
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "release_timeout")]

"""A decode rank registering its KV layout again (prefill side, pure).

The same endpoint with the same layout is a repeat and changes nothing. The
same endpoint with another layout is a restarted decode rank: the rooms of
its previous incarnation can never finish (their pages and generations
belong to a process that is gone), so they fail with `peer_reregistered`
instead of writing into a pool laid out differently, and decode's new
rooms on that endpoint go on.
"""

from __future__ import annotations

import msgspec

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import LayoutAck, Status, decode, encode
from pdcluster.runtime.pd.settings import RoomSettings

from .sim import Net, d_endpoint, p_endpoint

D0 = P0 = RankCoord()
ROOM = 77
RID = "rid-00000077"


def started() -> Net:
    net = Net(settings=RoomSettings(bootstrap_s=5.0, waiting_s=10.0, release_s=3.0))
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)
    net.assign(ROOM, [10, 11], 0.0)
    net.pump(0.0)
    assert net.prefill[P0].state(ROOM) is KVPoll.WaitingForInput
    return net


def register(net: Net, **changed: object) -> list[A.Action]:
    layout = msgspec.structs.replace(net.decode[D0].info.layout_message(), **changed)
    return net.prefill[P0].on_message(layout, 1.0)


def test_a_repeated_identical_layout_fails_nothing() -> None:
    net = started()
    acts = register(net)
    assert net.prefill[P0].state(ROOM) is KVPoll.WaitingForInput
    assert [a for a in acts if isinstance(a, A.RoomFailed)] == []


def test_a_new_layout_on_the_same_endpoint_fails_the_old_rooms() -> None:
    net = started()
    acts = register(net, num_pages=net.decode[D0].info.num_pages * 2)
    prefill = net.prefill[P0]
    assert A.RoomFailed(ROOM, RID, "peer_reregistered") in acts
    assert A.ReleaseSource(ROOM, RID) in acts  # nothing in flight: its slot is free
    assert not prefill.can_send(ROOM)
    assert prefill.tombstone(ROOM, 1.0) == "peer_reregistered"  # a late message is refused
    # Decode hears of it (the old room's leg fails, it does not hang), and the
    # new layout is accepted for what comes next.
    sent = [a for a in acts if isinstance(a, A.Send) and a.endpoint == d_endpoint(D0)]
    statuses = [decode(encode(a.message)) for a in sent if isinstance(a.message, Status)]
    assert [(s.room, s.state, s.reason) for s in statuses] == [
        (ROOM, KVPoll.Failed, "peer_reregistered")
    ]
    acks = [a.message for a in sent if isinstance(a.message, LayoutAck)]
    assert [ack.accepted for ack in acks] == [True]
    assert acks[0].endpoint == p_endpoint(P0)

"""Each decode rank's Success carries the checksum of its own KV slice (pure).

A prefill rank may feed several decode ranks, each a different slice of its
KV (decode tp larger than prefill tp): one checksum for all would match none
of them. `finish_sending(..., checksums=...)` gives one per decode rank.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import Status
from pdcluster.runtime.pd.room_common import RoomError

from .sim import Net, d_endpoint, p_endpoint

P0 = RankCoord()
D = [RankCoord(tp=0), RankCoord(tp=1)]
ROOM = 88
RID = "rid-00000088"


def sending() -> Net:
    net = Net(decode_shape=InstanceShape(tp=2))
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)
    net.assign(ROOM, [10, 11], 0.0)
    net.pump(0.0)
    prefill = net.prefill[P0]
    net.handle(p_endpoint(P0), prefill.writes_enqueued(ROOM, 2, 0.1))
    net.handle(p_endpoint(P0), prefill.writes_done(ROOM, 2, True, 0.2))
    return net


def test_every_decode_rank_gets_its_own_checksum() -> None:
    net = sending()
    acts = net.prefill[P0].finish_sending(ROOM, 5, None, 0.3, checksums={D[0]: 111, D[1]: 222})
    sent = {
        a.endpoint: a.message
        for a in acts
        if isinstance(a, A.Send) and isinstance(a.message, Status)
    }
    assert {rank: sent[d_endpoint(rank)].checksum for rank in D} == {D[0]: 111, D[1]: 222}
    assert all(m.state is KVPoll.Success for m in sent.values())


def test_a_bad_checksum_is_refused_and_the_room_goes_on() -> None:
    net = sending()
    prefill = net.prefill[P0]
    with pytest.raises(RoomError, match="checksum"):
        prefill.finish_sending(ROOM, 5, None, 0.3, checksums={D[0]: -1})
    assert prefill.can_send(ROOM)

"""Both room tables wired together: happy paths across topologies and policies."""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import FirstLogprobs, KVLayoutRegister
from pdcluster.runtime.pd.topology import ModelShape

from .sim import Net, d_endpoint, p_endpoint

D0 = RankCoord()
ROOM = 12345
RID = "rid-00000001"


def test_early_happy_path_one_to_one() -> None:
    net = Net()
    net.open_decode(ROOM, RID, now=0.0)
    # The first room to a peer registers our layout with it, once.
    sent = net.wires[(d_endpoint(D0), p_endpoint(D0))]
    assert len(sent) == 1
    net.open_prefill(ROOM, RID, num_tokens=10, now=0.0)
    net.pump(0.0)
    assert net.prefill[D0].state(ROOM) is KVPoll.Bootstrapping
    net.assign(ROOM, [3, 4, 5], now=0.1)
    net.pump(0.1)
    assert net.actions(p_endpoint(D0), A.StartCompute) == [A.StartCompute(ROOM, RID)]
    assert net.prefill[D0].state(ROOM) is KVPoll.WaitingForInput
    net.send_all(ROOM, now=0.2, first_token=42)
    net.pump(0.2)
    done = net.actions(d_endpoint(D0), A.TransferComplete)
    assert done == [A.TransferComplete(ROOM, RID, (3, 4, 5), 42, ((D0, 1234),))]
    assert done[0].first_logprobs is None  # the request asked for none
    assert net.actions(p_endpoint(D0), A.ReleaseSource) == [A.ReleaseSource(ROOM, RID)]
    assert len(net.prefill[D0]) == 0 and len(net.decode[D0]) == 0
    assert net.actions(d_endpoint(D0), A.RoomFailed) == []


def test_the_first_tokens_logprobs_travel_with_success() -> None:
    net = Net()
    net.open_decode(ROOM, RID, now=0.0)
    net.open_prefill(ROOM, RID, num_tokens=10, now=0.0)
    net.assign(ROOM, [3, 4, 5], now=0.1)
    net.pump(0.1)
    logprobs = FirstLogprobs(-0.25, ((42, -0.25), (7, -1.5)))
    table = net.prefill[D0]
    origin = p_endpoint(D0)
    net.handle(origin, table.writes_enqueued(ROOM, 1, 0.2))
    net.handle(origin, table.writes_done(ROOM, 1, True, 0.2))
    net.handle(origin, table.finish_sending(ROOM, 42, None, 0.2, first_logprobs=logprobs))
    net.pump(0.2)
    (done,) = net.actions(d_endpoint(D0), A.TransferComplete)
    assert (done.first_token, done.first_logprobs) == (42, logprobs)


def test_metadata_before_prefill_leg_waits_for_it() -> None:
    net = Net()
    net.open_decode(ROOM, RID, 0.0)
    net.assign(ROOM, [0, 1, 2], 0.0)
    net.pump(0.0)
    # Metadata created the room, but compute waits for the request itself.
    assert net.prefill[D0].state(ROOM) is KVPoll.Bootstrapping
    assert net.actions(p_endpoint(D0), A.StartCompute) == []
    net.open_prefill(ROOM, RID, 9, 0.1)
    assert net.actions(p_endpoint(D0), A.StartCompute) == [A.StartCompute(ROOM, RID)]


def test_layout_registered_once_per_peer() -> None:
    net = Net()
    for i in range(3):
        net.open_decode(ROOM + i, f"rid-{i}", 0.0)
    frames = net.wires[(d_endpoint(D0), p_endpoint(D0))]
    layouts = [f for f in frames if b"layout" in f[:40]]
    assert len(layouts) == 1


TOPOLOGIES = [
    # prefill shape, decode shape, model
    (InstanceShape(tp=2), InstanceShape(tp=1), ModelShape(4, 4)),
    (InstanceShape(tp=1), InstanceShape(tp=2), ModelShape(4, 4)),
    (InstanceShape(tp=4), InstanceShape(tp=2), ModelShape(4, 4)),
    (InstanceShape(pp=2), InstanceShape(pp=1), ModelShape(4, 4)),
    (InstanceShape(pp=2, tp=2), InstanceShape(pp=2), ModelShape(5, 4)),
    (InstanceShape(cp=2, tp=2), InstanceShape(tp=4), ModelShape(4, 4)),
    (InstanceShape(dp=2, cp=2), InstanceShape(tp=2), ModelShape(3, 2)),
    (InstanceShape(tp=4), InstanceShape(tp=2), ModelShape(2, 1, replicated_kv=True)),
]


@pytest.mark.parametrize(("pshape", "dshape", "model"), TOPOLOGIES)
@pytest.mark.parametrize("policy", ["early", "prefill_complete"])
def test_room_succeeds_only_after_every_required_rank(
    pshape: InstanceShape, dshape: InstanceShape, model: ModelShape, policy: str
) -> None:
    net = Net(prefill_shape=pshape, decode_shape=dshape, model=model, policy=policy)
    room = 7 * pshape.dp + 1  # lands on prefill dp group 1 when dp > 1
    net.open_decode(room, RID, 0.0)
    net.open_prefill(room, RID, 11, 0.0)
    net.pump(0.0)
    group = net.prefill_group(room)
    if policy == "prefill_complete":
        for rank, table in group.items():
            net.handle(p_endpoint(rank), table.kv_computed(room, 0.1))
        net.pump(0.1)
        for rank in net.decode:
            assert net.actions(d_endpoint(rank), A.PrefillReady) == [A.PrefillReady(room)]
    net.assign(room, [9, 10, 11], 0.2)
    net.pump(0.2)
    if policy == "prefill_complete":
        assert {a.room for a in net.actions(p_endpoint(next(iter(group))), A.SendHeldKV)} == {room}
    # All but one prefill rank finish: no decode rank may complete yet.
    ranks = list(group)
    for rank in ranks[:-1]:
        t = group[rank]
        net.handle(p_endpoint(rank), t.writes_enqueued(room, 2, 0.3))
        net.handle(p_endpoint(rank), t.writes_done(room, 2, True, 0.3))
        net.handle(p_endpoint(rank), t.finish_sending(room, 5, None, 0.3))
    net.pump(0.3)
    waiting_on_last = [
        d
        for d in net.decode
        if ranks[-1] in {s.prefill_rank for s in net.topology.sources(d, ranks[-1].dp)}
    ]
    for d in waiting_on_last:
        assert net.actions(d_endpoint(d), A.TransferComplete) == []
        assert net.decode[d].state(room) in (KVPoll.WaitingForInput, KVPoll.Transferring)
    last = group[ranks[-1]]
    net.handle(p_endpoint(ranks[-1]), last.writes_enqueued(room, 1, 0.4))
    net.handle(p_endpoint(ranks[-1]), last.writes_done(room, 1, True, 0.4))
    net.handle(p_endpoint(ranks[-1]), last.finish_sending(room, 5, None, 0.4))
    net.pump(0.4)
    for d in net.decode:
        done = net.actions(d_endpoint(d), A.TransferComplete)
        assert len(done) == 1 and done[0].first_token == 5 and done[0].pages == (9, 10, 11)
        assert len(net.decode[d]) == 0
    for rank in ranks:
        assert len(net.actions(p_endpoint(rank), A.ReleaseSource)) == 1
        assert room not in net.prefill[rank]


def test_duplicate_success_from_one_rank_counts_once() -> None:
    # decode tp=1 fed by two prefill tp ranks: two Successes from the same
    # rank must not stand in for the other rank's.
    net = Net(prefill_shape=InstanceShape(tp=2))
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 4, 0.0)
    net.assign(ROOM, [1], 0.0)
    net.pump(0.0)
    p0 = RankCoord(tp=0)
    t = net.prefill[p0]
    net.handle(p_endpoint(p0), t.writes_enqueued(ROOM, 1, 0.1))
    net.handle(p_endpoint(p0), t.writes_done(ROOM, 1, True, 0.1))
    net.handle(p_endpoint(p0), t.finish_sending(ROOM, 3, None, 0.1))
    channel = (p_endpoint(p0), d_endpoint(D0))
    net.wires[channel].extend(list(net.wires[channel]))  # replay every frame twice
    net.pump(0.1)
    assert net.actions(d_endpoint(D0), A.TransferComplete) == []
    # The room is as far as its slowest source, which has not started.
    assert net.decode[D0].state(ROOM) is KVPoll.WaitingForInput


def test_layout_message_matches_rank_info() -> None:
    net = Net()
    msg = net.decode[D0].info.layout_message()
    assert isinstance(msg, KVLayoutRegister)
    assert (msg.num_pages, msg.decode_endpoint) == (64, d_endpoint(D0))
    assert (msg.layer_start, msg.layer_end, msg.head_start, msg.head_end) == (0, 4, 0, 4)

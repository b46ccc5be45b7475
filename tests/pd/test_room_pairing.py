"""The room pairs the legs; a rid binds a room only when the caller supplied it on both legs.

Another PD router (SGLang's) sends no rid, so each worker mints its own:
such a rid is local to its worker and never compared with the other leg's.
Our router sends the same rid to both legs, and then a mismatch is refused.
"""

from __future__ import annotations

import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import (
    HEADER,
    MAGIC,
    REJECT_VERSION,
    Abort,
    AbortAck,
    ProtocolError,
    TransferMeta,
    decode,
)
from pdcluster.runtime.pd.room_common import RoomLeg, RoomRejected

from .sim import BOOTSTRAP, Net, d_endpoint, p_endpoint, transfer_meta

D0 = P0 = RankCoord()
ROOM = 6183073005224885239  # a room as SGLang's router mints it


def open_decode(net: Net, room: int, rid: str, local: bool, now: float = 0.0) -> None:
    for rank, table in net.decode.items():
        table.add_room(RoomLeg(room, rid, rid_is_local=local), BOOTSTRAP, now)
        net.handle(d_endpoint(rank), table.resolve(room, net.sources(rank, room), now))


def open_prefill(net: Net, room: int, rid: str, local: bool, now: float = 0.0) -> None:
    for rank, table in net.prefill_group(room).items():
        net.handle(
            p_endpoint(rank), table.open_room(RoomLeg(room, rid, 8, rid_is_local=local), now)
        )


def run_request(net: Net, room: int, legs: tuple[tuple[str, bool], tuple[str, bool]], order: str):
    """Both legs of one request, in `order`; returns the decode rank's actions."""
    (p_rid, p_local), (d_rid, d_local) = legs
    if order == "prefill_first":
        open_prefill(net, room, p_rid, p_local)
        open_decode(net, room, d_rid, d_local)
        net.pump(0.0)
        net.assign(room, [1, 2], 0.0)
        net.pump(0.0)
    else:  # decode's metadata reaches prefill before the prefill leg does
        open_decode(net, room, d_rid, d_local)
        net.pump(0.0)
        net.assign(room, [1, 2], 0.0)
        net.pump(0.0)
        open_prefill(net, room, p_rid, p_local)
        net.pump(0.0)
    net.send_all(room, 0.0)
    net.pump(0.0)
    return net.log[d_endpoint(D0)]


PAIRING = [
    # (prefill leg rid, local?), (decode leg rid, local?), paired?
    ("caller rids equal", ("req-1", False), ("req-1", False), True),
    ("caller rids differ", ("req-1", False), ("req-2", False), False),
    ("prefill rid local", ("p-own", True), ("req-2", False), True),
    ("decode rid local", ("req-1", False), ("d-own", True), True),
    ("both rids local", ("p-own", True), ("d-own", True), True),
]


@pytest.mark.parametrize("order", ["prefill_first", "decode_first"])
@pytest.mark.parametrize(
    ("name", "prefill_leg", "decode_leg", "paired"), PAIRING, ids=[c[0] for c in PAIRING]
)
def test_legs_pair_by_room_and_caller_rids_must_agree(
    name: str,
    prefill_leg: tuple[str, bool],
    decode_leg: tuple[str, bool],
    paired: bool,
    order: str,
) -> None:
    net = Net()
    if not paired and order == "decode_first":
        # The metadata bound the room to the decode leg's caller rid first.
        open_decode(net, ROOM, *decode_leg)
        net.pump(0.0)
        net.assign(ROOM, [1, 2], 0.0)
        net.pump(0.0)
        with pytest.raises(RoomRejected, match="room_conflict|bound to rid 'req-2'") as err:
            open_prefill(net, ROOM, *prefill_leg)
        assert err.value.reason == "room_conflict"
        return
    acts = run_request(net, ROOM, (prefill_leg, decode_leg), order)
    done = [a for a in acts if isinstance(a, A.TransferComplete)]
    failed = [a for a in acts if isinstance(a, A.RoomFailed)]
    if paired:
        assert [(a.room, a.rid, a.first_token) for a in done] == [(ROOM, decode_leg[0], 7)]
        assert failed == []
        assert ROOM not in net.prefill[P0] and ROOM not in net.decode[D0]
    else:
        assert done == []
        assert len(failed) == 1 and "room_conflict" in failed[0].reason
        assert "'req-1'" in failed[0].reason and "'req-2'" in failed[0].reason


def test_a_local_rid_never_leaves_the_decode_worker() -> None:
    net = Net()
    open_decode(net, ROOM, "d-own", local=True)
    net.pump(0.0)
    d = net.decode[D0]
    sent = [a.message for a in d.assign_pages(ROOM, [1, 2], 0.0) if isinstance(a, A.Send)]
    assert [(type(m), m.rid) for m in sent] == [(TransferMeta, None)]
    sent = [a.message for a in d.abort(ROOM, "client_gone", 0.0) if isinstance(a, A.Send)]
    assert [(type(m), m.rid) for m in sent] == [(Abort, None)]


def _register(net: Net, endpoint: str, rank: RankCoord) -> None:
    """A second decode instance's rank registers its layout with prefill rank 0."""
    layout = net.decode[D0].info.layout_message()
    fields = {f: getattr(layout, f) for f in layout.__struct_fields__}
    intruder = type(layout)(**{**fields, "decode_endpoint": endpoint, "decode_rank": rank})
    (ack,) = [a.message for a in net.prefill[P0].on_message(intruder, 0.0) if isinstance(a, A.Send)]
    assert ack.accepted, ack.reason


def _waiting_local_room(net: Net) -> None:
    open_prefill(net, ROOM, "p-own", local=True)
    open_decode(net, ROOM, "d-own", local=True)
    net.pump(0.0)
    net.assign(ROOM, [1, 2], 0.0)
    net.pump(0.0)
    assert net.prefill[P0].state(ROOM) is KVPoll.WaitingForInput


def test_decode_abort_with_local_rids_fails_prefill_and_frees_decode_pages() -> None:
    net = Net()
    _waiting_local_room(net)
    d = net.decode[D0]
    net.handle(d_endpoint(D0), d.abort(ROOM, "client_gone", 0.0))
    net.pump(0.0)
    p_failed = net.actions(p_endpoint(P0), A.RoomFailed)
    assert [(a.room, a.rid, a.reason) for a in p_failed] == [
        (ROOM, "p-own", "aborted by decode: client_gone")
    ]
    # The prefill leg's engine request is released under its own (local) rid.
    assert A.ReleaseSource(ROOM, "p-own") in net.log[p_endpoint(P0)]
    released = net.actions(d_endpoint(D0), A.ReleasePages)
    assert [(a.room, a.rid, a.pages, a.reason) for a in released] == [
        (ROOM, "d-own", (1, 2), "drained")
    ]
    assert ROOM not in net.prefill[P0] and ROOM not in d
    # The abort left a tombstone: a late prefill leg for the room is refused.
    with pytest.raises(RoomRejected) as err:
        open_prefill(net, ROOM, "p-late", local=True)
    assert err.value.reason == "room_closed"


def test_an_abort_of_another_generation_does_not_touch_a_local_rid_room() -> None:
    net = Net()
    _waiting_local_room(net)
    p = net.prefill[P0]
    stale = Abort(
        room=ROOM,
        generation=net.decode[D0].generation(ROOM) + 1,
        rid=None,
        reason="old attempt",
        decode_rank=D0,
        decode_endpoint=d_endpoint(D0),
    )
    acts = p.on_message(stale, 0.0)
    assert acts == [
        A.Send(d_endpoint(D0), AbortAck(room=ROOM, rank=P0, generation=stale.generation)),
        A.Dropped(ROOM, "Abort", "foreign_abort"),
    ]
    assert p.state(ROOM) is KVPoll.WaitingForInput


@pytest.mark.parametrize("rank", [D0, RankCoord(tp=1)], ids=["bound rank", "other rank"])
def test_an_abort_from_a_sender_that_is_not_the_rooms_destination_is_foreign(
    rank: RankCoord,
) -> None:
    # The room has its one destination (decode rank 0 at its endpoint); a
    # registered rank of another decode instance aborts "the same" room.
    net = Net()
    _waiting_local_room(net)
    intruder = "tcp://127.0.0.9:8000"
    _register(net, intruder, rank)
    p = net.prefill[P0]
    foreign = Abort(
        room=ROOM,
        generation=net.decode[D0].generation(ROOM),
        rid=None,
        reason="x",
        decode_rank=rank,
        decode_endpoint=intruder,
    )
    assert A.Dropped(ROOM, "Abort", "foreign_abort") in p.on_message(foreign, 0.0)
    assert p.state(ROOM) is KVPoll.WaitingForInput


def test_an_abort_before_decode_metadata_pairs_by_room() -> None:
    net = Net()
    open_prefill(net, ROOM, "p-own", local=True)
    open_decode(net, ROOM, "d-own", local=True)
    net.pump(0.0)  # layouts registered, no metadata yet
    net.handle(d_endpoint(D0), net.decode[D0].abort(ROOM, "admission_failed", 0.0))
    net.pump(0.0)
    assert net.prefill[P0].tombstone(ROOM, 0.0) == "aborted by decode: admission_failed"
    assert ROOM not in net.decode[D0]


def test_duplicate_rooms_are_still_refused_with_local_rids() -> None:
    net = Net()
    _waiting_local_room(net)
    with pytest.raises(RoomRejected) as err:
        net.prefill[P0].open_room(RoomLeg(ROOM, "p-other", 8, rid_is_local=True), 0.0)
    assert err.value.reason == "duplicate_room"
    with pytest.raises(RoomRejected) as err:
        net.decode[D0].add_room(RoomLeg(ROOM, "d-other", rid_is_local=True), BOOTSTRAP, 0.0)
    assert err.value.reason == "duplicate_room"
    # A second endpoint for the bound decode rank (another decode instance
    # reusing the room number) is refused, and the room is unchanged.
    intruder = "tcp://127.0.0.9:8000"
    _register(net, intruder, D0)
    p = net.prefill[P0]
    (reply, dropped) = p.on_message(transfer_meta(ROOM, None, intruder, [5, 6], D0), 0.0)
    assert isinstance(reply, A.Send) and reply.endpoint == intruder
    assert "second endpoint" in (reply.message.reason or "")
    assert dropped == A.Dropped(ROOM, "claim", "room_conflict")
    (dest,) = p.destinations(ROOM)
    assert (dest.endpoint, dest.pages) == (d_endpoint(D0), (1, 2))


def test_a_version_1_frame_is_refused_not_misread() -> None:
    assert HEADER == MAGIC + bytes([5])
    with pytest.raises(ProtocolError) as err:
        decode(MAGIC + bytes([1]) + b"\x80")
    assert err.value.reason == REJECT_VERSION

"""Bad local calls raise a clear error and leave the tables exactly as they were."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.decode_rooms import DecodeRoomTable
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import Abort, AbortAck, Bootstrap, Ready, Status
from pdcluster.runtime.pd.prefill_rooms import PrefillRoomTable
from pdcluster.runtime.pd.room_common import (
    RoomError,
    RoomLeg,
    RoomRejected,
    RoomStateError,
    UnknownRoom,
)

from .sim import Net, d_endpoint, from_decode, p_endpoint

D0 = P0 = RankCoord()


def _plain(value: object) -> object:
    """Objects as nested dicts, so two snapshots compare by content."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return type(value)(_plain(v) for v in value) if not isinstance(value, set) else value
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _plain(v) for k, v in vars(value).items()}
    return value


def snapshot(table: PrefillRoomTable | DecodeRoomTable) -> object:
    return copy.deepcopy(_plain(table))


def net_with_room(state: str) -> Net:
    net = Net()
    if state == "new":
        return net
    net.open_decode(5, "rid-5", 0.0)
    net.open_prefill(5, "rid-5", 8, 0.0)
    net.pump(0.0)
    if state == "waiting":
        net.assign(5, [1, 2], 0.0)
        net.pump(0.0)
    return net


DECODE_CASES: list[tuple[str, str, Callable[[DecodeRoomTable], object], type[RoomError]]] = [
    ("new", "bad room", lambda t: t.add_room(RoomLeg(-1, "r"), "p:1", 0.0), RoomError),
    ("new", "huge room", lambda t: t.add_room(RoomLeg(1 << 63, "r"), "p:1", 0.0), RoomError),
    ("new", "empty rid", lambda t: t.add_room(RoomLeg(1, ""), "p:1", 0.0), RoomError),
    ("new", "no peer", lambda t: t.add_room(RoomLeg(1, "r"), "", 0.0), RoomError),
    ("new", "negative length", lambda t: t.add_room(RoomLeg(1, "r", -1), "p:1", 0.0), RoomError),
    ("new", "bool length", lambda t: t.add_room(RoomLeg(1, "r", True), "p:1", 0.0), RoomError),
    ("boot", "duplicate", lambda t: t.add_room(RoomLeg(5, "rid-x"), "p:1", 0.0), RoomRejected),
    ("new", "resolve unknown", lambda t: t.resolve(9, [], 0.0), UnknownRoom),
    (
        "boot",
        "resolve twice",
        lambda t: t.resolve(5, [Source(P0, "tcp://x:1", 1)], 0.0),
        RoomStateError,
    ),
    ("boot", "pages out of range", lambda t: t.assign_pages(5, [64], 0.0), RoomError),
    ("boot", "duplicate pages", lambda t: t.assign_pages(5, [1, 1], 0.0), RoomError),
    ("boot", "no pages", lambda t: t.assign_pages(5, [], 0.0), RoomError),
    ("boot", "bool page", lambda t: t.assign_pages(5, [True], 0.0), RoomError),
    ("waiting", "pages twice", lambda t: t.assign_pages(5, [3, 4], 0.0), RoomStateError),
    ("new", "abort unknown", lambda t: t.abort(9, "x", 0.0), UnknownRoom),
]


def test_decode_resolve_rejects_bad_sources() -> None:
    net = Net()
    table = net.decode[D0]
    table.add_room(RoomLeg(5, "rid"), "p:1", 0.0)
    before = snapshot(table)
    for sources in (
        [],
        [Source(P0, "tcp://x:1", 1), Source(P0, "tcp://y:1", 1)],
        [Source(P0, "", 1)],
        [Source(P0, "tcp://x:1", 0)],
    ):
        with pytest.raises(RoomError):
            table.resolve(5, sources, 0.0)
        assert snapshot(table) == before


def test_assign_before_resolve_is_refused() -> None:
    table = Net().decode[D0]
    table.add_room(RoomLeg(5, "rid"), "p:1", 0.0)
    with pytest.raises(RoomStateError, match="unresolved"):
        table.assign_pages(5, [1], 0.0)


PREFILL_CASES: list[tuple[str, str, Callable[[PrefillRoomTable], object], type[RoomError]]] = [
    ("new", "bad room", lambda t: t.open_room(RoomLeg(-5, "r", 3), 0.0), RoomError),
    ("new", "bad rid", lambda t: t.open_room(RoomLeg(5, "x" * 300, 3), 0.0), RoomError),
    ("new", "no tokens", lambda t: t.open_room(RoomLeg(5, "r", 0), 0.0), RoomError),
    ("boot", "duplicate", lambda t: t.open_room(RoomLeg(5, "rid-5", 8), 0.0), RoomRejected),
    ("boot", "write before metadata", lambda t: t.writes_enqueued(5, 1, 0.0), RoomStateError),
    ("waiting", "zero writes", lambda t: t.writes_enqueued(5, 0, 0.0), RoomError),
    ("waiting", "more done than in flight", lambda t: t.writes_done(5, 1, True, 0.0), RoomError),
    ("new", "writes for unknown", lambda t: t.writes_done(9, 1, True, 0.0), UnknownRoom),
    ("boot", "finish before metadata", lambda t: t.finish_sending(5, 1, None, 0.0), RoomStateError),
    ("waiting", "negative token", lambda t: t.finish_sending(5, -1, None, 0.0), RoomError),
    ("waiting", "kv_computed under early", lambda t: t.kv_computed(5, 0.0), RoomStateError),
    ("new", "fail unknown", lambda t: t.fail(9, "x", 0.0), UnknownRoom),
]


BAD_CALLS = [("decode", *c) for c in DECODE_CASES] + [("prefill", *c) for c in PREFILL_CASES]


@pytest.mark.parametrize(
    ("side", "state", "name", "call", "error"),
    BAD_CALLS,
    ids=[f"{c[0]}: {c[2]}" for c in BAD_CALLS],
)
def test_bad_calls_are_rejected_without_changing_state(
    side: str, state: str, name: str, call: Callable[[Any], object], error: type[RoomError]
) -> None:
    net = net_with_room(state)
    table = net.decode[D0] if side == "decode" else net.prefill[P0]
    before = snapshot(table)
    with pytest.raises(error) as err:
        call(table)
    assert str(err.value) and err.value.reason
    assert snapshot(table) == before


def test_finishing_twice_is_refused() -> None:
    net = net_with_room("waiting")
    t = net.prefill[P0]
    t.writes_enqueued(5, 1, 0.0)
    t.finish_sending(5, 1, None, 0.0)
    with pytest.raises(RoomStateError, match="finished"):
        t.finish_sending(5, 1, None, 0.0)
    with pytest.raises(RoomStateError):
        t.writes_enqueued(5, 1, 0.0)


def test_messages_in_the_wrong_direction_are_dropped() -> None:
    net = net_with_room("waiting")
    p, d = net.prefill[P0], net.decode[D0]
    status = Status(room=5, generation=1, rank=P0, state=KVPoll.Success)
    assert p.on_message(status, 0.0) == [A.Dropped(5, "Status", "wrong_direction")]
    abort = from_decode(Abort, 5, 1, "rid-5", "e", D0, reason="x")
    assert d.on_message(abort, 0.0) == [A.Dropped(5, "Abort", "wrong_direction")]
    assert p.state(5) is KVPoll.WaitingForInput and d.state(5) is KVPoll.WaitingForInput


def test_bootstrap_under_early_policy_fails_naming_both_policies() -> None:
    net = net_with_room("boot")
    p = net.prefill[P0]
    msg = from_decode(Bootstrap, 6, 3, "r6", d_endpoint(D0), D0, num_destinations=1)
    (send, dropped) = p.on_message(msg, 0.0)
    assert isinstance(send, A.Send) and isinstance(send.message, Status)
    assert (
        send.message.reason == "allocation_policy mismatch: prefill=early, decode=prefill_complete"
    )
    assert dropped == A.Dropped(6, "claim", "allocation_policy_mismatch") and 6 not in p


def test_ready_under_early_policy_fails_the_decode_room() -> None:
    net = net_with_room("boot")
    d = net.decode[D0]
    acts = d.on_message(Ready(room=5, generation=d.generation(5), rank=P0), 0.0)
    (failed,) = [a for a in acts if isinstance(a, A.RoomFailed)]
    assert failed.reason == "allocation_policy mismatch: prefill=prefill_complete, decode=early"


def test_success_before_metadata_is_a_protocol_violation() -> None:
    net = net_with_room("boot")
    d = net.decode[D0]
    status = Status(room=5, generation=d.generation(5), rank=P0, state=KVPoll.Success)
    (failed, *_) = d.on_message(status, 0.0)
    assert isinstance(failed, A.RoomFailed) and failed.reason.startswith("protocol_violation")


def test_abort_ack_for_a_live_room_is_ignored() -> None:
    net = net_with_room("waiting")
    d = net.decode[D0]
    ack = AbortAck(room=5, rank=P0, generation=d.generation(5))
    assert d.on_message(ack, 0.0) == [A.Dropped(5, "AbortAck", "room_not_failed")]


def test_foreign_abort_does_not_touch_another_requests_room() -> None:
    net = net_with_room("waiting")
    p = net.prefill[P0]
    foreign = from_decode(Abort, 5, 9, "someone-else", d_endpoint(D0), D0, reason="x")
    acts = p.on_message(foreign, 0.0)
    assert acts == [
        A.Send(d_endpoint(D0), AbortAck(room=5, rank=P0, generation=9)),
        A.Dropped(5, "Abort", "foreign_abort"),
    ]
    assert p.state(5) is KVPoll.WaitingForInput


def test_unauthenticated_abort_for_unknown_room_is_acked_without_a_tombstone() -> None:
    p = Net().prefill[P0]
    abort = Abort(
        room=77, generation=1, rid="r", reason="x", decode_rank=D0, decode_endpoint="tcp://evil:1"
    )
    assert p.on_message(abort, 0.0) == [
        A.Send("tcp://evil:1", AbortAck(room=77, rank=P0, generation=1))
    ]
    assert p.tombstone(77, 0.0) is None
    p.open_room(RoomLeg(77, "r", 4), 0.0)  # a stranger cannot block a future room


def test_prefill_endpoint_is_reported_in_views() -> None:
    net = net_with_room("waiting")
    (dest,) = net.prefill[P0].destinations(5)
    assert (dest.endpoint, dest.pages, dest.layout.token) == (d_endpoint(D0), (1, 2), "")
    assert p_endpoint(P0) in net.decode[D0].list_rooms(0.0)[0].peers


def test_snapshots_do_see_changes() -> None:
    """Guards the tests above: a valid call changes what `snapshot` sees."""
    net = net_with_room("waiting")
    p, d = net.prefill[P0], net.decode[D0]
    before_p, before_d = snapshot(p), snapshot(d)
    p.writes_enqueued(5, 1, 0.0)
    d.abort(5, "x", 0.0)
    assert snapshot(p) != before_p and snapshot(d) != before_d

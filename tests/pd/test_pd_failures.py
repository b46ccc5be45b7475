"""Both room tables wired together: cancellation, timeouts, peer loss, bad peers."""

from __future__ import annotations

import msgspec
import pytest

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import AbortAck, Status, decode, encode
from pdcluster.runtime.pd.room_common import RoomLeg, RoomRejected, UnknownRoom
from pdcluster.runtime.pd.settings import RoomSettings

from .sim import Net, compat, d_endpoint, p_endpoint, transfer_meta

D0 = RankCoord()
P0 = RankCoord()
ROOM = 99
RID = "rid-00000099"
S = RoomSettings(bootstrap_s=5.0, waiting_s=10.0, prefill_wait_s=7.0, release_s=3.0)


def started(net: Net, pages: list[int] | None = None, now: float = 0.0) -> Net:
    net.open_decode(ROOM, RID, now)
    net.open_prefill(ROOM, RID, 8, now)
    net.assign(ROOM, pages or [10, 11], now)
    net.pump(now)
    return net


def in_flight(net: Net, writes: int = 2, now: float = 0.5) -> None:
    net.handle(p_endpoint(P0), net.prefill[P0].writes_enqueued(ROOM, writes, now))
    net.pump(now)


def released(net: Net) -> list[A.ReleasePages]:
    return net.actions(d_endpoint(D0), A.ReleasePages)


def test_decode_abort_waits_for_drain_then_releases_once() -> None:
    net = started(Net(settings=S))
    in_flight(net)
    net.handle(d_endpoint(D0), net.decode[D0].abort(ROOM, "client_disconnected", 1.0))
    assert net.actions(d_endpoint(D0), A.RoomFailed) == [
        A.RoomFailed(ROOM, RID, "client_disconnected")
    ]
    net.pump(1.0)
    prefill = net.prefill[P0]
    # Prefill failed and stops enqueuing, but acks only after its writes drained.
    assert prefill.state(ROOM) is KVPoll.Failed and not prefill.can_send(ROOM)
    assert released(net) == []
    net.handle(p_endpoint(P0), prefill.writes_done(ROOM, 1, True, 1.1))
    net.pump(1.1)
    assert released(net) == []
    net.handle(p_endpoint(P0), prefill.writes_done(ROOM, 1, True, 1.2))
    net.pump(1.2)
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]
    assert net.actions(p_endpoint(P0), A.ReleaseSource) == [A.ReleaseSource(ROOM, RID)]
    # Ticking much later releases nothing twice.
    net.handle(d_endpoint(D0), net.decode[D0].tick(100.0))
    assert len(released(net)) == 1
    assert len(net.decode[D0]) == 0 and len(prefill) == 0


def test_abort_is_sent_once_per_source() -> None:
    net = started(Net(settings=S, prefill_shape=InstanceShape(tp=2)))
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.abort(ROOM, "first", 1.0))
    net.handle(d_endpoint(D0), table.abort(ROOM, "second", 1.1))
    net.handle(d_endpoint(D0), table.tick(2.0))
    for tp in (0, 1):
        frames = net.wires[(d_endpoint(D0), p_endpoint(RankCoord(tp=tp)))]
        aborts = [decode(f) for f in frames if b"abort" in f[:20]]
        assert len(aborts) == 1 and aborts[0].reason == "first"  # type: ignore[union-attr]
    assert table.failure_reason(ROOM) == "first"


def test_stale_ack_from_older_generation_releases_nothing() -> None:
    net = started(Net(settings=S))
    in_flight(net)
    table = net.decode[D0]
    generation = table.generation(ROOM)
    net.handle(d_endpoint(D0), table.abort(ROOM, "client_disconnected", 1.0))
    stale = AbortAck(room=ROOM, rank=P0, generation=generation - 1)
    acts = table.on_message(decode(encode(stale)), 1.1)
    assert acts == [A.Dropped(ROOM, "AbortAck", "stale_generation")]
    assert table.pages(ROOM) == (10, 11)
    good = AbortAck(room=ROOM, rank=P0, generation=generation)
    assert table.on_message(good, 1.2) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]


def test_tcp_releases_after_release_timeout_without_ack() -> None:
    net = started(Net(settings=S))
    in_flight(net)
    net.kill(p_endpoint(P0))  # the ack will never come
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.abort(ROOM, "client_disconnected", 1.0))
    net.handle(d_endpoint(D0), table.tick(1.0 + S.release_s - 0.01))
    assert released(net) == []
    net.handle(d_endpoint(D0), table.tick(1.0 + S.release_s))
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "release_timeout")]


def test_one_sided_never_releases_on_timeout_alone_only_on_peer_death() -> None:
    net = started(Net(settings=S, one_sided=True))
    in_flight(net)
    net.kill(p_endpoint(P0))
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.abort(ROOM, "client_disconnected", 1.0))
    net.handle(d_endpoint(D0), table.tick(10_000.0))
    assert released(net) == [] and table.pages(ROOM) == (10, 11)
    net.handle(d_endpoint(D0), table.fail_peer("127.0.0.1:8998", "prefill_unreachable", 10_001.0))
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "peer_dead")]


def test_prefill_failure_mid_transfer_fails_decode_and_frees_both_sides() -> None:
    net = started(Net(settings=S))
    in_flight(net, writes=1)
    prefill = net.prefill[P0]
    net.handle(p_endpoint(P0), prefill.writes_done(ROOM, 1, False, 1.0))
    net.pump(1.0)
    failed = net.actions(d_endpoint(D0), A.RoomFailed)
    assert len(failed) == 1 and "transfer_error" in failed[0].reason
    # Decode still aborts (prefill acks at once: nothing in flight) and then releases.
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]
    assert net.actions(p_endpoint(P0), A.ReleaseSource) == [A.ReleaseSource(ROOM, RID)]


def test_prefill_bootstrap_timeout_then_late_metadata_gets_failed() -> None:
    net = Net(settings=S)
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)
    net.pump(0.0)
    prefill = net.prefill[P0]
    net.handle(p_endpoint(P0), prefill.tick(S.bootstrap_s - 0.01))
    assert prefill.state(ROOM) is KVPoll.Bootstrapping
    net.handle(p_endpoint(P0), prefill.tick(S.bootstrap_s))
    assert net.actions(p_endpoint(P0), A.RoomFailed) == [
        A.RoomFailed(ROOM, RID, "bootstrap_timeout")
    ]
    assert ROOM not in prefill and prefill.tombstone(ROOM, S.bootstrap_s) == "bootstrap_timeout"
    # Decode admits late; the tombstone answers with Failed instead of a hang.
    net.assign(ROOM, [1, 2], S.bootstrap_s + 0.1)
    net.pump(S.bootstrap_s + 0.1)
    failed = net.actions(d_endpoint(D0), A.RoomFailed)
    assert len(failed) == 1 and "room_closed: bootstrap_timeout" in failed[0].reason
    assert released(net) == [A.ReleasePages(ROOM, RID, (1, 2), "drained")]
    # The prefill leg retried under the same room is refused, not attached.
    with pytest.raises(RoomRejected) as err:
        prefill.open_room(RoomLeg(ROOM, RID, 8), S.bootstrap_s + 0.2)
    assert err.value.reason == "room_closed"


def test_tombstone_expires_after_its_ttl() -> None:
    settings = RoomSettings(bootstrap_s=1.0, waiting_s=1.0, tombstone_s=4.0)
    net = Net(settings=settings)
    net.open_prefill(ROOM, RID, 8, 0.0)
    prefill = net.prefill[P0]
    prefill.tick(1.0)
    assert prefill.tombstone(ROOM, 4.9) == "bootstrap_timeout"
    assert prefill.tombstone(ROOM, 5.0) is None
    prefill.open_room(RoomLeg(ROOM, RID, 8), 5.0)
    assert prefill.state(ROOM) is KVPoll.Bootstrapping


def test_decode_waiting_timeout_fails_and_aborts() -> None:
    net = started(Net(settings=S), now=1.0)
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.tick(1.0 + S.waiting_s - 0.01))
    assert table.state(ROOM) is KVPoll.WaitingForInput
    net.handle(d_endpoint(D0), table.tick(1.0 + S.waiting_s))
    assert net.actions(d_endpoint(D0), A.RoomFailed) == [A.RoomFailed(ROOM, RID, "waiting_timeout")]
    net.pump(1.0 + S.waiting_s)
    prefill_failed = net.actions(p_endpoint(P0), A.RoomFailed)
    assert prefill_failed == [A.RoomFailed(ROOM, RID, "aborted by decode: waiting_timeout")]
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]


def test_decode_bootstrap_timeout_while_waiting_for_pages() -> None:
    net = Net(settings=S)
    net.open_decode(ROOM, RID, 0.0)
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.tick(S.bootstrap_s))
    assert net.actions(d_endpoint(D0), A.RoomFailed) == [
        A.RoomFailed(ROOM, RID, "bootstrap_timeout")
    ]
    # No pages were reserved: the room is gone at once, nothing to release.
    assert ROOM not in table and released(net) == []
    with pytest.raises(UnknownRoom):
        table.assign_pages(ROOM, [1], S.bootstrap_s + 1)


def test_prefill_complete_wait_for_prefill_timeout() -> None:
    net = Net(settings=S, policy="prefill_complete")
    net.open_decode(ROOM, RID, 0.0)
    table = net.decode[D0]
    net.handle(d_endpoint(D0), table.tick(S.prefill_wait_s))
    assert net.actions(d_endpoint(D0), A.RoomFailed) == [
        A.RoomFailed(ROOM, RID, "prefill_wait_timeout")
    ]


def test_heartbeat_loss_fails_unfinished_rooms_and_forgets_registration() -> None:
    net = started(Net(settings=S))
    table = net.decode[D0]
    assert table.is_registered(p_endpoint(P0))
    net.handle(d_endpoint(D0), table.fail_peer("127.0.0.1:8998", "prefill_unreachable", 2.0))
    assert net.actions(d_endpoint(D0), A.RoomFailed) == [
        A.RoomFailed(ROOM, RID, "prefill_unreachable")
    ]
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "peer_dead")]
    assert not table.is_registered(p_endpoint(P0))
    # While the peer is known dead, a new room on it fails at once.
    table.add_room(RoomLeg(ROOM + 1, "rid-1"), "127.0.0.1:8998", 3.0)
    acts = table.resolve(ROOM + 1, net.sources(D0, ROOM + 1), 3.0)
    assert acts == [A.RoomFailed(ROOM + 1, "rid-1", "prefill_unreachable")]
    assert ROOM + 1 not in table
    # Once the heartbeat reaches it again, the next room registers the layout again.
    table.peer_recovered("127.0.0.1:8998")
    table.add_room(RoomLeg(ROOM + 2, "rid-2"), "127.0.0.1:8998", 4.0)
    acts = table.resolve(ROOM + 2, net.sources(D0, ROOM + 2), 4.0)
    assert any(isinstance(a, A.Send) and b"layout" in encode(a.message)[:20] for a in acts)


def test_dead_peer_memory_expires() -> None:
    net = Net(settings=S)
    table = net.decode[D0]
    table.fail_peer(p_endpoint(P0), "peer_lost", 0.0)
    table.add_room(RoomLeg(ROOM, RID), "127.0.0.1:8998", S.bootstrap_s)
    acts = table.resolve(ROOM, net.sources(D0, ROOM), S.bootstrap_s)
    assert table.state(ROOM) is KVPoll.Bootstrapping and not any(
        isinstance(a, A.RoomFailed) for a in acts
    )


def test_claims_from_an_unregistered_endpoint_make_decode_register_again() -> None:
    net = started(Net(settings=S))
    prefill, table = net.prefill[P0], net.decode[D0]
    # The operator wrongly declared the decode pod dead: prefill forgot its layout.
    net.handle(p_endpoint(P0), prefill.fail_peer(d_endpoint(D0), "peer_lost", 1.0))
    net.pump(1.0)
    net.log.clear()
    table.add_room(RoomLeg(ROOM + 1, "rid-1"), "127.0.0.1:8998", 2.0)
    net.handle(d_endpoint(D0), table.resolve(ROOM + 1, net.sources(D0, ROOM + 1), 2.0))
    net.handle(d_endpoint(D0), table.assign_pages(ROOM + 1, [20, 21], 2.0))
    net.pump(2.0)
    # Both the new room and the one prefill silently dropped fail loudly...
    failed = net.actions(d_endpoint(D0), A.RoomFailed)
    assert {f.room for f in failed} == {ROOM, ROOM + 1}
    assert all(f.reason.startswith("unregistered_peer") for f in failed)
    # ...nothing of theirs is in flight on prefill, so the aborts are acked and pages return.
    assert {(r.room, r.pages) for r in released(net)} == {(ROOM, (10, 11)), (ROOM + 1, (20, 21))}
    assert not table.is_registered(p_endpoint(P0))


def test_operator_fast_path_by_pod_ip_on_prefill_side() -> None:
    net = started(Net(settings=S))
    in_flight(net)
    prefill = net.prefill[P0]
    acts = prefill.fail_peer("127.0.0.2", "peer_lost", 1.0)
    assert A.RoomFailed(ROOM, RID, "peer_lost") in acts
    # Writes to a dead peer never drain by themselves: cancel them now, and
    # close its connection, which releases the frames queued to it.
    assert A.CancelWrites(ROOM) in acts
    assert acts.count(A.CloseDestination(d_endpoint(D0))) == 1
    acts = prefill.writes_done(ROOM, 2, False, 1.1)
    assert acts == [A.ReleaseSource(ROOM, RID)]
    assert len(prefill) == 0 and len(prefill.peers) == 0


def test_a_lost_decode_with_nothing_in_flight_keeps_its_connection() -> None:
    net = started(Net(settings=S))
    acts = net.prefill[P0].fail_peer("127.0.0.2", "peer_lost", 1.0)
    assert A.RoomFailed(ROOM, RID, "peer_lost") in acts
    assert not [a for a in acts if isinstance(a, A.CloseDestination)]


def test_prefill_undrained_failed_room_gets_cancel_writes_after_release_timeout() -> None:
    net = started(Net(settings=S))
    in_flight(net)
    prefill = net.prefill[P0]
    net.handle(p_endpoint(P0), prefill.fail(ROOM, "engine_error", 1.0))
    assert net.prefill[P0].tick(1.0 + S.release_s - 0.01) == []
    assert prefill.tick(1.0 + S.release_s) == [A.CancelWrites(ROOM)]
    assert prefill.tick(1.0 + 2 * S.release_s) == []


def test_wrong_token_is_refused_and_unregistered_metadata_dropped() -> None:
    net = Net(settings=S, decode_token="wrong")
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)
    net.assign(ROOM, [1, 2], 0.0)
    net.pump(0.0)
    failed = net.actions(d_endpoint(D0), A.RoomFailed)
    assert len(failed) == 1 and failed[0].reason.startswith("unauthorized")
    dropped = net.actions(p_endpoint(P0), A.Dropped)
    assert A.Dropped(ROOM, "TransferMeta", "unregistered_peer") in dropped
    assert len(net.prefill[P0].peers) == 0
    assert net.prefill[P0].state(ROOM) is KVPoll.Bootstrapping  # untouched by the intruder


@pytest.mark.parametrize(
    ("field", "prefill_value", "decode_value"),
    [
        ("page_size", 4, 8),
        ("kv_dtype", "float32", "bfloat16"),
        ("kv_layout", "NHD", "HND"),
        ("model_fingerprint", "tiny-0", "tiny-1"),
    ],
)
def test_compat_mismatch_fails_room_naming_field_and_both_values(
    field: str, prefill_value: object, decode_value: object
) -> None:
    net = Net(settings=S)
    d = net.decode[D0]
    d.info = type(d.info)(**{**d.info.__dict__, "compat": compat(**{field: decode_value})})
    d._layout = d.info.layout_message()
    net.open_decode(ROOM, RID, 0.0)
    net.pump(0.0)
    failed = net.actions(d_endpoint(D0), A.RoomFailed)
    assert failed == [
        A.RoomFailed(ROOM, RID, f"{field} mismatch: prefill={prefill_value}, decode={decode_value}")
    ]
    assert net.prefill[P0].peers.get(d_endpoint(D0)) is None


def test_allocation_policy_mismatch_names_both_policies() -> None:
    net = Net(settings=S, policy="early", decode_policy="prefill_complete")
    net.open_decode(ROOM, RID, 0.0)
    net.pump(0.0)
    (failed,) = net.actions(d_endpoint(D0), A.RoomFailed)
    assert "allocation_policy mismatch: prefill=early, decode=prefill_complete" in failed.reason


def test_status_from_unknown_source_and_old_generation_are_dropped() -> None:
    net = started(Net(settings=S))
    table = net.decode[D0]
    gen = table.generation(ROOM)
    stranger = Status(room=ROOM, generation=gen, rank=RankCoord(tp=3), state=KVPoll.Success)
    old = Status(room=ROOM, generation=gen + 1, rank=P0, state=KVPoll.Failed, reason="x")
    unknown = Status(room=ROOM + 5, generation=gen, rank=P0, state=KVPoll.Success)
    assert table.on_message(stranger, 1.0) == [A.Dropped(ROOM, "Status", "unknown_source")]
    assert table.on_message(old, 1.0) == [A.Dropped(ROOM, "Status", "stale_generation")]
    assert table.on_message(unknown, 1.0) == [A.Dropped(ROOM + 5, "Status", "unknown_room")]
    assert table.state(ROOM) is KVPoll.WaitingForInput


@pytest.mark.parametrize("failed_first", [False, True], ids=["live", "failed"])
@pytest.mark.parametrize("kind", ["status", "ack"])
def test_a_source_message_from_another_connection_is_dropped(kind: str, failed_first: bool) -> None:
    """Status and AbortAck name their source by rank; only that source's endpoint
    may send them (a peer with the token proves itself, not another rank)."""
    net = started(Net(settings=S))
    table = net.decode[D0]
    gen = table.generation(ROOM)
    if failed_first:
        net.handle(d_endpoint(D0), table.abort(ROOM, "client_disconnected", 1.0))
    forged: Status | AbortAck = (
        Status(room=ROOM, generation=gen, rank=P0, state=KVPoll.Success, first_token=3)
        if kind == "status"
        else AbortAck(room=ROOM, rank=P0, generation=gen)
    )
    name = type(forged).__name__
    assert table.on_message(forged, 1.0, "tcp://10.9.9.9:1") == [
        A.Dropped(ROOM, name, "wrong_sender")
    ]
    assert table.state(ROOM) is (KVPoll.Failed if failed_first else KVPoll.WaitingForInput)
    assert ROOM in table  # nothing concluded, no page released
    if failed_first and kind == "ack":
        # From the source's own connection the same ack releases the pages.
        assert table.on_message(forged, 1.0, p_endpoint(P0)) == [
            A.ReleasePages(ROOM, RID, (10, 11), "drained")
        ]


def test_second_endpoint_for_one_decode_rank_is_refused() -> None:
    net = started(Net(settings=S))
    intruder = "tcp://127.0.0.9:9999"
    layout = msgspec.structs.replace(net.decode[D0].info.layout_message(), decode_endpoint=intruder)
    prefill = net.prefill[P0]
    prefill.on_message(layout, 1.0)
    acts = prefill.on_message(transfer_meta(ROOM, RID, intruder, [30, 31], D0), 1.0)
    send = acts[0]
    assert isinstance(send, A.Send) and send.endpoint == intruder
    assert isinstance(send.message, Status) and send.message.state is KVPoll.Failed
    assert "second endpoint" in (send.message.reason or "")
    # The original room is untouched and still writes to the first endpoint.
    assert [d.endpoint for d in prefill.destinations(ROOM)] == [d_endpoint(D0)]
    assert prefill.destinations(ROOM)[0].pages == (10, 11)


def test_duplicate_rooms_are_refused_on_both_sides() -> None:
    net = started(Net(settings=S))
    with pytest.raises(RoomRejected) as err:
        net.decode[D0].add_room(RoomLeg(ROOM, "rid-other"), "127.0.0.1:8998", 1.0)
    assert err.value.reason == "duplicate_room"
    with pytest.raises(RoomRejected) as err:
        net.prefill[P0].open_room(RoomLeg(ROOM, "rid-other", 8), 1.0)
    assert err.value.reason == "duplicate_room"
    assert net.decode[D0].state(ROOM) is KVPoll.WaitingForInput


def test_bad_pages_are_refused_with_a_reason() -> None:
    net = Net(settings=S)
    net.open_decode(ROOM, RID, 0.0)
    net.open_prefill(ROOM, RID, 8, 0.0)  # needs 2 pages of 4 tokens
    net.assign(ROOM, [5], 0.0)
    net.pump(0.0)
    (failed,) = net.actions(d_endpoint(D0), A.RoomFailed)
    assert failed.reason.endswith(
        "bad_page_count: decode rank dp0/cp0/tp0/pp0 sent 1 pages, the prompt of 8 tokens needs 2"
    )


def test_first_token_disagreement_fails_the_room() -> None:
    net = started(Net(settings=S, prefill_shape=InstanceShape(tp=2)))
    for tp, token in ((0, 5), (1, 6)):
        rank = RankCoord(tp=tp)
        t = net.prefill[rank]
        net.handle(p_endpoint(rank), t.writes_enqueued(ROOM, 1, 1.0))
        net.handle(p_endpoint(rank), t.writes_done(ROOM, 1, True, 1.0))
        net.handle(p_endpoint(rank), t.finish_sending(ROOM, token, None, 1.0))
    net.pump(1.0)
    (failed,) = net.actions(d_endpoint(D0), A.RoomFailed)
    assert failed.reason == "first_token_mismatch: sources sent [5, 6]"
    assert net.actions(d_endpoint(D0), A.TransferComplete) == []
    assert released(net) == [A.ReleasePages(ROOM, RID, (10, 11), "drained")]


def test_list_rooms_shows_state_age_and_peer() -> None:
    net = started(Net(settings=S), now=10.0)
    (view,) = net.decode[D0].list_rooms(12.5)
    assert (view.room, view.rid, view.state, view.age_s) == (ROOM, RID, "WaitingForInput", 2.5)
    assert view.peers[0] == "127.0.0.1:8998" and p_endpoint(P0) in view.peers
    (pview,) = net.prefill[P0].list_rooms(11.0)
    assert (pview.state, pview.age_s, pview.peers) == ("WaitingForInput", 1.0, (d_endpoint(D0),))

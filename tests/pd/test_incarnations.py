"""A loss report names which start of a peer it is about (runtime/pd/incarnations.py).

After a pod's IP is reused, its successor serves the same address (the same
ports, even): a late report about the old pod must fail nothing of the
successor's. Decode judges a report by the incarnations it saw in /route
answers; prefill by those decode ranks registered their layouts with.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.incarnations import Incarnations, ReportScope, covers
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.room_common import RoomLeg
from pdcluster.runtime.pd.settings import RoomSettings

from .sim import BOOTSTRAP, Net, d_endpoint, p_endpoint, transfer_meta

P0, D0 = RankCoord(), RankCoord()
OLD, NEW = "uid-old-leader", "uid-new-leader"
S = RoomSettings(bootstrap_s=5.0, waiting_s=10.0, release_s=3.0)
CUR, STALE, UNSEEN = ReportScope.CURRENT, ReportScope.STALE, ReportScope.UNSEEN


# ------------------------------------------------------------------ the table itself


def test_a_report_is_judged_by_what_the_address_serves_now() -> None:
    seen = Incarnations()
    seen.saw("10.0.0.1:8998", OLD)
    seen.saw("tcp://10.0.0.1:7000", OLD)
    assert seen.scope("10.0.0.1:8998", OLD) is CUR
    assert seen.scope("10.0.0.1", OLD) is CUR  # a bare host covers its addresses
    assert seen.scope("10.0.0.1:8998", "uid-never-here") is UNSEEN
    assert seen.scope("10.0.0.1:8998", None) is CUR  # no incarnation: whatever serves there
    seen.saw("10.0.0.1:8998", NEW)  # the IP went to a successor
    assert seen.scope("10.0.0.1:8998", OLD) is STALE
    assert seen.scope("10.0.0.1:8998", NEW) is CUR
    assert seen.current("10.0.0.1:8998") == NEW
    seen.saw("10.0.0.1:8998", None)  # an answer that names none changes nothing
    assert seen.current("10.0.0.1:8998") == NEW


@pytest.mark.parametrize(
    ("scope", "reported", "bound", "covered"),
    [
        (CUR, None, "x", True),
        (CUR, "x", "x", True),
        (CUR, "x", None, True),  # not resolved yet: it would resolve against the current one
        (CUR, "x", "y", False),
        (STALE, "x", "x", True),
        (STALE, "x", None, False),
        (STALE, "x", "y", False),
    ],
)
def test_what_a_report_covers(
    scope: ReportScope, reported: str | None, bound: str | None, covered: bool
) -> None:
    assert covers(scope, reported, bound) is covered


def test_the_oldest_incarnations_are_forgotten_first() -> None:
    seen = Incarnations(max_seen=2)
    for i in range(3):
        seen.saw(f"10.0.0.{i}:8998", f"uid-{i}")
    assert not seen.has_seen("uid-0") and seen.has_seen("uid-2")
    assert seen.scope("10.0.0.0:8998", "uid-0") is UNSEEN
    with pytest.raises(ValueError, match="max_seen"):
        Incarnations(max_seen=0)


@given(st.lists(st.tuples(st.sampled_from(["a:1", "b:1", "tcp://a:2"]), st.sampled_from("xyz"))))
def test_the_current_incarnation_of_an_address_is_the_last_seen_there(
    sightings: list[tuple[str, str]],
) -> None:
    seen = Incarnations()
    for address, incarnation in sightings:
        seen.saw(address, incarnation)
    for address in ("a:1", "b:1", "tcp://a:2"):
        last = [inc for a, inc in sightings if a == address]
        assert seen.current(address) == (last[-1] if last else None)
        if last:
            assert seen.scope(address, last[-1]) is CUR


# ------------------------------------------------------------------ decode's room table


def resolved(net: Net, room: int, incarnation: str | None, now: float = 0.0) -> None:
    """Decode opens `room` on the instance and resolves it against `incarnation`."""
    table = net.decode[D0]
    table.add_room(RoomLeg(room, f"rid-{room}"), BOOTSTRAP, now)
    source = Source(P0, p_endpoint(P0), 1, incarnation)
    net.handle(d_endpoint(D0), table.resolve(room, [source], now, incarnation))
    net.handle(d_endpoint(D0), table.assign_pages(room, [room % 50, room % 50 + 50], now))


def test_a_late_report_about_the_old_pod_fails_nothing_of_its_successor() -> None:
    net = Net(settings=S, one_sided=True)
    table = net.decode[D0]
    resolved(net, 1, OLD)
    # The old leader is gone; its IP now serves a successor, which decode uses.
    resolved(net, 2, NEW)
    acts = table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.0, incarnation=OLD)
    assert [a.room for a in acts if isinstance(a, A.RoomFailed)] == [1]
    assert table.state(2) is KVPoll.WaitingForInput
    # No verdict on the address: a new room on the successor proceeds.
    table.add_room(RoomLeg(3, "rid-3"), BOOTSTRAP, 1.1)
    assert table.gate_new_room(3, 1.1).proceed
    # About the successor itself: its rooms fail, and new ones are refused.
    acts = table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.2, incarnation=NEW)
    assert {a.room for a in acts if isinstance(a, A.RoomFailed)} == {2, 3}
    table.add_room(RoomLeg(4, "rid-4"), BOOTSTRAP, 1.3)
    assert table.gate_new_room(4, 1.3).actions


def test_a_report_about_an_incarnation_never_seen_changes_nothing() -> None:
    net = Net(settings=S, one_sided=True)
    table = net.decode[D0]
    resolved(net, 1, NEW)
    acts = table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.0, incarnation="uid-before-restart")
    assert acts == [A.Dropped(None, "fail_peer", "unseen_incarnation")]
    assert table.state(1) is KVPoll.WaitingForInput
    assert table.peers_down(1.0) == {}


def test_without_an_incarnation_a_report_means_whatever_serves_there() -> None:
    net = Net(settings=S)
    table = net.decode[D0]
    resolved(net, 1, OLD)
    resolved(net, 2, None)
    acts = table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.0)
    assert {a.room for a in acts if isinstance(a, A.RoomFailed)} == {1, 2}


def test_a_rank_report_settles_only_that_ranks_sources_of_its_incarnation() -> None:
    """Pod k > 0 of a prefill instance is gone: its ranks' sources are dead, while
    the instance-wide report (`gone: false`) keeps the surviving writers' pages."""
    net = Net(settings=S, one_sided=True)
    table = net.decode[D0]
    resolved(net, 1, OLD)
    net.handle(
        d_endpoint(D0),
        table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 1.0, definitive=False, incarnation=OLD),
    )
    assert table.state(1) is KVPoll.Failed
    assert net.actions(d_endpoint(D0), A.ReleasePages) == []  # the writer may still write
    # The pod hosting that rank is gone (its host, its own uid).
    host = "127.0.0.1"
    acts = table.fail_peer(host, "prefill_pod_lost", 1.1, incarnation=OLD)
    assert [a.room for a in acts if isinstance(a, A.ReleasePages)] == [1]


# ------------------------------------------------------------------ prefill's room table


def test_prefill_keeps_the_rooms_of_a_decode_pods_successor_at_the_same_address() -> None:
    """A decode pod's report names its own IP and uid: a late one about the old pod
    fails only the rooms still writing to it, and keeps the successor's layout."""
    net = Net(settings=S)
    prefill, layout = net.prefill[P0], net.decode[D0].info.layout_message()
    endpoint = d_endpoint(D0)

    def register(incarnation: str) -> None:
        prefill.on_message(msgspec.structs.replace(layout, incarnation=incarnation), 0.0)

    register(OLD)
    prefill.on_message(transfer_meta(1, "rid-1", endpoint, [1, 2]), 0.0)
    register(NEW)  # the IP (and port) went to a successor, which registers again
    assert 1 not in prefill  # a new layout ends the old one's rooms (nothing in flight)
    prefill.on_message(transfer_meta(2, "rid-2", endpoint, [3, 4]), 0.0)
    host = "127.0.0.2"
    assert prefill.fail_peer(host, "decode_pod_lost", 1.0, "uid-never-here") == [
        A.Dropped(None, "fail_peer", "unseen_incarnation")
    ]
    assert prefill.fail_peer(host, "decode_pod_lost", 1.0, OLD) == []
    assert not prefill._rooms[2].dests[D0].dead
    assert prefill.state(2) is not KVPoll.Failed
    assert prefill.peers.get(endpoint) is not None  # the successor stays registered
    acts = prefill.fail_peer(host, "decode_pod_lost", 1.1, NEW)
    assert [a.room for a in acts if isinstance(a, A.RoomFailed)] == [2]
    assert prefill.peers.get(endpoint) is None

"""A new room for a prefill declared dead: refused, or held for one probe.

Without this a room opened just after a heartbeat verdict (or the
operator's report) fetched /route from the dead server, retried, and failed
seconds later with a different reason. An operator report (the pod is gone)
fails new rooms at once; a heartbeat verdict only says the peer stopped
answering a while ago, so a new room waits for one probe: it proceeds if
the peer answers (a resumed or restarted process), fails if not.
Table-driven over who declared the peer dead, how the room names it, how
long ago, whether it came back; then a model-based check of held rooms.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.decode_rooms import DecodeRoomTable
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.incarnations import ReportScope
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.peer_liveness import (
    DeclareUnreachable,
    FailHeldRooms,
    FailPeerRooms,
    HeartbeatTracker,
    LivenessAction,
    PeerLiveness,
    ResumeHeld,
    StartProbe,
)
from pdcluster.runtime.pd.room_common import RoomLeg, UnknownRoom
from pdcluster.runtime.pd.settings import RoomSettings
from tests.pd.sim import BOOTSTRAP, Net

S = RoomSettings(bootstrap_s=6.0, waiting_s=10.0, release_s=3.0)
OTHER = "127.0.0.9:8998"
HELD = "held"  # Case.expect: the room waits for a probe


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
    expect: str | None  # HELD, the room's failure reason, or None: it goes on to /route


CASES = [
    Case("heartbeat, at once", BOOTSTRAP, "prefill_unreachable", True, BOOTSTRAP, 0.0, False,
         HELD),
    Case("heartbeat, long after bootstrap_s", BOOTSTRAP, "prefill_unreachable", True, BOOTSTRAP,
         10 * S.bootstrap_s, False, HELD),
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
        assert table.peer_recovered(case.declared) == []
    now = 100.0 + case.after_s
    table.add_room(RoomLeg(7, "rid-7"), case.room_peer, now)
    gate = table.gate_new_room(7, now)
    if case.expect is None:
        assert gate.proceed and table.state(7) is KVPoll.Bootstrapping
        assert not table.is_held(7)
        assert table.peer_verdict(case.room_peer, now) is None
    elif case.expect == HELD:
        # Nothing sent, nothing failed: the room waits for one probe of its prefill.
        assert gate.actions == [] and gate.probe == case.room_peer and not gate.proceed
        assert table.is_held(7) and table.state(7) is KVPoll.Bootstrapping
        assert table.gate_new_room(7, now).probe == case.room_peer  # asking again changes nothing
        assert table.peer_verdict(case.room_peer, now) == case.reason
    else:
        # Failed and gone at once: nothing was sent, no pages were held.
        assert gate.actions == [A.RoomFailed(7, "rid-7", case.expect)] and gate.probe is None
        assert 7 not in table
        assert table.peer_verdict(case.room_peer, now) == case.expect


def held_table(rooms: list[int]) -> DecodeRoomTable:
    table = decode_table()
    table.fail_peer(BOOTSTRAP, "prefill_unreachable", 100.0, until_recovered=True)
    for room in rooms:
        table.add_room(RoomLeg(room, f"rid-{room}"), BOOTSTRAP, 101.0)
        assert table.gate_new_room(room, 101.0).probe == BOOTSTRAP
    table.add_room(RoomLeg(99, "rid-99"), OTHER, 101.0)
    assert table.gate_new_room(99, 101.0).proceed
    return table


@pytest.mark.parametrize("rooms", [[7], [9, 3, 5]])
def test_probe_answers_releases_every_held_room_to_fetch_route(rooms: list[int]) -> None:
    table = held_table(rooms)
    assert table.peer_recovered(BOOTSTRAP) == sorted(rooms)
    assert table.peers_down(102.0) == {}
    for room in rooms:
        assert not table.is_held(room) and table.state(room) is KVPoll.Bootstrapping
        # Released: it resolves like any room (layout registration, then pages).
        acts = table.resolve(room, [Source(0, "127.0.0.1:9100", 1)], 102.0)
        assert table.state(room) is KVPoll.Bootstrapping and room in table
        assert all(isinstance(a, A.Send) for a in acts)
    assert table.peer_recovered(BOOTSTRAP) == []  # nothing left to release


@pytest.mark.parametrize("rooms", [[7], [9, 3, 5]])
def test_probe_fails_the_held_rooms_with_the_verdict(rooms: list[int]) -> None:
    table = held_table(rooms)
    acts = table.probe_failed(BOOTSTRAP, 101.5)
    assert acts == [A.RoomFailed(r, f"rid-{r}", "prefill_unreachable") for r in sorted(rooms)]
    assert all(r not in table for r in rooms)
    assert 99 in table and table.state(99) is KVPoll.Bootstrapping  # other instance untouched
    assert table.probe_failed(BOOTSTRAP, 101.6) == []  # once
    assert table.peers_down(101.6) == {BOOTSTRAP: "prefill_unreachable"}


def test_a_held_room_aborted_or_timed_out_is_no_longer_held() -> None:
    table = held_table([1, 2])
    assert table.abort(1, "client_disconnected", 101.2) == [
        A.RoomFailed(1, "rid-1", "client_disconnected")
    ]
    # No probe answer ever came: the room's own deadline still ends it.
    assert A.RoomFailed(2, "rid-2", "bootstrap_timeout") in table.tick(101.0 + S.bootstrap_s)
    assert not table.is_held(1) and not table.is_held(2)
    assert table.peer_recovered(BOOTSTRAP) == [] and table.probe_failed(BOOTSTRAP, 200.0) == []


def test_operator_report_gone_fails_held_rooms_and_refuses_new_ones() -> None:
    table = held_table([4])
    acts = table.fail_peer(BOOTSTRAP, "prefill_pod_lost", 102.0)
    assert acts == [A.RoomFailed(4, "rid-4", "prefill_pod_lost")]
    # peers_down keeps the first verdict's reason, and so do rooms it refuses.
    table.add_room(RoomLeg(5, "rid-5"), BOOTSTRAP, 103.0)
    gate = table.gate_new_room(5, 103.0)
    assert gate.actions == [A.RoomFailed(5, "rid-5", "prefill_unreachable")]
    assert gate.probe is None
    # Once the report's own limit passed, the heartbeat verdict holds new rooms again.
    table.add_room(RoomLeg(6, "rid-6"), BOOTSTRAP, 102.0 + S.bootstrap_s)
    assert table.gate_new_room(6, 102.0 + S.bootstrap_s).probe == BOOTSTRAP


def test_bad_room_is_refused_and_changes_nothing() -> None:
    table = held_table([1])
    with pytest.raises(UnknownRoom):
        table.gate_new_room(42, 101.0)
    assert table.is_held(1) and len(table) == 2


def test_a_second_verdict_keeps_the_first_reason_and_the_longer_limit() -> None:
    table = decode_table()
    table.fail_peer(BOOTSTRAP, "prefill_unreachable", 0.0, until_recovered=True)
    table.fail_peer(BOOTSTRAP, "pod_deleted", 1.0)  # operator, bounded: must not shorten it
    assert table.peers_down(100.0) == {BOOTSTRAP: "prefill_unreachable"}
    assert table.peer_recovered(BOOTSTRAP) == []
    assert table.peers_down(100.0) == {}


def test_an_expired_verdict_does_not_lend_its_reason() -> None:
    table = decode_table()
    table.fail_peer(BOOTSTRAP, "pod_deleted", 0.0)
    table.fail_peer(BOOTSTRAP, "prefill_unreachable", S.bootstrap_s + 1, until_recovered=True)
    assert table.peer_verdict(BOOTSTRAP, 1000.0) == "prefill_unreachable"


PEERS = (BOOTSTRAP, OTHER)
OPS = st.one_of(
    st.tuples(st.just("open"), st.sampled_from(PEERS)),
    st.tuples(st.just("heartbeat_dead"), st.sampled_from(PEERS)),
    st.tuples(st.just("gone"), st.sampled_from(PEERS)),
    st.tuples(st.just("probe"), st.sampled_from(PEERS), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@given(ops=st.lists(OPS, max_size=40))
def test_held_rooms_follow_the_verdicts_and_probes(ops: list[tuple[object, ...]]) -> None:
    """Model check: a new room proceeds, is held or is refused exactly as the
    verdicts say; a probe answer settles every room held on that peer, and
    only those; a peer's own failure ends its rooms whatever their state."""
    table = decode_table()
    hb_dead = {p: False for p in PEERS}
    gone = {p: False for p in PEERS}  # within the report's bootstrap_s: never expires here
    state: dict[int, tuple[str, str]] = {}  # room -> (peer, "held" | "open")
    now, next_room = 0.0, 0
    for op in ops:
        now += 0.01
        kind = op[0]
        if kind == "open":
            peer = str(op[1])
            room, next_room = next_room, next_room + 1
            table.add_room(RoomLeg(room, f"rid-{room}"), peer, now)
            gate = table.gate_new_room(room, now)
            if gone[peer]:
                assert gate.actions and gate.probe is None and room not in table
            elif hb_dead[peer]:
                assert gate.probe == peer and not gate.actions
                state[room] = (peer, "held")
            else:
                assert gate.proceed
                state[room] = (peer, "open")
        elif kind in ("heartbeat_dead", "gone"):
            peer = str(op[1])
            heartbeat = kind == "heartbeat_dead"
            acts = table.fail_peer(peer, "x", now, definitive=not heartbeat,
                                   until_recovered=heartbeat)  # fmt: skip
            ended = sorted(r for r, (p, _) in state.items() if p == peer)
            assert [a.room for a in acts if isinstance(a, A.RoomFailed)] == ended
            state = {r: v for r, v in state.items() if r not in ended}
            hb_dead[peer] = hb_dead[peer] or heartbeat
            gone[peer] = gone[peer] or not heartbeat
        elif kind == "probe":
            peer, ok = str(op[1]), bool(op[2])
            held = sorted(r for r, (p, s) in state.items() if p == peer and s == "held")
            if ok:
                assert table.peer_recovered(peer) == held
                state.update({r: (peer, "open") for r in held})
                hb_dead[peer] = gone[peer] = False
            else:
                acts = table.probe_failed(peer, now)
                assert [a.room for a in acts if isinstance(a, A.RoomFailed)] == held
                state = {r: v for r, v in state.items() if r not in held}
        else:
            room = int(str(op[1]))
            if room in state:
                table.abort(room, "client_disconnected", now)
                del state[room]
        for room in range(next_room):
            assert (room in table) == (room in state)
            assert table.is_held(room) == (state.get(room, ("", ""))[1] == "held")
            if room in state:
                assert table.state(room) is KVPoll.Bootstrapping


# ------------------------------------------------------------ restarted at the same address
#
# The decode rank as its agent glues them: peer liveness decides when a
# verdict ends, the room table gates rooms on it. A definitive report on a
# prefill ends before bootstrap_s only once a probe, sent after the report,
# finds another start answering at the address (a restart in place: same IP
# and ports, a new process); the old process answering (a zombie) never ends it.

OLD_START, NEW_START = "start-1", "start-2"
POD = "pod-uid-1"  # the prefill pod's incarnation (kept by a container restart)


class DecodeRank:
    def __init__(self) -> None:
        self.table = decode_table()
        self.liveness = PeerLiveness(
            HeartbeatTracker(interval_s=1.0, failure_threshold=2),
            bootstrap_s=S.bootstrap_s,
            one_sided=False,
        )
        self.resumed: list[int] = []

    def act(self, acts: list[LivenessAction], now: float) -> None:
        for act in acts:
            if isinstance(act, DeclareUnreachable):
                self.act(
                    self.liveness.lost(
                        act.peer, "prefill_unreachable", now, definitive=False,
                        until_recovered=True,
                    ),
                    now,
                )  # fmt: skip
            elif isinstance(act, FailHeldRooms):
                self.table.probe_failed(act.peer, now)
            elif isinstance(act, FailPeerRooms):
                self.table.fail_peer(
                    act.peer,
                    act.reason,
                    now,
                    definitive=act.definitive,
                    until_recovered=act.until_recovered,
                    incarnation=act.incarnation,
                )
            elif isinstance(act, ResumeHeld):
                self.resumed += [r for p in act.peers for r in self.table.peer_recovered(p)]

    def probe(self, start: str | None, now: float, ok: bool = True) -> None:
        """The next probe of BOOTSTRAP starts at `now` and answers as `start`."""
        self.liveness.hold(BOOTSTRAP, now)
        acts = self.liveness.tick(now, {BOOTSTRAP})
        assert any(isinstance(a, StartProbe) for a in acts), "no probe due yet"
        self.act(acts, now)
        self.act(self.liveness.on_probe(BOOTSTRAP, ok, now + 0.01, start), now + 0.01)

    def report(self, now: float, incarnation: str | None = None) -> None:
        """The operator's `fail_peer` (gone) as the agent takes it."""
        if self.table.report_scope(BOOTSTRAP, incarnation) is ReportScope.CURRENT:
            acts = self.liveness.lost(
                BOOTSTRAP, "prefill_pod_lost", now, definitive=True, incarnation=incarnation
            )
            self.act(acts, now)
        else:
            self.table.fail_peer(
                BOOTSTRAP, "prefill_pod_lost", now, definitive=True, incarnation=incarnation
            )

    def open(self, room: int, now: float) -> str:
        """A new room on BOOTSTRAP: "proceed", "held" or its failure reason."""
        self.table.add_room(RoomLeg(room, f"rid-{room}"), BOOTSTRAP, now)
        self.liveness.watch(BOOTSTRAP, now)
        gate = self.table.gate_new_room(room, now)
        if gate.actions:
            return next(a.reason for a in gate.actions if isinstance(a, A.RoomFailed))
        return "held" if gate.probe is not None else "proceed"


def serving(start: str, incarnation: str | None = None) -> DecodeRank:
    """A rank that used BOOTSTRAP (serving `start`) and resolved a room on it."""
    rank = DecodeRank()
    assert rank.open(1, 0.0) == "proceed"
    rank.table.resolve(1, [Source(0, "127.0.0.1:9100", 1, incarnation)], 0.0, incarnation)
    rank.probe(start, 0.0)
    return rank


def test_a_restart_in_place_is_used_as_soon_as_a_probe_sees_its_new_start() -> None:
    rank = serving(OLD_START, POD)
    rank.report(1.0, POD)  # a container restart keeps the pod's uid: still current
    assert 1 not in rank.table  # its room failed
    assert rank.open(2, 1.1) == "prefill_pod_lost"
    # The old process still answers (a terminating pod): the report stands.
    rank.probe(OLD_START, 1.5)
    assert rank.table.peers_down(1.6) == {BOOTSTRAP: "prefill_pod_lost"}
    assert rank.open(3, 1.6) == "prefill_pod_lost"
    # Gone; a heartbeat death follows, then the restarted process answers.
    rank.probe(None, 2.5, ok=False)
    rank.probe(None, 3.5, ok=False)
    assert rank.table.peers_down(3.6) == {BOOTSTRAP: "prefill_pod_lost"}
    rank.probe(NEW_START, 4.0)
    assert rank.table.peers_down(4.1) == {}  # the router admits it on its next round
    assert rank.open(4, 4.1) == "proceed"  # long before bootstrap_s (6 s) from the report


def test_rooms_held_by_the_heartbeat_go_on_once_the_new_start_answers() -> None:
    rank = serving(OLD_START)
    rank.report(1.0)
    rank.probe(None, 1.5, ok=False)
    rank.probe(None, 2.5, ok=False)  # the heartbeat verdict outlives the report
    later = 1.0 + S.bootstrap_s + 0.5
    assert rank.open(5, later) == "held" and rank.open(6, later) == "held"
    rank.probe(OLD_START, later + 0.1)  # not a new start, yet the report has expired
    assert rank.resumed == [5, 6] and rank.table.peers_down(later + 0.2) == {}


def test_a_probe_sent_before_the_report_proves_nothing() -> None:
    rank = serving(OLD_START)
    rank.liveness.hold(BOOTSTRAP, 0.9)
    rank.act(rank.liveness.tick(1.0, {BOOTSTRAP}), 1.0)  # in flight at the report
    rank.report(1.05)
    rank.act(rank.liveness.on_probe(BOOTSTRAP, True, 1.1, NEW_START), 1.1)
    assert rank.open(2, 1.2) == "prefill_pod_lost"
    rank.probe(NEW_START, 1.5)
    assert rank.open(3, 1.6) == "proceed"


def test_a_stale_report_after_the_successor_was_seen_declares_nothing() -> None:
    rank = serving(OLD_START, "pod-uid-old")
    # The pod was replaced at the same address; its successor answered /route.
    assert rank.open(2, 0.5) == "proceed"
    rank.table.resolve(2, [Source(0, "127.0.0.1:9100", 1, POD)], 0.5, POD)
    rank.probe(NEW_START, 0.6)
    rank.report(1.0, "pod-uid-old")  # late, about the old pod
    assert rank.table.peers_down(1.1) == {}
    assert rank.open(3, 1.1) == "proceed" and 2 in rank.table


@given(
    answers=st.lists(
        st.tuples(st.sampled_from([OLD_START, NEW_START, None]), st.booleans()), max_size=8
    )
)
def test_only_a_new_start_ends_a_gone_report_early(
    answers: list[tuple[str | None, bool]],
) -> None:
    """Any run of probe answers within bootstrap_s: new rooms stay refused
    exactly until an answer names the new start; then they proceed."""
    rank = serving(OLD_START)
    rank.report(1.0)
    proven = False
    for i, (start, ok) in enumerate(answers):
        now = 1.2 + i * 0.6  # a probe each, all within the report's bootstrap_s
        rank.probe(start, now, ok)
        proven = proven or (ok and start == NEW_START)
        got = rank.open(100 + i, now + 0.05)
        if proven:
            # A later death (failed probes) holds rooms for a probe, refuses none.
            assert got in ("proceed", "held"), got
            assert "prefill_pod_lost" not in rank.table.peers_down(now + 0.05).values()
        else:
            assert got == "prefill_pod_lost"

"""The room phase tables: complete, as documented, and kept by a prefill/decode pair."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.room_common import RoomLeg
from pdcluster.runtime.pd.room_phases import (
    DECODE,
    DECODE_DEADLINES,
    DECODE_TRANSITIONS,
    PREFILL,
    PREFILL_DEADLINES,
    PREFILL_TRANSITIONS,
    DecodeEvent,
    DecodePhase,
    IllegalRoomTransition,
    PrefillEvent,
    PrefillPhase,
    next_phase,
)
from pdcluster.runtime.pd.settings import RoomSettings
from tests.pd.sim import BOOTSTRAP, Net, d_endpoint, p_endpoint

P, PE, D, DE = PrefillPhase, PrefillEvent, DecodePhase, DecodeEvent
enum_t = PrefillPhase | DecodePhase | PrefillEvent | DecodeEvent

# The protocols as the room modules' docstrings and docs/design.md §5 describe them,
# written here independently of the tables.
LIVE_PREFILL = [P.UNOPENED, P.OPENED, P.COMPUTING, P.COMPUTED, P.AWAITING_KV]
LIVE_PREFILL += [P.SENDING, P.TRANSFERRING, P.FINISHING]
PREFILL_EDGES = {
    (P.UNOPENED, PE.OPEN): P.OPENED,
    (P.UNOPENED, PE.OPEN_COMPUTE): P.COMPUTING,
    (P.OPENED, PE.ALL_DESTINATIONS): P.SENDING,
    (P.COMPUTING, PE.KV_COMPUTED): P.COMPUTED,
    (P.COMPUTING, PE.ALL_DESTINATIONS): P.AWAITING_KV,
    (P.COMPUTED, PE.ALL_DESTINATIONS): P.SENDING,
    (P.AWAITING_KV, PE.KV_COMPUTED): P.SENDING,
    (P.SENDING, PE.FIRST_WRITE): P.TRANSFERRING,
    (P.SENDING, PE.FINISH): P.FINISHING,
    (P.TRANSFERRING, PE.FINISH): P.FINISHING,
    (P.FINISHING, PE.DRAINED): P.SUCCEEDED,
    (P.DRAINING, PE.DRAINED): P.CLOSED,
    (P.DRAINING, PE.CANCEL): P.CANCELLING,
    (P.CANCELLING, PE.DRAINED): P.CLOSED,
} | {(phase, PE.FAIL): P.DRAINING for phase in LIVE_PREFILL}

LIVE_DECODE = [D.ROUTING, D.AWAITING_READY, D.AWAITING_PAGES, D.WAITING, D.TRANSFERRING]
DECODE_EDGES = {
    (D.ROUTING, DE.RESOLVED): D.AWAITING_PAGES,
    (D.ROUTING, DE.BOOTSTRAP_SENT): D.AWAITING_READY,
    (D.AWAITING_READY, DE.ALL_READY): D.AWAITING_PAGES,
    (D.AWAITING_PAGES, DE.PAGES_SENT): D.WAITING,
    (D.WAITING, DE.TRANSFERRING): D.TRANSFERRING,
    (D.WAITING, DE.SUCCESS): D.COMPLETE,
    (D.TRANSFERRING, DE.SUCCESS): D.COMPLETE,
    (D.FAILED, DE.SETTLED): D.RELEASED,
    (D.FAILED, DE.RELEASE_TIMEOUT): D.RELEASED,
} | {(phase, DE.FAIL): D.FAILED for phase in LIVE_DECODE}

PAIRS = [(PREFILL_TRANSITIONS, PREFILL_EDGES, p, e) for p in P for e in PE]
PAIRS += [(DECODE_TRANSITIONS, DECODE_EDGES, p, e) for p in D for e in DE]


@pytest.mark.parametrize(("table", "edges", "phase", "event"), PAIRS)
def test_every_pair_reaches_its_documented_phase_or_raises(
    table: dict, edges: dict, phase: enum_t, event: enum_t
) -> None:
    if (phase, event) in edges:
        assert next_phase(table, phase, event) is edges[(phase, event)]
    else:
        with pytest.raises(IllegalRoomTransition, match=f"no {event.name} in phase {phase.name}"):
            next_phase(table, phase, event)


@pytest.mark.parametrize("machine", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_deadlines_cover_every_non_terminal_phase_and_no_terminal_one(machine) -> None:
    terminal = {p for p, row in machine.transitions.items() if not row}
    assert set(machine.transitions) == set(machine.states)  # every phase has a KVPoll
    assert set(machine.deadlines) == set(machine.transitions) - terminal
    assert {machine.states[p] for p in terminal} == {KVPoll.Success, KVPoll.Failed}
    for deadline in machine.deadlines.values():
        if deadline is not None:
            setting, reason = deadline
            assert getattr(RoomSettings(), setting) > 0 and reason


@pytest.mark.parametrize("machine", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_a_failed_phase_never_leads_back_to_a_live_one(machine) -> None:
    for phase, row in machine.transitions.items():
        if machine.states[phase] is KVPoll.Failed:
            assert all(machine.states[new] is KVPoll.Failed for new in row.values())


def test_a_deadline_carries_over_within_one_entry_and_restarts_on_kv_computed() -> None:
    assert PREFILL.step(P.SENDING, PE.FIRST_WRITE) == (P.TRANSFERRING, False)
    assert PREFILL.step(P.UNOPENED, PE.OPEN) == (P.OPENED, False)
    assert PREFILL.step(P.COMPUTING, PE.KV_COMPUTED) == (P.COMPUTED, True)
    assert PREFILL.step(P.OPENED, PE.ALL_DESTINATIONS) == (P.SENDING, True)
    assert DECODE.step(D.ROUTING, DE.RESOLVED) == (D.AWAITING_PAGES, False)
    assert DECODE.step(D.AWAITING_READY, DE.ALL_READY) == (D.AWAITING_PAGES, True)


D0 = next(iter(Net().decode))
P0 = next(iter(Net().prefill))
ROOMS = st.integers(1, 4)


class RoomPair(RuleBasedStateMachine):
    """One prefill and one decode table, driven in any order a network allows."""

    @initialize(policy=st.sampled_from(["early", "prefill_complete"]), one_sided=st.booleans())
    def setup(self, policy: str, one_sided: bool) -> None:
        self.policy = policy
        self.net = Net(policy=policy, one_sided=one_sided, settings=RoomSettings(release_s=5.0))
        self.d = self.net.decode[D0]
        self.p = self.net.prefill[P0]
        self.dp, self.pp = d_endpoint(D0), p_endpoint(P0)
        self.now = 0.0
        self.added: set[int] = set()
        self.opened: set[int] = set()
        self.inflight: Counter[int] = Counter()
        self.wrote: set[int] = set()
        self.finished_at: dict[int, float] = {}  # finish_sending called, writes then in flight
        self.succeeded: set[int] = set()  # prefill RoomSucceeded
        self.concluded: set[int] = set()  # decode TransferComplete / ReleasePages
        self.assigned: set[int] = set()  # decode rooms that took pages
        self.page_events: Counter[int] = Counter()
        self.started: Counter[int] = Counter()
        self.released_source: Counter[int] = Counter()

    # ------------------------------------------------------------- plumbing

    def react(self, origin: str, acts: list[A.Action]) -> None:
        for act in self.net.handle(origin, acts):
            if isinstance(act, A.TransferComplete):
                event("transfer complete")
                # Success only after all KV: prefill finished and drained first.
                assert act.room in self.succeeded, f"room {act.room} complete before its KV"
                self._conclude(act.room)
            elif isinstance(act, A.ReleasePages):
                self._conclude(act.room)
            elif isinstance(act, A.PrefillReady):
                self._assign(act.room)
            elif isinstance(act, A.StartCompute):
                self.started[act.room] += 1
            elif isinstance(act, A.ReleaseSource):
                self.released_source[act.room] += 1
            elif isinstance(act, A.RoomSucceeded):
                event("prefill room succeeded")
                assert self.inflight[act.room] == 0 and act.room in self.finished_at
                self.succeeded.add(act.room)
            elif isinstance(act, A.CancelWrites) and self.inflight[act.room]:
                n, self.inflight[act.room] = self.inflight[act.room], 0
                self.react(self.pp, self.p.writes_done(act.room, n, False, self.now))

    def _assign(self, room: int) -> None:
        self.assigned.add(room)
        self.react(self.dp, self.d.assign_pages(room, [room], self.now))

    def _conclude(self, room: int) -> None:
        self.page_events[room] += 1
        self.concluded.add(room)

    # ------------------------------------------------------------- rules

    @rule(room=ROOMS)
    def decode_leg(self, room: int) -> None:
        if room in self.added:
            return
        self.added.add(room)
        self.d.add_room(RoomLeg(room, f"r{room}", num_tokens=4), BOOTSTRAP, self.now)
        self.react(self.dp, self.d.resolve(room, self.net.sources(D0, room), self.now))
        if self.policy == "early":
            self._assign(room)

    @rule(room=ROOMS)
    def prefill_leg(self, room: int) -> None:
        if room in self.opened:
            return
        self.opened.add(room)
        try:
            self.react(self.pp, self.p.open_room(RoomLeg(room, f"r{room}", 4), self.now))
        except ValueError:
            assert self.p.tombstone(room, self.now) is not None  # only a concluded room refuses

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        channels = self.net.channels()
        if channels:
            channel = data.draw(st.sampled_from(channels))
            self.react(channel[1], self.net.receive(channel, self.now))

    @rule(room=ROOMS)
    def kv_computed(self, room: int) -> None:
        if self.policy == "prefill_complete" and self.p.state(room) is not None:
            r = self.p._rooms[room]
            if PREFILL.allows(r.phase, PE.KV_COMPUTED):
                self.react(self.pp, self.p.kv_computed(room, self.now))

    @rule(room=ROOMS, n=st.integers(1, 3))
    def write(self, room: int, n: int) -> None:
        if self.p.can_send(room):
            self.inflight[room] += n
            self.wrote.add(room)
            self.react(self.pp, self.p.writes_enqueued(room, n, self.now))

    @rule(room=ROOMS, ok=st.sampled_from([True, True, False]))
    def drain(self, room: int, ok: bool) -> None:
        if self.inflight[room] and room in self.p:
            self.inflight[room] -= 1
            self.react(self.pp, self.p.writes_done(room, 1, ok, self.now))

    @rule(room=ROOMS)
    def finish(self, room: int) -> None:
        if self.p.can_send(room) and room in self.wrote:
            self.finished_at[room] = self.now
            event(f"finish with {self.inflight[room]} in flight")
            self.react(self.pp, self.p.finish_sending(room, 7, None, self.now))

    @rule(room=ROOMS)
    def decode_abort(self, room: int) -> None:
        if room in self.d and self.d.state(room) is not KVPoll.Failed:
            self.react(self.dp, self.d.abort(room, "client_disconnected", self.now))

    @rule(room=ROOMS)
    def prefill_abort(self, room: int) -> None:
        if room in self.p:
            self.react(self.pp, self.p.fail(room, "aborted", self.now))

    @rule(room=ROOMS, steps=st.sampled_from([1, 4, 12]))
    def progress(self, room: int, steps: int) -> None:
        """The next step(s) a healthy system would take for one room."""
        for _ in range(steps):
            if room not in self.added:
                self.decode_leg(room)
            elif room not in self.opened:
                self.prefill_leg(room)
            elif self.net.channels():
                channel = self.net.channels()[0]
                self.react(channel[1], self.net.receive(channel, self.now))
            elif self.inflight[room]:
                self.drain(room, True)
            elif room in self.wrote:
                self.finish(room)
            elif self.p.can_send(room):
                self.write(room, 1)
            else:
                self.kv_computed(room)

    @rule(dt=st.sampled_from([0.5, 0.5, 0.5, 4.0, 40.0, 100.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.react(self.pp, self.p.tick(self.now))
        self.react(self.dp, self.d.tick(self.now))

    # ------------------------------------------------------------- invariants

    @invariant()
    def terminal_phases_absorb(self) -> None:
        for room in self.concluded:
            assert room not in self.d, f"room {room} concluded but still in the decode table"
        for room in self.succeeded:
            assert room not in self.p, f"room {room} succeeded but still in the prefill table"

    @invariant()
    def pages_are_released_at_most_once_and_sources_freed_once(self) -> None:
        assert all(n == 1 for n in self.page_events.values()), self.page_events
        assert all(n == 1 for n in self.started.values()), self.started
        assert all(n <= 1 for n in self.released_source.values()), self.released_source
        assert set(self.released_source) <= set(self.started)

    @invariant()
    def every_live_room_has_the_deadline_its_phase_says(self) -> None:
        if not hasattr(self, "net"):
            return
        for r in self.p._rooms.values():
            assert (r.deadline is None) == (PREFILL_DEADLINES[r.phase] is None)
        for r in self.d._rooms.values():
            no_deadline = DECODE_DEADLINES[r.phase] is None or (
                r.phase is D.FAILED and self.d.info.one_sided
            )
            assert (r.deadline is None) == no_deadline

    def teardown(self) -> None:
        if not hasattr(self, "net"):
            return
        # Let everything settle: writes drain, messages arrive, deadlines pass.
        for _ in range(6):
            for room in list(self.inflight):
                if self.inflight[room] and room in self.p:
                    n, self.inflight[room] = self.inflight[room], 0
                    self.react(self.pp, self.p.writes_done(room, n, True, self.now))
            while self.net.channels():
                channel = self.net.channels()[0]
                self.react(channel[1], self.net.receive(channel, self.now))
            self.tick(200.0)
        assert len(self.p) == 0, self.p.list_rooms(self.now)
        # Every decode room that took pages gave them back exactly once.
        assert len(self.d) == 0, self.d.list_rooms(self.now)
        assert {room for room in self.page_events if room in self.assigned} == self.assigned
        assert self.released_source == self.started


TestRoomPair = RoomPair.TestCase
TestRoomPair.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)

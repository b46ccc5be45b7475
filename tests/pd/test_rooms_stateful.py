"""Stateful property tests: both room tables wired together under random interleavings.

Hypothesis drives a small cluster (one prefill and one decode instance, as in
`sim.Net`) through random requests, message deliveries in any cross-channel
order, KV writes and drains, aborts on either side, prefill failures, rank
deaths and clock jumps. The harness plays the integrator: a decode *leader*
owns the page pool of its group and frees pages only when every decode rank
released or handed off the room.

Invariants (docs/design.md §14), checked after every step and at the end:
- pages: every page is free or owned by exactly one room; after everything
  settles every page is free again, on every path;
- a page is never released while a live prefill rank may still write it
  (always for one-sided writes; for tcp except after the release timeout,
  when the receiver drops late frames by generation);
- exactly once: ReleasePages per (decode rank, room), ReleaseSource per
  StartCompute, RoomFailed per (table, room); no room both completes and fails;
- a cleared room never comes back; Failed is sticky;
- no live room outlives its deadline once the clock has been ticked past it;
- after settling, every table is empty: nothing hangs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.room_common import RoomLeg, RoomRejected
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd.topology import ModelShape

from .sim import NUM_PAGES, PAGE_SIZE, Net, d_endpoint, p_endpoint

SETTINGS = RoomSettings(
    bootstrap_s=10.0, waiting_s=20.0, prefill_wait_s=15.0, release_s=5.0, tombstone_s=10_000.0
)
# The longest a live room can legitimately exist (every phase at its limit).
LIVE_BOUND = 2 * SETTINGS.bootstrap_s + SETTINGS.prefill_wait_s + SETTINGS.waiting_s


@dataclass
class Req:
    room: int
    rid: str
    num_tokens: int
    prefill_opened: bool = False
    pages: tuple[int, ...] | None = None
    pages_freed: bool = False
    ready: set[RankCoord] = field(default_factory=set)
    done: set[RankCoord] = field(default_factory=set)  # decode ranks: TransferComplete
    failed: set[RankCoord] = field(default_factory=set)  # decode ranks: RoomFailed
    released: set[RankCoord] = field(default_factory=set)  # decode ranks: ReleasePages


class PDMachine(RuleBasedStateMachine):
    prefill_shape = InstanceShape()
    decode_shape = InstanceShape()
    model = ModelShape(4, 4)
    policy = "early"
    one_sided = False

    def __init__(self) -> None:
        super().__init__()
        self.net = Net(
            prefill_shape=self.prefill_shape,
            decode_shape=self.decode_shape,
            model=self.model,
            policy=self.policy,
            one_sided=self.one_sided,
            settings=SETTINGS,
        )
        self.now = 0.0
        self.next_room = 1
        self.free = set(range(NUM_PAGES))
        self.reqs: dict[int, Req] = {}
        self.inflight: Counter[tuple[RankCoord, int]] = Counter()  # (prefill rank, room)
        self.computing: set[tuple[RankCoord, int]] = set()
        self.computed: set[tuple[RankCoord, int]] = set()
        self.finished: set[tuple[RankCoord, int]] = set()
        self.wrote: set[tuple[RankCoord, int]] = set()
        self.source_releases: Counter[tuple[RankCoord, int]] = Counter()
        self.room_failures: Counter[tuple[str, int]] = Counter()
        self.dead: set[RankCoord] = set()
        self.detected: set[RankCoord] = set()
        self.seen: set[tuple[str, int]] = set()
        self.gone: set[tuple[str, int]] = set()
        self.failed_seen: set[tuple[str, int]] = set()

    # ---------------------------------------------------------------- reactions

    def react(self, endpoint: str, acts: list[A.Action]) -> None:
        """Play the integrator for every non-Send action a table returned."""
        for act in self.net.handle(endpoint, acts):
            if isinstance(act, A.RoomFailed):
                self.room_failures[(endpoint, act.room)] += 1
                assert self.room_failures[(endpoint, act.room)] == 1, "RoomFailed twice"
            d_rank = self.decode_rank_of(endpoint)
            p_rank = self.prefill_rank_of(endpoint)
            if d_rank is not None:
                self.react_decode(d_rank, act)
            elif p_rank is not None:
                self.react_prefill(p_rank, act)

    def react_decode(self, d: RankCoord, act: A.Action) -> None:
        if isinstance(act, A.PrefillReady):
            self.reqs[act.room].ready.add(d)
        elif isinstance(act, A.TransferComplete):
            event("decode room completed")
            req = self.reqs[act.room]
            assert d not in req.failed, "a failed room completed"
            assert act.pages == req.pages
            req.done.add(d)
            self.maybe_free(req)
        elif isinstance(act, A.RoomFailed):
            req = self.reqs[act.room]
            assert d not in req.done
            req.failed.add(d)
            # The leader takes the room down on every rank of its group.
            for other, table in self.net.decode.items():
                if act.room in table and table.state(act.room) is not KVPoll.Failed:
                    self.react(d_endpoint(other), table.abort(act.room, "group_failed", self.now))
        elif isinstance(act, A.ReleasePages):
            event(f"failed room released: {act.reason}")
            req = self.reqs[act.room]
            assert d not in req.released, "ReleasePages twice"
            assert act.pages == req.pages
            writers = [
                p
                for p in self.net.prefill
                if self.inflight[(p, act.room)]
                and p not in self.dead
                and p in {s.prefill_rank for s in self.net.sources(d, act.room)}
            ]
            if self.one_sided or act.reason != "release_timeout":
                assert not writers, f"pages of room {act.room} released while {writers} write"
            req.released.add(d)
            self.maybe_free(req)

    def react_prefill(self, p: RankCoord, act: A.Action) -> None:
        if isinstance(act, A.StartCompute):
            assert (p, act.room) not in self.computing
            self.computing.add((p, act.room))
        elif isinstance(act, A.ReleaseSource):
            self.source_releases[(p, act.room)] += 1
            assert self.source_releases[(p, act.room)] == 1, "ReleaseSource twice"
            assert (p, act.room) in self.computing
        elif isinstance(act, A.CancelWrites):
            # The transfer engine abandons the room's queued writes.
            pending = self.inflight.pop((p, act.room), 0)
            if pending:
                table = self.net.prefill[p]
                self.react(p_endpoint(p), table.writes_done(act.room, pending, False, self.now))

    def maybe_free(self, req: Req) -> None:
        if req.pages is None or req.pages_freed:
            return
        if req.done | req.released == set(self.net.decode):
            req.pages_freed = True
            assert not (set(req.pages) & self.free)
            self.free.update(req.pages)

    def decode_rank_of(self, endpoint: str) -> RankCoord | None:
        return next((r for r in self.net.decode if d_endpoint(r) == endpoint), None)

    def prefill_rank_of(self, endpoint: str) -> RankCoord | None:
        return next((r for r in self.net.prefill if p_endpoint(r) == endpoint), None)

    def alive_prefill(self) -> list[RankCoord]:
        return [p for p in self.net.prefill if p not in self.dead]

    # -------------------------------------------------------------------- rules

    @initialize(num_tokens=st.integers(1, 24))
    def first_request_goes_through(self, num_tokens: int) -> None:
        """Every run starts with one request driven end to end: success is always exercised."""
        req = self._new_request(num_tokens)
        for _ in range(12):
            self._progress(req)
        assert req.done == set(self.net.decode), "a healthy request did not complete"

    @rule(
        num_tokens=st.integers(1, 24),
        steps=st.integers(0, 7),
        fault=st.sampled_from(
            ["decode_abort", "prefill_fail", "kill_prefill", "timeout", "prefill_lost_decode"]
        ),
        data=st.data(),
    )
    def fault_at_some_phase(
        self, num_tokens: int, steps: int, fault: str, data: st.DataObject
    ) -> None:
        """A new request, driven `steps` healthy steps, then one fault hits it."""
        req = self._new_request(num_tokens)
        for _ in range(steps):
            self._progress(req)
        states = {t.state(req.room) for t in self.net.decode.values()} - {None}
        event(f"{fault} with decode in {sorted(s.name for s in states) or ['(gone)']}")
        if fault == "decode_abort":
            for rank, table in self.net.decode.items():
                if req.room in table and table.state(req.room) is not KVPoll.Failed:
                    self.react(
                        d_endpoint(rank), table.abort(req.room, "client_disconnected", self.now)
                    )
        elif fault == "prefill_fail":
            for p in self.alive_prefill():
                if req.room in self.net.prefill[p]:
                    self.react(
                        p_endpoint(p), self.net.prefill[p].fail(req.room, "engine_error", self.now)
                    )
                    break
        elif fault == "kill_prefill" and len(self.dead) < len(self.net.prefill) - 1:
            p = data.draw(st.sampled_from(sorted(self.net.prefill_group(req.room))))
            if p not in self.dead:
                self.dead.add(p)
                self.net.kill(p_endpoint(p))
        elif fault == "timeout":
            self.now += data.draw(st.floats(5.0, 40.0))
            self.tick_all()
        elif fault == "prefill_lost_decode":
            # The operator tells prefill that the decode pod is gone (it is not, here:
            # decode then learns from Failed statuses and aborts).
            for p in self.alive_prefill():
                self.react(
                    p_endpoint(p), self.net.prefill[p].fail_peer("127.0.0.2", "peer_lost", self.now)
                )

    @rule(num_tokens=st.integers(1, 24))
    def new_request(self, num_tokens: int) -> None:
        self._new_request(num_tokens)

    def _new_request(self, num_tokens: int) -> Req:
        room = self.next_room
        self.next_room += 1
        req = Req(room, f"rid-{room:08d}", num_tokens)
        self.reqs[room] = req
        for rank, table in self.net.decode.items():
            table.add_room(RoomLeg(room, req.rid), "127.0.0.1:8998", self.now)
            sources = self.net.sources(rank, room)
            self.react(d_endpoint(rank), table.resolve(room, sources, self.now))
        return req

    def _open_prefill(self, req: Req) -> None:
        req.prefill_opened = True
        for rank, table in self.net.prefill_group(req.room).items():
            if rank in self.dead:
                continue
            try:
                acts = table.open_room(RoomLeg(req.room, req.rid, req.num_tokens), self.now)
            except RoomRejected as err:
                # Only a room that already concluded here may refuse its own leg.
                assert err.reason == "room_closed", err
                continue
            self.react(p_endpoint(rank), acts)

    def _admissible(self, r: Req) -> bool:
        if r.pages is not None:
            return False
        if any(t.state(r.room) is not KVPoll.Bootstrapping for t in self.net.decode.values()):
            return False
        return self.policy == "early" or r.ready == set(self.net.decode)

    def _admit(self, req: Req) -> None:
        need = math.ceil(req.num_tokens / PAGE_SIZE)
        if need > len(self.free):
            return  # backpressure: wait
        pages = sorted(self.free)[:need]
        self.free.difference_update(pages)
        req.pages = tuple(pages)
        for rank, table in self.net.decode.items():
            self.react(d_endpoint(rank), table.assign_pages(req.room, pages, self.now))

    @rule(data=st.data())
    def open_prefill(self, data: st.DataObject) -> None:
        waiting = [r for r in self.reqs.values() if not r.prefill_opened]
        if waiting:
            self._open_prefill(data.draw(st.sampled_from(waiting)))

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        candidates = [r for r in self.reqs.values() if self._admissible(r)]
        if candidates:
            self._admit(data.draw(st.sampled_from(candidates)))

    @rule(data=st.data(), steps=st.sampled_from([1, 1, 12]))
    def progress(self, data: st.DataObject, steps: int) -> None:
        """The next step(s) a healthy system would take for one request."""
        live = [r for r in self.reqs.values() if any(r.room in t for t in self.net.decode.values())]
        if live:
            req = data.draw(st.sampled_from(live))
            for _ in range(steps):
                self._progress(req)

    def _progress(self, req: Req) -> None:
        if not req.prefill_opened:
            self._open_prefill(req)
            return
        if self._admissible(req):
            self._admit(req)
            return
        self.pump()
        for p in self.net.prefill_group(req.room):
            table = self.net.prefill[p]
            if p in self.dead or (p, req.room) not in self.computing:
                continue
            if self.policy == "prefill_complete" and (p, req.room) not in self.computed:
                if req.room in table:
                    self.computed.add((p, req.room))
                    self.react(p_endpoint(p), table.kv_computed(req.room, self.now))
            elif self.inflight[(p, req.room)]:  # one step at a time: write, drain, finish
                self.inflight[(p, req.room)] -= 1
                self.react(p_endpoint(p), table.writes_done(req.room, 1, True, self.now))
            elif table.can_send(req.room) and (p, req.room) in self.wrote:
                self.finished.add((p, req.room))
                self.react(p_endpoint(p), table.finish_sending(req.room, 11, None, self.now))
            elif table.can_send(req.room):
                self.wrote.add((p, req.room))
                self.inflight[(p, req.room)] += 1
                self.react(p_endpoint(p), table.writes_enqueued(req.room, 1, self.now))
        self.pump()

    @precondition(lambda self: bool(self.net.channels()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        channel = data.draw(st.sampled_from(self.net.channels()))
        self.react(channel[1], self.net.receive(channel, self.now))

    @rule(data=st.data(), writes=st.integers(1, 3), finish=st.booleans())
    def prefill_step(self, data: st.DataObject, writes: int, finish: bool) -> None:
        options = [
            (p, room)
            for p, room in sorted(self.computing)
            if p not in self.dead
            and self.net.prefill[p].can_send(room)
            and (self.policy == "early" or (p, room) in self.computed)
        ]
        if not options:
            return
        p, room = data.draw(st.sampled_from(options))
        table = self.net.prefill[p]
        if finish:
            self.finished.add((p, room))
            self.react(p_endpoint(p), table.finish_sending(room, 11, None, self.now))
        else:
            event("prefill writes left in flight")
            self.inflight[(p, room)] += writes
            self.react(p_endpoint(p), table.writes_enqueued(room, writes, self.now))

    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def drain(self, data: st.DataObject, ok: bool) -> None:
        options = sorted(k for k, v in self.inflight.items() if v and k[0] not in self.dead)
        if not options:
            return
        p, room = data.draw(st.sampled_from(options))
        count = data.draw(st.integers(1, self.inflight[(p, room)]))
        self.inflight[(p, room)] -= count
        table = self.net.prefill[p]
        self.react(p_endpoint(p), table.writes_done(room, count, ok, self.now))

    @precondition(lambda self: self.policy == "prefill_complete")
    @rule(data=st.data())
    def kv_computed(self, data: st.DataObject) -> None:
        options = sorted(
            k
            for k in self.computing - self.computed
            if k[0] not in self.dead and k[1] in self.net.prefill[k[0]]
        )
        if not options:
            return
        p, room = data.draw(st.sampled_from(options))
        self.computed.add((p, room))
        self.react(p_endpoint(p), self.net.prefill[p].kv_computed(room, self.now))

    @rule(data=st.data())
    def decode_abort(self, data: st.DataObject) -> None:
        live = sorted(
            room
            for t in self.net.decode.values()
            for room in self.reqs
            if room in t and t.state(room) is not KVPoll.Failed
        )
        if not live:
            return
        room = data.draw(st.sampled_from(live))
        for rank, table in self.net.decode.items():
            if room in table and table.state(room) is not KVPoll.Failed:
                self.react(d_endpoint(rank), table.abort(room, "client_disconnected", self.now))

    @precondition(lambda self: any(self.inflight.values()))
    @rule(data=st.data(), on_decode=st.booleans())
    def abort_mid_transfer(self, data: st.DataObject, on_decode: bool) -> None:
        """Abort a room while some prefill rank still has writes in flight into it."""
        busy = sorted({room for (p, room), n in self.inflight.items() if n and p not in self.dead})
        if not busy:
            return
        room = data.draw(st.sampled_from(busy))
        event("abort with writes in flight")
        if on_decode:
            for rank, table in self.net.decode.items():
                if room in table and table.state(room) is not KVPoll.Failed:
                    self.react(d_endpoint(rank), table.abort(room, "client_disconnected", self.now))
        else:
            for p in self.alive_prefill():
                if room in self.net.prefill[p]:
                    self.react(
                        p_endpoint(p), self.net.prefill[p].fail(room, "engine_error", self.now)
                    )

    @rule(data=st.data())
    def prefill_fail(self, data: st.DataObject) -> None:
        options = [
            (p, room)
            for p in self.alive_prefill()
            for room in self.reqs
            if room in self.net.prefill[p]
        ]
        if not options:
            return
        p, room = data.draw(st.sampled_from(options))
        self.react(p_endpoint(p), self.net.prefill[p].fail(room, "engine_error", self.now))

    # Mostly small steps (work gets done), sometimes a jump past every timeout.
    @rule(dt=st.one_of(st.floats(0.05, 2.0), st.floats(0.05, 2.0), st.floats(5.0, 40.0)))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.tick_all()

    @precondition(lambda self: len(self.dead) < len(self.net.prefill))
    @rule(data=st.data(), go=st.integers(0, 4))
    def kill_prefill(self, data: st.DataObject, go: int) -> None:
        if go:  # deaths are rarer than other events, so some requests get through
            return
        p = data.draw(st.sampled_from(self.alive_prefill()))
        self.dead.add(p)
        self.net.kill(p_endpoint(p))

    @rule()
    def detect_dead(self) -> None:
        """Heartbeat past its threshold (DEAD, then STILL_DEAD) or the operator's fast path."""
        for p in sorted(self.dead):
            self.detected.add(p)
            for rank, table in self.net.decode.items():
                self.react(
                    d_endpoint(rank),
                    table.fail_peer(p_endpoint(p), "prefill_unreachable", self.now),
                )

    def pump(self) -> None:
        for _ in range(10_000):
            channels = self.net.channels()
            if not channels:
                return
            for channel in channels:
                self.react(channel[1], self.net.receive(channel, self.now))
        raise AssertionError("messages kept flowing")

    def tick_all(self) -> None:
        for rank, table in self.net.decode.items():
            self.react(d_endpoint(rank), table.tick(self.now))
        for p in self.alive_prefill():
            self.react(p_endpoint(p), self.net.prefill[p].tick(self.now))

    # --------------------------------------------------------------- invariants

    def tables(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = [(d_endpoint(r), t) for r, t in self.net.decode.items()]
        out += [(p_endpoint(p), self.net.prefill[p]) for p in self.alive_prefill()]
        return out

    @invariant()
    def pages_are_free_or_owned_once(self) -> None:
        owned = [p for r in self.reqs.values() if r.pages and not r.pages_freed for p in r.pages]
        assert len(owned) == len(set(owned))
        assert not (set(owned) & self.free)
        assert len(owned) + len(self.free) == NUM_PAGES

    @invariant()
    def cleared_rooms_stay_cleared_and_failed_stays_failed(self) -> None:
        for endpoint, table in self.tables():
            for room in self.reqs:
                key = (endpoint, room)
                present = room in table  # type: ignore[operator]
                if present:
                    assert key not in self.gone, f"room {room} resurrected on {endpoint}"
                    self.seen.add(key)
                    state = table.state(room)  # type: ignore[attr-defined]
                    if key in self.failed_seen:
                        assert state is KVPoll.Failed
                    if state is KVPoll.Failed:
                        self.failed_seen.add(key)
                elif key in self.seen:
                    self.gone.add(key)

    @invariant()
    def no_live_room_outlives_its_deadline(self) -> None:
        for endpoint, table in self.tables():
            for view in table.list_rooms(self.now):  # type: ignore[attr-defined]
                if view.state != "Failed":
                    assert view.age_s <= LIVE_BOUND + 25.0, f"{endpoint}: {view}"
                elif not self.one_sided and endpoint.startswith("tcp://127.0.0.2"):
                    assert view.age_s <= LIVE_BOUND + SETTINGS.release_s + 25.0, view

    # --------------------------------------------------------------- settling

    def teardown(self) -> None:
        """Let every timer and message play out; then nothing may be left anywhere."""
        for _ in range(12):
            self.pump()
            self.detect_dead()
            for (p, room), pending in sorted(self.inflight.items()):
                if pending and p not in self.dead:
                    self.inflight[(p, room)] = 0
                    self.react(
                        p_endpoint(p),
                        self.net.prefill[p].writes_done(room, pending, True, self.now),
                    )
            self.pump()
            self.now += 30.0
            self.tick_all()
        for endpoint, table in self.tables():
            assert len(table) == 0, f"{endpoint} still holds {table.list_rooms(self.now)}"  # type: ignore[arg-type, attr-defined]
        assert self.free == set(range(NUM_PAGES)), "pages leaked"
        for p, room in self.computing:
            if p not in self.dead:
                assert self.source_releases[(p, room)] == 1, f"prefill {p} room {room} kept its KV"
        for req in self.reqs.values():
            for d in self.net.decode:
                assert (d in req.done) != (d in req.failed), (
                    f"room {req.room} on {d} never concluded"
                )


def machine(name: str, **attrs: object) -> type[RuleBasedStateMachine]:
    return type(name, (PDMachine,), attrs)


RUN = settings(max_examples=60, stateful_step_count=50, deadline=None)

OneToOneEarly = RUN(machine("OneToOneEarly"))
TwoSourcesOneSided = RUN(
    machine("TwoSourcesOneSided", prefill_shape=InstanceShape(tp=2), one_sided=True)
)
FanOutPrefillComplete = RUN(
    machine(
        "FanOutPrefillComplete",
        prefill_shape=InstanceShape(dp=2, cp=2),
        decode_shape=InstanceShape(tp=2),
        policy="prefill_complete",
    )
)
PipelineEarly = RUN(
    machine(
        "PipelineEarly", prefill_shape=InstanceShape(tp=2, pp=2), decode_shape=InstanceShape(pp=2)
    )
)

TestOneToOneEarly = OneToOneEarly.TestCase
TestTwoSourcesOneSided = TwoSourcesOneSided.TestCase
TestFanOutPrefillComplete = FanOutPrefillComplete.TestCase
TestPipelineEarly = PipelineEarly.TestCase

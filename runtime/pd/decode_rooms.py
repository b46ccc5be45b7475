"""Room table of one decode rank — a sans-IO state machine.

The I/O loop feeds events (local calls, decoded prefill→decode messages,
`tick(now)`) and performs the returned `actions`. No clock, no socket.

    add_room ──► Bootstrapping ──resolve(sources)──► (prefill_complete: BOOTSTRAP sent,
                 wait for Ready from every source ──► PrefillReady)
    Bootstrapping ──assign_pages: metadata to every source──► WaitingForInput
    WaitingForInput ──every source Transferring──► Transferring
    ──every source Success──► TransferComplete (room leaves the table, pages go to the request)
    any live state ──abort / timeout / source Failed / peer lost──► Failed
    Failed ──every source settled (acked, dead, or never sent pages)──► ReleasePages

Rules (docs/design.md §3, §5, §7, §8):
- a room gets a fresh `generation` from a per-table counter; every message
  to prefill carries it, and any Status / Ready / AbortAck of another
  generation is dropped — a late ACK never releases a newer attempt's pages;
- a duplicate `add_room` is refused; `resolve` and `assign_pages` are
  accepted once, in Bootstrapping only;
- room state = `consensus` over its sources (Failed dominates, else the
  slowest); duplicate statuses from one rank count once; Success needs
  every source (`required_responses` distinct ranks);
- on failure: `RoomFailed` once, `Abort(room, generation)` once to every
  source that has not succeeded and is not dead; the pages stay until every
  source is settled, or `release_s` passed — never on timeout alone with a
  one-sided transport (`one_sided`, i.e. shm writes into our memory): there
  only an ack or a definitive `fail_peer` (the operator's fast path for a
  crashed or deleted pod, or the instance seen back on new addresses)
  frees them — a heartbeat verdict is not enough there
  (`fail_peer(..., definitive=False)`: a hung writer may resume); so
  there the ABORT is sent again every `abort_resend_interval_s` to each
  source that has neither acked nor been declared dead (a lost ABORT or
  ack must not hold the pages forever; prefill acks a repeat again);
- deadlines: Bootstrapping (route + pages) within `bootstrap_s`; under
  `prefill_complete` Ready from every source within `prefill_wait_s`, then
  pages within `bootstrap_s`; WaitingForInput/Transferring within
  `waiting_s`, each of the two waits extended per prompt token
  (`RoomSettings.waiting_budget_s`). `tick(now)` fails late rooms (and so sends ABORT);
- `fail_peer(peer, reason)` fails every unfinished room tied to a prefill
  instance (bootstrap address), rank endpoint or host, marks those sources
  dead (which settles them) and forgets their layout registration (re-sent
  on next use). It is idempotent — call it on every failed probe past the
  threshold. For `bootstrap_s` after an operator report a new room on that
  peer fails at once with the report's reason (`gate_new_room` right after
  `add_room`: no /route fetch, no retries against a gone server) — unless
  `peer_recovered` ends it sooner (peer liveness decides when: for a
  definitive report only once a new start of the peer answers), and
  `resolve` fails one using a rank endpoint or host declared dead. A
  heartbeat verdict (`until_recovered`, until `peer_recovered`) only says
  the peer stopped answering — it may be back already (a resumed or
  restarted process at the same address) — so a new room on it is held
  for one probe instead: `peer_recovered` hands it back to fetch /route,
  `probe_failed` fails it with the verdict's reason;
- a rejected `KVLayoutRegister` (LayoutAck) fails the rooms on that peer with
  the prefill's reason, which names the mismatched field and both values.

I/O contract: `add_room(room, rid, peer)` when the decode leg arrives; fetch
/route, compute `Source`s from `topology`, `resolve(room, sources)`; queue the
room for pages (`decode_admission`) — right away under `early`, on
`PrefillReady` under `prefill_complete` — and `assign_pages(room, pages)`
when admitted (all ranks of a decode dp group take the same pages, chosen by
the group leader; the leader frees them once every rank emitted
`TransferComplete` or `ReleasePages`); feed prefill messages to `on_message`; `abort(room, reason)`
on client disconnect / abort_request; `tick(now)` about every 100 ms. On
`RoomFailed` also cancel the room's admission (and abort it on the other
ranks of the group); on `ReleasePages` / `TransferComplete` release its
transfer slot. After a `ReleasePages` with reason `release_timeout` (tcp
only) the receiver must drop late KV frames of that (room, generation).

Pure module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdcluster.runtime.pd.actions import (
    Action,
    Dropped,
    PrefillReady,
    ReleasePages,
    RoomFailed,
    Send,
    TransferComplete,
)
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.decode_sources import DecodeRoom, Source, SourceState
from pdcluster.runtime.pd.incarnations import Incarnations, ReportScope, covers
from pdcluster.runtime.pd.kvpoll import KVPoll, Poll, consensus
from pdcluster.runtime.pd.messages import (
    MAX_PAGES_PER_ROOM,
    Abort,
    AbortAck,
    Bootstrap,
    KVLayoutRegister,
    LayoutAck,
    Message,
    NixlRegion,
    Ready,
    Status,
    TransferMeta,
)
from pdcluster.runtime.pd.peer_liveness import Gate, PeerVerdicts
from pdcluster.runtime.pd.prefix_reuse import ReusedPrefix
from pdcluster.runtime.pd.room_common import (
    Handler,
    RoomError,
    RoomLeg,
    RoomRejected,
    RoomStateError,
    RoomTable,
    RoomView,
    peer_matches,
)
from pdcluster.runtime.pd.room_phases import DECODE, DecodeEvent, DecodePhase
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.spec import AllocationPolicy

_PREFILL_COMPLETE = AllocationPolicy.prefill_complete
_Ev = DecodeEvent


@dataclass(frozen=True)
class DecodeRankInfo:
    """Identity and KV layout of the rank owning the table."""

    rank: RankCoord
    endpoint: str  # this rank's control endpoint; prefill answers here
    compat: CompatInfo
    token: str  # cluster token, sent in KVLayoutRegister
    num_pages: int
    layers: tuple[int, int]  # global layer range held by this rank
    heads: tuple[int, int]  # global kv-head range held by this rank
    shm_pool_path: str | None = None
    # The transport writes into our memory without us taking part (shm):
    # pages of a failed room are then never released on timeout alone.
    one_sided: bool = False
    # nixl: our agent and pool region, for the prefill ranks to WRITE into.
    nixl: NixlRegion | None = None
    # Which start of this rank's pod (sent in the layout; None in local mode).
    incarnation: str | None = None

    def layout_message(self) -> KVLayoutRegister:
        return KVLayoutRegister(
            token=self.token,
            decode_rank=self.rank,
            decode_endpoint=self.endpoint,
            compat=self.compat,
            num_pages=self.num_pages,
            layer_start=self.layers[0],
            layer_end=self.layers[1],
            head_start=self.heads[0],
            head_end=self.heads[1],
            shm_pool_path=self.shm_pool_path,
            nixl=self.nixl,
            incarnation=self.incarnation,
        )


@dataclass(frozen=True)
class PeerGate:
    """What a room just added does about its prefill instance's verdict.

    `actions` non-empty: refused (the room failed at once, perform them).
    `probe` set: held — probe that prefill now (or join the probe in flight)
    and report with `peer_recovered` / `probe_failed`. Neither: go on to /route.
    """

    actions: list[Action] = field(default_factory=list)
    probe: str | None = None

    @property
    def proceed(self) -> bool:
        return not self.actions and self.probe is None


class DecodeRoomTable(RoomTable[DecodeRoom]):
    unknown_room = "is not in this decode rank's table"

    def __init__(
        self, info: DecodeRankInfo, settings: RoomSettings | None = None, first_generation: int = 1
    ) -> None:
        super().__init__(info.compat.allocation_policy, settings)
        self.info = info
        self._layout = info.layout_message()
        self._next_generation = first_generation
        # Prefill endpoints we sent our layout to → their instance's bootstrap address.
        self._registered: dict[str, str] = {}
        # Peers declared dead: new rooms on them fail fast, or wait for a probe.
        self._verdicts = PeerVerdicts()
        # Rooms held (Bootstrapping, unresolved) until a probe of their prefill answers.
        self._held: set[int] = set()
        # Which start of each prefill instance and rank this rank saw (/route answers).
        self._incarnations = Incarnations()

    # ------------------------------------------------------------------ queries

    def generation(self, room: int) -> int:
        generation: int = self._live(room).generation
        return generation

    def pages(self, room: int) -> tuple[int, ...] | None:
        pages: tuple[int, ...] | None = self._live(room).pages
        return pages

    def num_pages_held(self) -> int:
        """Pages owned by rooms still in the table (live, or failed awaiting release)."""
        return sum(len(r.pages or ()) for r in self._rooms.values())

    def is_registered(self, endpoint: str) -> bool:
        return endpoint in self._registered

    def list_rooms(self, now: float) -> list[RoomView]:
        views = []
        for r in self._rooms.values():
            sources = list(r.sources.values()) if r.sources else []
            pending = sum(1 for s in sources if not s.settled)
            views.append(
                self._view(
                    r,
                    now,
                    peers=(r.peer, *sorted(s.source.endpoint for s in sources)),
                    detail=f"sources={len(sources)} pages={len(r.pages or ())} unsettled={pending}",
                    generation=r.generation,
                )
            )
        return views

    # ------------------------------------------------------------- local events

    def add_room(self, leg: RoomLeg, peer: str, now: float) -> int:
        """The decode leg arrived for prefill `peer`; returns the room's generation.

        `leg.num_tokens` extends the waiting deadlines by
        `settings.waiting_per_token_s` a token.
        """
        room = leg.room
        if not isinstance(peer, str) or not peer:
            raise RoomError(
                f"peer must name the prefill bootstrap address, got {peer!r}", "bad_peer"
            )
        old = self._rooms.get(room)
        if old is not None:
            raise RoomRejected(
                f"duplicate room {room}: held by rid {old.rid!r} ({old.state.name})",
                "duplicate_room",
            )
        if len(self._rooms) >= self.settings.max_rooms:
            raise RoomRejected(
                f"decode rank has {len(self._rooms)} rooms (limit {self.settings.max_rooms})",
                "too_many_rooms",
            )
        generation = self._next_generation
        self._next_generation += 1
        self._rooms[room] = DecodeRoom(
            room=room,
            rid=leg.rid,
            generation=generation,
            peer=peer,
            created_at=now,
            deadline=now + self.settings.bootstrap_s,
            prompt=leg.prompt,
            rid_is_local=leg.rid_is_local,
            num_tokens=leg.num_tokens,
        )
        return generation

    def resolve(
        self, room: int, sources: Sequence[Source], now: float, incarnation: str | None = None
    ) -> list[Action]:
        """The prefill ranks this rank receives from are known (addresses fetched).

        `incarnation`: the instance's, as its /route answer says (its leader pod's).
        """
        r = self._live(room)
        if r.phase is not DecodePhase.ROUTING:
            raise RoomStateError(f"room {room} is {r.state.name}: already resolved")
        ranks = [s.prefill_rank for s in sources]
        if not sources or len(set(ranks)) != len(ranks):
            raise RoomError(f"room {room}: sources must be non-empty distinct ranks, got {ranks}")
        for s in sources:
            if not s.endpoint or not 1 <= s.num_destinations <= 1 << 16:
                raise RoomError(f"room {room}: bad source {s}", "bad_source")
        r.sources = {s.prefill_rank: SourceState(s) for s in sources}
        r.incarnation = incarnation
        self._incarnations.saw(r.peer, incarnation)
        for s in sources:
            self._incarnations.saw(s.endpoint, s.incarnation)
        dead_reason = self._declared_dead(r, now)
        if dead_reason is not None:
            return self._fail(r, dead_reason, now)
        acts: list[Action] = []
        for endpoint in dict.fromkeys(s.endpoint for s in sources):
            if endpoint not in self._registered:
                self._registered[endpoint] = r.peer
                acts.append(Send(endpoint, self._layout))
        if self.policy is _PREFILL_COMPLETE:
            acts.extend(self._claim(r, state, Bootstrap) for state in r.sources.values())
            self._step(r, _Ev.BOOTSTRAP_SENT, now)
        else:
            self._step(r, _Ev.RESOLVED, now)
        return acts

    def assign_pages(
        self, room: int, pages: Sequence[int], now: float, reuse: ReusedPrefix | None = None
    ) -> list[Action]:
        """Admission reserved `pages` for the room: send them to every source.

        `reuse`: the first `reuse.num_pages` pages are cached pages decode
        already holds for this prompt; the sources are told not to write them.

        Raises (and takes no ownership of the pages) if the room is not
        waiting for pages — the caller then frees them itself.
        """
        r = self._live(room)
        if r.phase not in (DecodePhase.AWAITING_PAGES, DecodePhase.AWAITING_READY):
            raise RoomStateError(
                f"room {room} is {r.state.name}"
                f"{'' if r.sources is not None else ' (unresolved)'}: cannot take pages"
            )
        if r.phase is DecodePhase.AWAITING_READY:
            raise RoomStateError(f"room {room}: prefill has not reported Ready from every source")
        page_list = list(pages)
        if not 0 < len(page_list) <= MAX_PAGES_PER_ROOM or len(set(page_list)) != len(page_list):
            raise RoomError(f"room {room}: pages must be 1..{MAX_PAGES_PER_ROOM} distinct indices")
        for p in page_list:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.info.num_pages:
                raise RoomError(f"room {room}: page {p!r} outside [0, {self.info.num_pages})")
        if reuse is not None and not isinstance(reuse, ReusedPrefix):
            raise RoomError(f"room {room}: reuse must be a ReusedPrefix, got {reuse!r}")
        if reuse is not None and reuse.num_pages >= len(page_list):
            raise RoomError(
                f"room {room}: reusing {reuse.num_pages} of {len(page_list)} pages "
                "leaves nothing to receive",
                "bad_reuse",
            )
        r.pages = tuple(page_list)
        acts: list[Action] = []
        assert r.sources is not None
        for state in r.sources.values():
            state.may_write = True
            acts.append(
                self._claim(
                    r, state, TransferMeta, dst_pages=page_list, prompt=r.prompt, reuse=reuse
                )
            )
        self._step(r, _Ev.PAGES_SENT, now)
        return acts

    def abort(self, room: int, reason: str, now: float) -> list[Action]:
        """Local abort (client gone, abort_request, admission failure). No-op if already failed."""
        return self._fail(self._live(room), reason or "aborted", now)

    def report_scope(self, peer: str, incarnation: str | None) -> ReportScope:
        """What a loss report about `peer` at `incarnation` covers here (incarnations.py)."""
        return self._incarnations.scope(peer, incarnation)

    def fail_peer(
        self,
        peer: str,
        reason: str,
        now: float,
        *,
        definitive: bool = True,
        until_recovered: bool = False,
        incarnation: str | None = None,
    ) -> list[Action]:
        """Heartbeat loss or operator fast path: fail every unfinished room tied to `peer`.

        Idempotent: call it on every failed probe past the threshold. For
        `bootstrap_s` a new room on this peer fails at once instead of
        waiting for /route retries or timeouts. `until_recovered` (a
        heartbeat verdict: the heartbeat keeps probing the peer and calls
        `peer_recovered` when it answers) drops the time limit and holds a
        new room for one probe instead (`gate_new_room`): a peer dead for
        longer than `bootstrap_s` is still not asked for /route unprobed.

        `definitive=False` says the peer stopped answering, not that it is
        gone (a heartbeat verdict: a hung process may resume). With a
        one-sided transport such a peer may still write into our pages when
        it wakes up, so its sources are not declared dead: the rooms fail at
        once, ABORT goes out as for any failure, and the pages wait for the
        ack — or for a definitive verdict (the operator saw the pod gone, or
        the instance came back on other addresses). Over tcp a resumed peer's
        frames are dropped by generation, so any verdict settles the sources.

        `incarnation`: which start of the peer the report is about (a pod's
        uid). One this rank never saw changes nothing (`unseen_incarnation`);
        one an address no longer serves (its successor answers there now)
        touches only the rooms and sources still bound to it — no verdict, no
        forgotten registration, nothing of the successor's (incarnations.py).
        """
        scope = self._incarnations.scope(peer, incarnation)
        if scope is ReportScope.UNSEEN:
            return [Dropped(None, "fail_peer", "unseen_incarnation")]
        quarantine = self.info.one_sided and not definitive
        if scope is ReportScope.CURRENT:
            self._verdicts.declare(
                peer,
                reason,
                now,
                until_recovered=until_recovered,
                bootstrap_s=self.settings.bootstrap_s,
            )
            self._registered = {
                e: p for e, p in self._registered.items() if not peer_matches(peer, e, p)
            }
        acts: list[Action] = []
        for r in list(self._rooms.values()):
            sources = list(r.sources.values()) if r.sources else []
            whole_instance = peer_matches(peer, r.peer) and covers(
                scope, incarnation, r.incarnation
            )
            hit = [
                s
                for s in sources
                if whole_instance
                or (
                    peer_matches(peer, s.source.endpoint)
                    and covers(scope, incarnation, s.source.incarnation)
                )
            ]
            if not hit and not whole_instance:
                continue
            for s in hit:
                s.dead = s.dead or not quarantine
            if r.state is KVPoll.Failed:
                acts.extend(self._maybe_release(r))
            else:
                acts.extend(self._fail(r, reason, now))
        return acts

    def peer_recovered(self, peer: str) -> list[int]:
        """`peer` answers again: its verdicts end, whatever their limits, and new
        rooms may use it. Peer liveness decides when (an answer to a request sent
        after the verdict; after a definitive report, from a new start).

        Returns the rooms held for a probe of it, oldest first: they go on
        to fetch /route now.
        """
        self._verdicts.recovered(peer)
        released = self._held_on(peer)
        self._held.difference_update(released)
        return released

    def probe_failed(self, peer: str, now: float) -> list[Action]:
        """A probe of `peer` failed or timed out: the rooms held for it fail."""
        acts: list[Action] = []
        for room in self._held_on(peer):
            r = self._rooms[room]
            acts.extend(self._fail(r, self.peer_verdict(r.peer, now) or "prefill_unreachable", now))
        return acts

    def gate_new_room(self, room: int, now: float) -> PeerGate:
        """A room just added: refuse, hold for a probe, or let it fetch /route.

        Call right after `add_room`. An operator report (the pod is gone or
        not ready) fails the room at once; a heartbeat verdict holds it
        until one probe answers — a peer declared dead a while ago may be
        back, and refusing it until the next regular probe would fail
        requests on a healthy server. Changes nothing when no verdict holds.
        """
        r = self._live(room)
        if r.phase is not DecodePhase.ROUTING:
            return PeerGate()
        if room in self._held:
            return PeerGate(probe=r.peer)
        gate, reason = self._verdicts.gate(r.peer, now)
        if gate is Gate.REFUSE:
            return PeerGate(actions=self._fail(r, reason or "prefill_unreachable", now))
        if gate is Gate.PROCEED:
            return PeerGate()
        self._held.add(room)
        return PeerGate(probe=r.peer)

    def is_held(self, room: int) -> bool:
        return room in self._held

    def peer_verdict(self, peer: str, now: float) -> str | None:
        """The reason `peer` (a prefill instance address) is declared dead, or None."""
        return self._verdicts.reason_for(peer, now)

    def peers_down(self, now: float) -> dict[str, str]:
        """Every peer declared dead now → the reason."""
        return self._verdicts.down(now)

    def _held_on(self, peer: str) -> list[int]:
        return sorted(room for room in self._held if peer_matches(peer, self._rooms[room].peer))

    def _declared_dead(self, r: DecodeRoom, now: float) -> str | None:
        reason = None
        for peer, v in self._verdicts.current(now):
            for s in r.sources.values() if r.sources is not None else ():
                if peer_matches(peer, r.peer, s.source.endpoint):
                    s.dead = True
                    reason = v.reason
        return reason

    def tick(self, now: float) -> list[Action]:
        acts: list[Action] = []
        for r in list(self._rooms.values()):
            if r.phase is DecodePhase.FAILED and r.abort_due is not None and now >= r.abort_due:
                acts.extend(self._resend_aborts(r, now))
            deadline = DECODE.deadlines.get(r.phase)
            if not self._is_due(r, now) or deadline is None:
                continue
            if r.phase is DecodePhase.FAILED:
                acts.extend(self._release(r, _Ev.RELEASE_TIMEOUT, deadline[1]))
            else:
                acts.extend(self._fail(r, deadline[1], now))
        return acts

    # ------------------------------------------------------------- peer input

    def on_message(self, msg: Message, now: float, sender: str | None = None) -> list[Action]:
        """A decoded prefill message. A Status, Ready or AbortAck names its
        source by `rank` only: it counts when `sender` (the endpoint its
        connection proved) is that source's endpoint, so a peer holding the
        token cannot conclude, fail or release another source's room."""
        if isinstance(msg, Status | Ready | AbortAck):
            return self._on_source_message(msg, now, sender)
        return super().on_message(msg, now, sender)

    def _on_source_message(
        self, msg: Status | Ready | AbortAck, now: float, sender: str | None = None
    ) -> list[Action]:
        """A message about one room from one of its sources, of the room's generation."""
        r = self._rooms.get(msg.room)
        if r is None:
            return [Dropped(msg.room, type(msg).__name__, "unknown_room")]
        if msg.generation != r.generation:
            return [Dropped(msg.room, type(msg).__name__, "stale_generation")]
        s = r.sources.get(msg.rank) if r.sources is not None else None
        if s is None:
            return [Dropped(msg.room, type(msg).__name__, "unknown_source")]
        if sender is not None and sender != s.source.endpoint:
            return [Dropped(msg.room, type(msg).__name__, "wrong_sender")]
        return self._source_handlers[type(msg)](self, r, s, msg, now)

    def _on_layout_ack(self, msg: LayoutAck, now: float) -> list[Action]:
        if msg.accepted:
            return []
        self._registered.pop(msg.endpoint, None)
        reason = msg.reason or "layout_rejected"
        acts: list[Action] = []
        for r in list(self._rooms.values()):
            if r.state is not KVPoll.Failed and r.sources is not None:
                if any(s.source.endpoint == msg.endpoint for s in r.sources.values()):
                    acts.extend(self._fail(r, reason, now))
        return acts

    def _on_status(self, r: DecodeRoom, s: SourceState, msg: Status, now: float) -> list[Action]:
        if r.state is KVPoll.Failed:
            # Prefill sends Success only after its writes drained.
            if msg.state is KVPoll.Success:
                s.drained = True
                return self._maybe_release(r)
            return []
        if msg.state is KVPoll.Failed:
            s.poll = (s.poll or Poll(KVPoll.WaitingForInput)).fail(msg.reason or "failed")
            return self._fail(r, f"prefill {msg.rank} failed: {msg.reason or 'no reason'}", now)
        if not s.may_write:
            return self._fail(
                r, f"protocol_violation: {msg.state.name} from {msg.rank} before metadata", now
            )
        s.poll = (s.poll or Poll(KVPoll.WaitingForInput)).update(msg.state)
        if msg.state is KVPoll.Success and not s.drained:
            # Prefill reports Success only once its writes drained.
            s.drained = True
            s.first_token, s.checksum = msg.first_token, msg.checksum
            s.first_logprobs = msg.first_logprobs
        assert r.sources is not None
        states = [x.poll.state if x.poll else KVPoll.WaitingForInput for x in r.sources.values()]
        overall = consensus(states)
        if overall is KVPoll.Success:
            tokens = {x.first_token for x in r.sources.values() if x.first_token is not None}
            if len(tokens) > 1:
                return self._fail(r, f"first_token_mismatch: sources sent {sorted(tokens)}", now)
            return self._complete(r, next(iter(tokens), None))
        if overall is KVPoll.Transferring and r.phase is DecodePhase.WAITING:
            self._step(r, _Ev.TRANSFERRING, now)
        return []

    def _on_ready(self, r: DecodeRoom, s: SourceState, msg: Ready, now: float) -> list[Action]:
        if self.policy is not _PREFILL_COMPLETE:
            reason = (
                f"allocation_policy mismatch: prefill={_PREFILL_COMPLETE}, decode={self.policy}"
            )
            return self._fail(r, reason, now)
        if r.state is not KVPoll.Bootstrapping or s.ready:
            return [Dropped(r.room, "Ready", "duplicate_ready")]
        s.ready = True
        assert r.sources is not None
        if r.phase is not DecodePhase.AWAITING_READY:
            return []
        if not all(x.ready for x in r.sources.values()):
            return []
        self._step(r, _Ev.ALL_READY, now)
        return [PrefillReady(r.room)]

    def _on_abort_ack(
        self, r: DecodeRoom, s: SourceState, msg: AbortAck, now: float
    ) -> list[Action]:
        if r.state is not KVPoll.Failed:
            return [Dropped(r.room, "AbortAck", "room_not_failed")]
        s.drained = True
        return self._maybe_release(r)

    handlers: ClassVar[Mapping[type, Handler]] = {
        LayoutAck: _on_layout_ack,
        # Status, Ready and AbortAck: `on_message` binds them to their sender first.
    }
    # The same for a message of one source of a room, once `_on_source_message` found both.
    _source_handlers: ClassVar[Mapping[type, Callable[..., list[Action]]]] = {
        Status: _on_status,
        Ready: _on_ready,
        AbortAck: _on_abort_ack,
    }

    # ------------------------------------------------------------- internals

    def _step(self, r: DecodeRoom, event: DecodeEvent, now: float) -> None:
        r.phase, fresh = DECODE.step(r.phase, event)
        if fresh:
            self._arm(r, DECODE.deadlines.get(r.phase), now, r.num_tokens)

    def _conclude(self, r: DecodeRoom, event: DecodeEvent) -> None:
        """The room's last step (to COMPLETE or RELEASED): it leaves the table."""
        r.phase, _ = DECODE.step(r.phase, event)
        r.deadline = None
        del self._rooms[r.room]

    def _complete(self, r: DecodeRoom, first_token: int | None) -> list[Action]:
        assert r.sources is not None and r.pages is not None
        checksums = tuple(
            (rank, s.checksum) for rank, s in sorted(r.sources.items()) if s.checksum is not None
        )
        # The source that sampled the first token sent its logprobs with it.
        logprobs = next(
            (s.first_logprobs for _, s in sorted(r.sources.items()) if s.first_logprobs), None
        )
        self._conclude(r, _Ev.SUCCESS)
        return [TransferComplete(r.room, r.rid, r.pages, first_token, checksums, logprobs)]

    def _fail(self, r: DecodeRoom, reason: str, now: float) -> list[Action]:
        if r.state is KVPoll.Failed:
            return []
        self._held.discard(r.room)
        self._step(r, _Ev.FAIL, now)  # under release_s
        r.reason = reason[:1024] or "failed"
        acts: list[Action] = [RoomFailed(r.room, r.rid, r.reason)]
        for s in r.sources.values() if r.sources is not None else ():
            if s.dead or s.succeeded or s.abort_sent:
                continue
            s.abort_sent = True
            acts.append(Send(s.source.endpoint, self._abort_message(r)))
        if self.info.one_sided:
            # A one-sided writer may still be writing: only its ack or death
            # frees the pages, so no release deadline; ABORT goes out again.
            r.deadline = None
            r.abort_due = now + self.settings.abort_resend_interval_s
        acts.extend(self._maybe_release(r))
        return acts

    def _to_prefill(self, r: DecodeRoom, kind: Callable[..., Message], **fields: object) -> Message:
        """A message of this rank about room `r` (`kind` is its type, `fields` the rest)."""
        return kind(
            room=r.room,
            generation=r.generation,
            rid=r.caller_rid,
            decode_rank=self.info.rank,
            decode_endpoint=self.info.endpoint,
            **fields,
        )

    def _claim(
        self, r: DecodeRoom, state: SourceState, kind: Callable[..., Message], **fields: object
    ) -> Send:
        """BOOTSTRAP or metadata for one source of room `r`."""
        message = self._to_prefill(
            r, kind, num_destinations=state.source.num_destinations, **fields
        )
        return Send(state.source.endpoint, message)

    def _abort_message(self, r: DecodeRoom) -> Message:
        return self._to_prefill(r, Abort, reason=r.reason or "aborted")

    def _resend_aborts(self, r: DecodeRoom, now: float) -> list[Action]:
        """One-sided: ABORT again to every source that may still write and has not acked."""
        r.abort_due = now + self.settings.abort_resend_interval_s
        return [
            Send(s.source.endpoint, self._abort_message(r))
            for s in (r.sources.values() if r.sources is not None else ())
            if s.abort_sent and not s.settled
        ]

    def _maybe_release(self, r: DecodeRoom) -> list[Action]:
        if r.state is not KVPoll.Failed or not r.all_settled():
            return []
        sources = r.sources.values() if r.sources is not None else ()
        why = "peer_dead" if any(s.dead for s in sources) else "drained"
        return self._release(r, _Ev.SETTLED, why)

    def _release(self, r: DecodeRoom, event: DecodeEvent, why: str) -> list[Action]:
        self._conclude(r, event)
        if r.pages is None:
            return []
        return [ReleasePages(r.room, r.rid, r.pages, why)]

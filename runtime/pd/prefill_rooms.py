"""Room table of one prefill rank — a sans-IO state machine.

The I/O loop feeds events (decoded messages, engine and transfer progress,
`tick(now)`) and performs the returned `actions`. No clock, no socket.

    Bootstrapping ──every destination's metadata + request opened──► WaitingForInput
    WaitingForInput ──first KV write enqueued──► Transferring
    Transferring ──finish_sending + every write drained──► Success (cleared)
    any live state ──abort / timeout / peer lost / bad claim──► Failed
    Failed ──in-flight writes drained──► cleared

Those are the reported KVPoll states; the room steps through the finer
phases of `room_phases.PREFILL_TRANSITIONS` (UNOPENED, OPENED or COMPUTING,
COMPUTED, AWAITING_KV, SENDING, TRANSFERRING, FINISHING; DRAINING,
CANCELLING), which also fix its deadlines (`PREFILL_DEADLINES`). Under
`prefill_complete` no write may be enqueued, and sending not finished,
before `kv_computed`.

Rules (docs/design.md §5, §7):
- a room is created by the prefill leg (`open_room`) or by the first decode
  claim (metadata / BOOTSTRAP), whichever comes first; both create it in
  Bootstrapping. The room is the pairing key: a rid binds it only when the
  claims carry rids the caller supplied (a worker's own rid is local to it).
  The first claim wins; a disagreeing later claim is refused with a Failed
  status and changes nothing (`prefill_claims`);
- only registered decode endpoints (`prefill_peers`) may claim a room; a
  claim from an unregistered one is answered with a rejected `LayoutAck`
  (decode fails the room and registers again). An ABORT fails a room only
  if its rid matches and its sender is registered or bound to the room;
  any other ABORT is simply acked — nothing of the sender's is in flight.
  Without two caller rids to compare, the sender's binding and generation
  decide instead (`abort_matches`);
- Failed is sticky (first reason kept). A Failed room accepts no new writes
  (`can_send` False), tells each destination once, and sends
  `AbortAck(room, rank, generation)` to each aborting decode rank only once
  its in-flight writes drained. Not drained within `release_s` → one
  `CancelWrites`; a dead peer gets `CancelWrites` at once;
- a concluded room leaves a tombstone: a late claim gets Failed, a late
  `open_room` is refused, an ABORT for an unknown room leaves one too;
- deadlines (`room_phases.PREFILL_DEADLINES`): Bootstrapping within
  `bootstrap_s` (re-armed when the KV is computed under `prefill_complete`),
  WaitingForInput/Transferring within `waiting_s` plus the prompt's per-token
  budget (`waiting_budget_s`), a failed room's writes within `release_s`;
- `prefill_complete` expects BOOTSTRAP before metadata, `early` refuses
  BOOTSTRAP; the Failed status names both policies;
- both legs hold the same prompt: once the leg's `PromptId` and a
  destination's (from its metadata) are known, whichever came first, a
  mismatch fails the room before any write (`prompt_digest`).

I/O contract:
- `open_room(room, rid, num_tokens, now, prompt=..., rid_is_local=...)` when
  the prefill leg arrives (`rid_is_local`: this worker minted the rid, the
  caller sent none);
  `on_message(msg, now)` for each decode→prefill message;
- `StartCompute` comes at open under both policies: the request may run
  (under `early` the group's leader holds it back past the early-start
  budget until every rank is paired: `pd/early_start.py`);
- early: per KV chunk check `can_send(room)` (False until every
  destination's metadata is in) and write what is computed and unsent to
  `destinations(room)`, reporting `writes_enqueued(room, n)`; on
  `SendHeldKV` write the chunks computed before that; the transfer engine
  reports `writes_done(room, n, ok)`; after the last chunk (and
  `SendHeldKV`, if it came later) `finish_sending(room, first_token, checksum)`;
- prefill_complete: call `kv_computed(room)` when done; on `SendHeldKV`
  enqueue the held KV, then `finish_sending`;
- on `ReleaseSource` abort the engine request if still running, else
  release its held pages;
- `fail(room, reason)` for local aborts; `fail_peer(peer, reason)` for a
  lost decode pod; `tick(now)` about every 100 ms.

Pure module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pdcluster.runtime.pd.actions import (
    Action,
    CancelWrites,
    CloseDestination,
    Dropped,
    ReleaseSource,
    RoomFailed,
    RoomSucceeded,
    Send,
    SendHeldKV,
    StartCompute,
)
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.failure_labels import reason_label
from pdcluster.runtime.pd.incarnations import ReportScope, covers
from pdcluster.runtime.pd.kvpoll import KVPoll
from pdcluster.runtime.pd.messages import (
    Abort,
    AbortAck,
    Bootstrap,
    FirstLogprobs,
    KVLayoutRegister,
    LayoutAck,
    Ready,
    Status,
    TransferMeta,
)
from pdcluster.runtime.pd.prefill_claims import (
    Dest,
    DestinationView,
    PrefillRankInfo,
    PrefillRoom,
    abort_matches,
    claim_conflict,
    page_count_problem,
    page_problem,
    rid_conflict,
)
from pdcluster.runtime.pd.prefill_peers import PeerLayouts
from pdcluster.runtime.pd.prefix_reuse import num_sent_tokens, reuse_problem
from pdcluster.runtime.pd.prompt_digest import prompt_problem
from pdcluster.runtime.pd.room_common import (
    Handler,
    RoomLeg,
    RoomRejected,
    RoomStateError,
    RoomTable,
    RoomView,
    UnknownRoom,
    check_int,
    clip_reason,
    peer_matches,
)
from pdcluster.runtime.pd.room_phases import (
    PREFILL,
    PREFILL_HOLDS_SOURCE,
    PrefillEvent,
    PrefillPhase,
)
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd.tombstones import Tombstones
from pdcluster.runtime.spec import AllocationPolicy

_EARLY, _PREFILL_COMPLETE = AllocationPolicy.early, AllocationPolicy.prefill_complete
_Ev = PrefillEvent
# Phases in which a new KV write may be enqueued (until finish_sending).
_SENDING = (PrefillPhase.SENDING, PrefillPhase.TRANSFERRING)


class PrefillRoomTable(RoomTable[PrefillRoom]):
    unknown_room = "is not live on this prefill rank"

    def __init__(self, info: PrefillRankInfo, settings: RoomSettings | None = None) -> None:
        super().__init__(info.compat.allocation_policy, settings)
        self.info = info
        self.peers = PeerLayouts(info.compat, info.token)
        self._tombs = Tombstones(self.settings.tombstone_ttl, self.settings.max_tombstones)

    # ------------------------------------------------------------------ queries

    def tombstone(self, room: int, now: float) -> str | None:
        outcome: str | None = self._tombs.get(room, now)
        return outcome

    def can_send(self, room: int) -> bool:
        """May a new KV write for `room` be enqueued now?"""
        r = self._rooms.get(room)
        return r is not None and r.phase in _SENDING

    def destinations(self, room: int) -> tuple[DestinationView, ...]:
        out = []
        for d in sorted(self._live(room).reachable(), key=lambda d: d.decode_rank):
            layout = self.peers.get(d.endpoint)
            if d.pages is not None and layout is not None:
                out.append(
                    DestinationView(
                        d.decode_rank, d.endpoint, d.generation, d.pages, layout, d.reuse
                    )
                )
        return tuple(out)

    def inflight(self, room: int) -> int:
        count: int = self._live(room).inflight
        return count

    def list_rooms(self, now: float) -> list[RoomView]:
        return [
            self._view(
                r,
                now,
                peers=tuple(sorted(d.endpoint for d in r.dests.values())),
                detail=f"destinations={len(r.dests)}/{r.expected or '?'} inflight={r.inflight}",
            )
            for r in self._rooms.values()
        ]

    # ------------------------------------------------------------- local events

    def open_room(self, leg: RoomLeg, now: float) -> list[Action]:
        """The prefill leg arrived. Raises RoomRejected / RoomError, table unchanged.

        `leg.prompt` is compared with every destination's PromptId.
        """
        room, rid, num_tokens, prompt = leg.room, leg.rid, leg.num_tokens, leg.prompt
        check_int("num_tokens", num_tokens, 1, 1 << 31)
        if prompt is not None and prompt.num_tokens != num_tokens:
            raise RoomStateError(
                f"room {room}: prompt of {prompt.num_tokens} tokens opened as {num_tokens}"
            )
        tomb = self._tombs.get(room, now)
        if tomb is not None:
            raise RoomRejected(f"room {room} already concluded ({tomb})", "room_closed")
        r = self._rooms.get(room)
        if r is None:
            if len(self._rooms) >= self.settings.max_rooms:
                raise RoomRejected(
                    f"prefill rank has {len(self._rooms)} live rooms "
                    f"(limit {self.settings.max_rooms})",
                    "too_many_rooms",
                )
            r = self._new_room(room, None, None, now)
        elif r.phase is not PrefillPhase.UNOPENED:
            raise RoomRejected(f"duplicate room {room}: opened by rid {r.rid!r}", "duplicate_room")
        caller_rid = None if leg.rid_is_local else rid
        if rid_conflict(r, caller_rid) is not None:
            raise RoomRejected(
                f"room {room} is bound to rid {r.caller_rid!r} by decode metadata, not {rid!r}",
                "room_conflict",
            )
        r.rid = rid
        r.caller_rid = r.caller_rid or caller_rid
        r.num_tokens = num_tokens
        r.prompt = prompt
        r.page_keys = leg.page_keys
        # Both policies compute from the moment the leg arrives: waiting for
        # decode's metadata first would put its round trip before the compute.
        # What the policy decides is when the KV may leave (`can_send`).
        self._step(r, _Ev.OPEN_COMPUTE if self.policy is _PREFILL_COMPLETE else _Ev.OPEN, now)
        return [StartCompute(room, rid), *self._after_claim(r, now)]

    def kv_computed(self, room: int, now: float) -> list[Action]:
        """prefill_complete: the prompt's KV is computed and held."""
        if self.policy is not _PREFILL_COMPLETE:
            raise RoomStateError(
                f"kv_computed is for prefill_complete; this rank runs {self.policy}"
            )
        r = self._rooms.get(room)
        if r is None or r.state is KVPoll.Failed:
            return [Dropped(room, "kv_computed", "room_not_live")]
        if not PREFILL.allows(r.phase, _Ev.KV_COMPUTED):
            raise RoomStateError(f"room {room}: kv_computed without a running computation")
        self._step(r, _Ev.KV_COMPUTED, now)
        acts: list[Action] = []
        for d in r.dests.values():
            acts.extend(self._ready(r, d))
        if r.phase is PrefillPhase.SENDING:
            acts.append(SendHeldKV(room))
        return acts

    def writes_enqueued(self, room: int, count: int, now: float) -> list[Action]:
        r = self._live(room)
        if not self.can_send(room):
            raise RoomStateError(f"room {room} is {_describe(r)}: no new writes may be enqueued")
        check_int("count", count, 1, 1 << 31)
        r.inflight += count
        if r.phase is PrefillPhase.SENDING:
            self._step(r, _Ev.FIRST_WRITE, now)
            return [self._status(r, d, KVPoll.Transferring) for d in r.reachable()]
        return []

    def writes_done(self, room: int, count: int, ok: bool, now: float) -> list[Action]:
        r = self._live(room)
        check_int("count", count, 1, r.inflight + 1)
        r.inflight -= count
        if not ok and r.state is not KVPoll.Failed:
            return self._fail(r, "transfer_error", now)
        if r.state is KVPoll.Failed:
            return self._finalize(r, now) if r.inflight == 0 else []
        return self._maybe_succeed(r, now)

    def finish_sending(
        self,
        room: int,
        first_token: int | None,
        checksum: int | None,
        now: float,
        *,
        checksums: Mapping[RankCoord, int] | None = None,
        first_logprobs: FirstLogprobs | None = None,
    ) -> list[Action]:
        """The room's last KV write is enqueued; Success follows once every write drained.

        `checksums` (per decode rank, of the KV written to it) override
        `checksum` in that rank's Success; `first_logprobs` go with the first token.
        """
        r = self._rooms.get(room)
        if r is None or r.state is KVPoll.Failed:
            return [Dropped(room, "finish_sending", "room_not_live")]
        if not PREFILL.allows(r.phase, _Ev.FINISH):
            raise RoomStateError(f"room {room} is {_describe(r)}: cannot finish sending")
        if first_token is not None:
            check_int("first_token", first_token, 0, 1 << 31)
        if checksum is not None:
            check_int("checksum", checksum, 0, 1 << 63)
        for value in (checksums or {}).values():
            check_int("checksum", value, 0, 1 << 63)
        r.checksums = dict(checksums or {})
        r.first_token = first_token
        r.first_logprobs = first_logprobs
        r.checksum = checksum
        self._step(r, _Ev.FINISH, now)
        return self._maybe_succeed(r, now)

    def fail(self, room: int, reason: str, now: float) -> list[Action]:
        """Local failure (abort_request, engine error); a no-op for a concluded room."""
        r = self._rooms.get(room)
        if r is None:
            if self._tombs.get(room, now) is not None:
                return []
            raise UnknownRoom(f"room {room} is not known on this prefill rank")
        return self._fail(r, reason or "aborted", now)

    def fail_peer(
        self, peer: str, reason: str, now: float, incarnation: str | None = None
    ) -> list[Action]:
        """A decode pod is gone: fail every unfinished room writing to it, forget its layout.

        `incarnation`: which start of the pod (its uid). One no decode rank here
        registered with changes nothing; one whose address a successor serves
        now fails only the rooms still writing to it (incarnations.py), and the
        successor's registration stays.
        """
        scope = self.peers.incarnations.scope(peer, incarnation)
        if scope is ReportScope.UNSEEN:
            return [Dropped(None, "fail_peer", "unseen_incarnation")]
        if scope is ReportScope.CURRENT:
            self.peers.forget_matching(peer)
        acts: list[Action] = []
        closed: set[str] = set()
        for r in list(self._rooms.values()):
            hit = [
                d
                for d in r.dests.values()
                if peer_matches(peer, d.endpoint) and covers(scope, incarnation, d.incarnation)
            ]
            if not hit:
                continue
            for d in hit:
                d.dead = True
                if scope is ReportScope.CURRENT and r.inflight and d.endpoint not in closed:
                    # Its writes wait on a connection nobody reads (a successor at
                    # the address would be STALE scope: its connection stays).
                    closed.add(d.endpoint)
                    acts.append(CloseDestination(d.endpoint))
            # Owed AbortAcks stay owed: if the peer is in fact alive (a wrong
            # verdict), a one-sided decode holds its pages until it gets one.
            if r.state is not KVPoll.Failed:
                acts.extend(self._fail(r, reason, now))
            # Writes to a dead peer never drain by themselves.
            if r.phase is PrefillPhase.DRAINING:
                acts.extend(self._cancel(r, now))
        return acts

    def tick(self, now: float) -> list[Action]:
        acts: list[Action] = []
        for r in list(self._rooms.values()):
            if not self._is_due(r, now):
                continue
            if r.phase is PrefillPhase.DRAINING:
                acts.extend(self._cancel(r, now))
            elif (deadline := PREFILL.deadlines[r.phase]) is not None:
                acts.extend(self._fail(r, deadline[1], now))
        self._tombs.prune(now)
        return acts

    # ------------------------------------------------------------- peer input

    def _on_layout(self, msg: KVLayoutRegister, now: float) -> list[Action]:
        outcome = self.peers.register(msg)
        ack = LayoutAck(
            rank=self.info.rank,
            endpoint=self.info.endpoint,
            accepted=outcome.accepted,
            reason=outcome.reason,
        )
        acts: list[Action] = []
        if not outcome.accepted:
            acts.append(Dropped(None, "KVLayoutRegister", outcome.code))
        elif outcome.replaced:
            # Same endpoint, new layout: a restarted decode rank cannot finish
            # the rooms of its previous incarnation.
            for r in list(self._rooms.values()):
                if any(d.endpoint == msg.decode_endpoint for d in r.dests.values()):
                    acts.extend(self._fail(r, "peer_reregistered", now))
        acts.append(Send(msg.decode_endpoint, ack))
        return acts

    def _on_meta(self, msg: TransferMeta, now: float) -> list[Action]:
        if not self.peers.is_authenticated(msg.decode_endpoint, msg.decode_rank):
            return self._unregistered(msg.room, msg.decode_endpoint, "TransferMeta")
        layout = self.peers.get(msg.decode_endpoint)
        assert layout is not None
        bad_pages = page_problem(msg.dst_pages, layout.num_pages)
        no_bootstrap = (
            f"allocation_policy mismatch: prefill={_PREFILL_COMPLETE}, decode={_EARLY} "
            "(metadata without BOOTSTRAP)"
        )
        pages = tuple(msg.dst_pages)
        r = self._rooms.get(msg.room)
        if r is None:
            problem = (
                self._closed(msg.room, now)
                or (no_bootstrap if self.policy is _PREFILL_COMPLETE else bad_pages)
                or self._overloaded()
            )
            if problem is not None:
                return self._reject(msg.room, msg.generation, msg.decode_endpoint, problem)
            r = self._new_room(msg.room, msg.rid, msg.num_destinations, now)
            r.dests[msg.decode_rank] = Dest(
                msg.decode_rank,
                msg.decode_endpoint,
                msg.generation,
                pages,
                msg.prompt,
                msg.reuse,
                incarnation=layout.incarnation,
            )
            return self._after_claim(r, now)
        d = r.dests.get(msg.decode_rank)
        conflict = claim_conflict(
            r, msg.rid, msg.num_destinations, msg.decode_rank, msg.decode_endpoint
        )
        if conflict is None and d is None and self.policy is _PREFILL_COMPLETE:
            conflict = no_bootstrap
        if conflict is None and d is not None and d.generation != msg.generation:
            conflict = f"room_conflict: generation {msg.generation}, room has {d.generation}"
        if conflict is not None:
            return self._reject(msg.room, msg.generation, msg.decode_endpoint, conflict)
        if d is not None and d.pages is not None:
            return [Dropped(msg.room, "TransferMeta", "duplicate_metadata")]
        if bad_pages is not None:
            if d is not None:  # a bound destination cannot be completed with bad pages
                return self._fail(r, bad_pages, now)
            return self._reject(msg.room, msg.generation, msg.decode_endpoint, bad_pages)
        r.expected = msg.num_destinations
        r.caller_rid = r.caller_rid or msg.rid
        if d is None:
            r.dests[msg.decode_rank] = Dest(
                msg.decode_rank,
                msg.decode_endpoint,
                msg.generation,
                pages,
                msg.prompt,
                msg.reuse,
                incarnation=layout.incarnation,
            )
        else:
            d.pages = pages
            d.prompt = msg.prompt
            d.reuse = msg.reuse
        return self._after_claim(r, now)

    def _on_bootstrap(self, msg: Bootstrap, now: float) -> list[Action]:
        if not self.peers.is_authenticated(msg.decode_endpoint, msg.decode_rank):
            return self._unregistered(msg.room, msg.decode_endpoint, "Bootstrap")
        if self.policy is not _PREFILL_COMPLETE:
            mismatch = (
                f"allocation_policy mismatch: prefill={self.policy}, decode={_PREFILL_COMPLETE}"
            )
            return self._reject(msg.room, msg.generation, msg.decode_endpoint, mismatch)
        r = self._rooms.get(msg.room)
        if r is None:
            problem = self._closed(msg.room, now) or self._overloaded()
            if problem is not None:
                return self._reject(msg.room, msg.generation, msg.decode_endpoint, problem)
            r = self._new_room(msg.room, msg.rid, msg.num_destinations, now)
        else:
            conflict = claim_conflict(
                r, msg.rid, msg.num_destinations, msg.decode_rank, msg.decode_endpoint
            )
            if conflict is not None:
                return self._reject(msg.room, msg.generation, msg.decode_endpoint, conflict)
            if msg.decode_rank in r.dests:
                return [Dropped(msg.room, "Bootstrap", "duplicate_bootstrap")]
            r.expected = msg.num_destinations
            r.caller_rid = r.caller_rid or msg.rid
        layout = self.peers.get(msg.decode_endpoint)
        incarnation = None if layout is None else layout.incarnation
        d = Dest(
            msg.decode_rank, msg.decode_endpoint, msg.generation, None, incarnation=incarnation
        )
        r.dests[msg.decode_rank] = d
        return self._ready(r, d) if r.phase is PrefillPhase.COMPUTED else []

    def _on_abort(self, msg: Abort, now: float) -> list[Action]:
        ack = AbortAck(room=msg.room, rank=self.info.rank, generation=msg.generation)
        r = self._rooms.get(msg.room)
        d = r.dests.get(msg.decode_rank) if r is not None else None
        bound = d is not None and d.endpoint == msg.decode_endpoint
        trusted = bound or self.peers.is_authenticated(msg.decode_endpoint, msg.decode_rank)
        if r is None or not abort_matches(r, msg, trusted):
            # Nothing of the sender's is in flight here, so the ack is true
            # whoever asks; only a trusted sender may leave a tombstone (so a
            # prefill leg arriving after the abort is refused).
            acts: list[Action] = [Send(msg.decode_endpoint, ack)]
            if r is None and trusted:
                self._tombs.add(msg.room, now, f"aborted by decode: {msg.reason}")
            elif r is not None:
                acts.append(Dropped(msg.room, "Abort", "foreign_abort"))
            return acts
        if d is not None and bound:
            d.aborted = True
        r.acks[msg.decode_endpoint] = msg.generation
        if r.state is not KVPoll.Failed:
            return self._fail(r, f"aborted by decode: {msg.reason}", now)
        return self._finalize(r, now) if r.inflight == 0 else []

    handlers: ClassVar[Mapping[type, Handler]] = {
        KVLayoutRegister: _on_layout,
        TransferMeta: _on_meta,
        Bootstrap: _on_bootstrap,
        Abort: _on_abort,
    }

    # ------------------------------------------------------------- internals

    def _unregistered(self, room: int, endpoint: str, what: str) -> list[Action]:
        """A claim from an endpoint without a layout: say so, so decode re-registers."""
        ack = LayoutAck(
            rank=self.info.rank,
            endpoint=self.info.endpoint,
            accepted=False,
            reason="unregistered_peer: send KVLayoutRegister first",
        )
        return [Send(endpoint, ack), Dropped(room, what, "unregistered_peer")]

    def _closed(self, room: int, now: float) -> str | None:
        tomb = self._tombs.get(room, now)
        return None if tomb is None else f"room_closed: {tomb}"

    def _overloaded(self) -> str | None:
        if len(self._rooms) < self.settings.max_rooms:
            return None
        return f"prefill_overloaded: {len(self._rooms)} live rooms"

    def _new_room(
        self, room: int, caller_rid: str | None, expected: int | None, now: float
    ) -> PrefillRoom:
        """A room in Bootstrapping; its own rid comes with the prefill leg (`open_room`)."""
        r = PrefillRoom(
            room=room,
            rid=None,
            caller_rid=caller_rid,
            created_at=now,
            deadline=now + self.settings.bootstrap_s,
            expected=expected,
        )
        self._rooms[room] = r
        return r

    def _after_claim(self, r: PrefillRoom, now: float) -> list[Action]:
        # The prompt first: a decode prompt of another length also asks for
        # another page count, and the prompt is the reason worth reporting.
        problem = prompt_problem(r.prompt, (d.prompt for d in r.dests.values()))
        if problem is None:
            problem = page_count_problem(r, self.info.compat.page_size)
        if problem is None:
            problem = self._reuse_problem(r)
        if problem is not None:
            return self._fail(r, problem, now)
        if not (r.has_all_destinations and PREFILL.allows(r.phase, _Ev.ALL_DESTINATIONS)):
            return []
        was = r.phase
        self._step(r, _Ev.ALL_DESTINATIONS, now)
        if was in (PrefillPhase.OPENED, PrefillPhase.COMPUTED):
            return [SendHeldKV(r.room)]
        return []

    def _reuse_problem(self, r: PrefillRoom) -> str | None:
        """Why a destination's reused pages do not match the opened prompt, or None
        (checked once the leg is opened: its page keys come with it)."""
        if r.num_tokens is None:
            return None
        for d in r.dests.values():
            problem = reuse_problem(r.page_keys, r.num_tokens, d.reuse, self.info.compat.page_size)
            if problem is not None:
                return problem
        return None

    def _ready(self, r: PrefillRoom, d: Dest) -> list[Action]:
        if d.ready_sent or d.dead:
            return []
        d.ready_sent = True
        return [Send(d.endpoint, Ready(room=r.room, generation=d.generation, rank=self.info.rank))]

    def _status(self, r: PrefillRoom, d: Dest, state: KVPoll, reason: str | None = None) -> Send:
        return Send(d.endpoint, r.status(d, self.info.rank, state, reason))

    def _reject(self, room: int, generation: int, endpoint: str, reason: str) -> list[Action]:
        status = Status(
            room=room,
            generation=generation,
            rank=self.info.rank,
            state=KVPoll.Failed,
            reason=clip_reason(reason),
        )
        return [Send(endpoint, status), Dropped(room, "claim", reason_label(reason))]

    def _maybe_succeed(self, r: PrefillRoom, now: float) -> list[Action]:
        if not (r.phase is PrefillPhase.FINISHING and r.inflight == 0):
            return []
        holds_source = r.phase in PREFILL_HOLDS_SOURCE
        self._step(r, _Ev.DRAINED, now)
        reached = r.reachable()
        acts: list[Action] = [self._status(r, d, KVPoll.Success) for d in reached]
        rid = r.rid or ""
        # Every destination names the same reused pages (one decode decision).
        page_size = self.info.compat.page_size
        sent = None
        if r.num_tokens is not None:
            n = r.num_tokens
            sent = max((num_sent_tokens(n, d.reuse, page_size) for d in reached), default=0)
        acts.append(RoomSucceeded(r.room, rid, sent))
        if holds_source:
            acts.append(ReleaseSource(r.room, rid))
        self._tombs.add(r.room, now, "succeeded")
        del self._rooms[r.room]
        return acts

    def _fail(self, r: PrefillRoom, reason: str, now: float) -> list[Action]:
        if r.state is KVPoll.Failed:
            return []
        holds_source = r.phase in PREFILL_HOLDS_SOURCE
        self._step(r, _Ev.FAIL, now)  # DRAINING, under release_s
        r.reason = clip_reason(reason)
        acts: list[Action] = [RoomFailed(r.room, r.rid, r.reason)]
        for d in r.reachable():
            if not d.aborted:
                acts.append(self._status(r, d, KVPoll.Failed, r.reason))
        if r.inflight == 0:
            acts.extend(self._finalize(r, now, holds_source))
        return acts

    def _cancel(self, r: PrefillRoom, now: float) -> list[Action]:
        """A failed room's writes will not drain by themselves: ask the transfer engine."""
        self._step(r, _Ev.CANCEL, now)
        return [CancelWrites(r.room)]

    def _finalize(self, r: PrefillRoom, now: float, holds_source: bool = True) -> list[Action]:
        """A failed room with nothing in flight: ack the aborts, free the source, forget it.

        `holds_source`: StartCompute was emitted (always so once writes were in flight).
        """
        self._step(r, _Ev.DRAINED, now)
        acts: list[Action] = [
            Send(endpoint, AbortAck(room=r.room, rank=self.info.rank, generation=generation))
            for endpoint, generation in r.acks.items()
        ]
        if holds_source and r.rid is not None:
            acts.append(ReleaseSource(r.room, r.rid))
        self._tombs.add(r.room, now, r.reason or "failed")
        del self._rooms[r.room]
        return acts

    def _step(self, r: PrefillRoom, event: PrefillEvent, now: float) -> None:
        r.phase, fresh = PREFILL.step(r.phase, event)
        if fresh:
            self._arm(r, PREFILL.deadlines.get(r.phase), now, r.num_tokens or 0)


def _describe(r: PrefillRoom) -> str:
    name: str = r.state.name
    return name + (" (finished)" if r.phase is PrefillPhase.FINISHING else "")

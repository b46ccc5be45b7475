"""Decode rank agent: finds the prefill ranks, receives KV, watches their health.

Per room on this rank: the leader opens it (`GroupOpen`), this rank fetches
the prefill instance's topology from its bootstrap server (async, cached —
the scheduler never waits on it), checks compatibility, resolves its sources
with `PDTopology`, and once the leader reserved pages (`GroupPages`) sends
them to every source. KV frames land through `KVReceiver`, which writes only
while `_receiving` maps the room to this exact generation: a late frame of a
failed or finished room is dropped, never written.

Every room this rank knew ends with exactly one `released` report, sent when
the room leaves the table (after success, or after failure once every source
is settled), so the leader frees pages only when no rank can still be written.
Whatever path ends the room (success, abort, timeout, a heartbeat or operator
verdict), `released` also waits until no frame of it is still being scattered
into its pages: a frame already past resolve when the room failed finishes
before the pages can go to another request (`_sweep`, `release_fenced`).
A room every source concluded reports `complete` only once no frame of it
is still landing either (`_complete`, `complete_fenced`): the engine reads
those pages next, and the byte count must see every write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo
from pdcluster.runtime.pd.compat import CompatError, check_compat
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.decode_rooms import DecodeRankInfo, DecodeRoomTable
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.incarnations import ReportScope
from pdcluster.runtime.pd.instance_counts import failure_key
from pdcluster.runtime.pd.messages import Abort, AbortAck
from pdcluster.runtime.pd.peer_liveness import (
    CheckRestart,
    DeclareUnreachable,
    DropSockets,
    FailHeldRooms,
    FailPeerRooms,
    ForgetIdle,
    ForgetRoute,
    HeartbeatTracker,
    LivenessAction,
    PeerAnswers,
    PeerLiveness,
    ReleaseRestarted,
    ResumeHeld,
    StartProbe,
)
from pdcluster.runtime.pd.prefix_reuse import ReusedPrefix, first_sent_token
from pdcluster.runtime.pd.room_common import RoomError
from pdcluster.runtime.pd.topology import (
    DpRankConflict,
    KVSlice,
    ModelShape,
    PDTopology,
    TopologyError,
)
from pdcluster.runtime.pd_worker.agent import AgentContext, RankAgent, make_nixl_agent
from pdcluster.runtime.pd_worker.bootstrap_client import (
    BootstrapAuthError,
    BootstrapError,
    BootstrapNotReady,
    BootstrapPool,
)
from pdcluster.runtime.pd_worker.group import (
    GroupFail,
    GroupFailPeer,
    GroupOpen,
    GroupPages,
)
from pdcluster.runtime.spec import KVDtype, TransferBackend
from pdcluster.runtime.telemetry.request_log import request_fields
from pdcluster.runtime.transfer.checksum import CHECKSUM_MISMATCH, CHECKSUM_MISSING
from pdcluster.runtime.transfer.frames import FrameError, decode_header
from pdcluster.runtime.transfer.identity import kv_source_ok
from pdcluster.runtime.transfer.page_checksum import compute_kv_checksum, token_slots
from pdcluster.runtime.transfer.page_span import num_written_tokens
from pdcluster.runtime.transfer.tcp import KVReceiver

log = logging.getLogger("pdcluster.pd.decode")

# How long one sweep waits for a frame still being written into a finished
# room's pages before leaving `released` to a later tick (seconds).
FENCE_WAIT_S = 0.05
# A room's (generation, page table) while its frames are taken.
_Receiving = tuple[int, tuple[int, ...]]


@dataclass
class _Room:
    rid: str
    peer: str
    prefill_dp: int | None
    generation: int
    num_tokens: int
    resolved: bool = False
    pending_pages: list[int] | None = None
    pending_reuse: ReusedPrefix | None = None
    # Leading pages this rank already holds for the prompt (nothing is sent for them).
    reuse: ReusedPrefix | None = None
    # What each prefill rank writes here (its KV slice), for the page checksums.
    slices: dict[RankCoord, KVSlice] = field(default_factory=dict)


class DecodeAgent(RankAgent):
    def __init__(self, ctx: AgentContext, pool: Any, shm_pool_path: str | None) -> None:
        super().__init__(ctx, pool)
        self.one_sided = ctx.transfer.backend.is_one_sided
        # nixl: prefill ranks WRITE into this pool through our agent (registered here).
        self.nixl_agent = (
            make_nixl_agent(self.address, pool)
            if ctx.transfer.backend is TransferBackend.nixl
            else None
        )
        self.table = DecodeRoomTable(
            DecodeRankInfo(
                rank=ctx.coord,
                endpoint=self.address,
                compat=ctx.compat,
                token=ctx.token,
                num_pages=ctx.num_pages,
                layers=ctx.layers,
                heads=ctx.heads,
                shm_pool_path=shm_pool_path if self.one_sided else None,
                one_sided=self.one_sided,
                nixl=None if self.nixl_agent is None else self.nixl_agent.region(),
                incarnation=ctx.incarnation,
            ),
            ctx.room_settings,
        )
        # room -> (generation, pages) while frames for it may be written here.
        self._receiving: dict[int, _Receiving] = {}
        self.receiver = KVReceiver(
            pool,
            self._resolve,
            on_failure=lambda room, gen, reason: self.post(
                lambda: self._fail(room, _transfer_reason(reason))
            ),
            require_checksum=bool(ctx.transfer.checksum),
        )
        self.endpoint.on_kv = self.receiver.on_kv
        # room -> the prefill rank endpoints whose KV it takes: a frame for the
        # room from any other connection is dropped ("kv_wrong_source").
        self._kv_sources: dict[int, frozenset[str]] = {}
        self.endpoint.accept_kv = self._accept_kv
        self.rooms: dict[int, _Room] = {}
        # Rooms out of the table whose `complete` or `released` waits for a write in flight.
        self._fenced: set[int] = set()
        # Rooms every source concluded, whose `complete` waits for that write.
        self._completing: dict[int, tuple[A.TransferComplete, _Receiving | None]] = {}
        self.bootstrap = BootstrapPool(ctx.token or None)
        hb = ctx.transfer.heartbeat
        # What this rank decides about its prefill peers; it only performs.
        self.liveness = PeerLiveness(
            HeartbeatTracker(hb.interval_seconds, hb.failure_threshold, idle_s=hb.idle_seconds),
            bootstrap_s=ctx.room_settings.bootstrap_s,
            one_sided=self.one_sided,
        )

    def close(self) -> None:
        super().close()
        if self.nixl_agent is not None:
            self.nixl_agent.close()

    # ------------------------------------------------------------ KV in
    def _accept_kv(self, sender: str, header: bytes) -> bool:
        # Endpoint I/O thread; dict reads are atomic.
        try:
            room = decode_header(header).room
        except FrameError:
            return True  # garbage: the receiver rejects and counts it
        return kv_source_ok(sender, self._kv_sources.get(room))

    def _resolve(self, room: int, generation: int) -> tuple[int, ...] | None:
        entry = self._receiving.get(room)  # endpoint I/O thread; dict reads are atomic
        if entry is None or entry[0] != generation:
            return None
        return entry[1]

    def _missing_kv(self, room: int, entry: _Receiving | None) -> str | None:
        """Why the room's KV is incomplete although every source said Success, or None.

        `entry`: the room's (generation, pages) while it was receiving.
        Every source sends Success after its frames, on the same connection,
        so they were all placed by now — unless the connection dropped and
        came back in between (libzmq then loses messages silently). Decoding
        from pages that were never written would be garbage nobody notices.
        """
        r = self.rooms.get(room)
        if self.one_sided or r is None or entry is None:
            return None  # shm writes land in place; nothing travels to be lost
        ctx = self.ctx
        itemsize = KVDtype(ctx.compat.kv_dtype).itemsize
        layers, heads = ctx.layers[1] - ctx.layers[0], ctx.heads[1] - ctx.heads[0]
        first = first_sent_token(r.reuse, ctx.page_size)
        num_sent = num_written_tokens(
            r.num_tokens, first, ctx.page_size, self.pool.shape.whole_pages
        )
        expected = num_sent * layers * 2 * heads * ctx.head_dim * itemsize
        progress = self.receiver.progress(room, entry[0])
        got = 0 if progress is None else progress.nbytes
        if got == expected:
            return None
        return f"incomplete_transfer: received {got} of {expected} KV bytes"

    def _bad_checksum(self, act: A.TransferComplete) -> str | None:
        """With `transfer.checksum`: why the pages do not hold what the sources
        sent (`checksum_mismatch`, `checksum_missing`), or None.

        Computed over this rank's pages as the room's page table names them,
        after every write landed (tcp and shm alike), against each source's
        checksum of its own source pages (see `transfer.page_checksum`).
        """
        r = self.rooms.get(act.room)
        if not self.ctx.transfer.checksum or r is None:
            return None
        if not act.checksums:
            return CHECKSUM_MISSING
        ps = self.ctx.page_size
        for rank, expected in act.checksums:
            s = r.slices.get(rank)
            if s is None:
                continue  # a replicated-KV source sends nothing real to check
            start, end = s.token_range(r.num_tokens, ps)
            # The source sends (and sums) only what follows the reused pages.
            start = max(start, first_sent_token(r.reuse, ps))
            if start >= end:
                continue
            local = s.decode_local
            slots = token_slots(act.pages, start, end, ps)
            got = compute_kv_checksum(self.pool, range(*local.layers), slots, local.heads)
            if got != expected:
                log.warning(
                    "decode rank %s: room %s: pages from prefill rank %s hash to %08x, sent %08x",
                    self.ctx.coord,
                    act.room,
                    rank,
                    got,
                    expected,
                )
                return CHECKSUM_MISMATCH
        return None

    def _stop_receiving(self, room: int) -> bool:
        """Stop accepting the room's frames; True once none of them is being written.

        Whatever took the room out of `_receiving` first (a failure pops it at
        once, so no new frame is written), a frame already past resolve may
        still be landing in its pages: until it returned, the pages must not
        be reported released. A short wait covers the usual case; a write
        that takes longer is fenced: the caller retries on a later tick.
        """
        self._receiving.pop(room, None)
        if not self.receiver.quiesce(room, timeout=FENCE_WAIT_S):
            return False
        self.receiver.clear(room)
        return True

    # ------------------------------------------------------------ actions
    def perform(self, acts: list[Any]) -> None:
        for act in acts:
            if isinstance(act, A.Send):
                if isinstance(act.message, Abort):
                    self.ctx.stats["abort_sent"] += 1
                self.send(act.endpoint, act.message)
            elif isinstance(act, A.TransferComplete):
                self._completing[act.room] = (act, self._receiving.get(act.room))
                self._complete(act.room)
            elif isinstance(act, A.RoomFailed):
                self._receiving.pop(act.room, None)
                self._report_failed(act.room, act.rid, act.reason)
            elif isinstance(act, A.ReleasePages):
                # `released` itself waits in _sweep until no write is in flight.
                self._receiving.pop(act.room, None)
            elif isinstance(act, A.PrefillReady):
                self.report(act.room, "ready")
            elif isinstance(act, A.Dropped):
                self.ctx.stats[f"dropped:{act.reason}"] += 1

    def _complete(self, room: int) -> None:
        """Report `complete` once no frame of the room is still landing in its pages.

        Every source said Success, so nothing more is accepted for the room;
        a frame already past resolve (one a source sent after its Success)
        may still be scattering, and the engine must not read the pages, nor
        the checks below judge them, before it returned: until then the room
        waits here and a later tick retries (`complete_fenced`).
        """
        act, entry = self._completing[room]
        self._receiving.pop(room, None)
        if not self.receiver.quiesce(room, timeout=FENCE_WAIT_S):
            if room not in self._fenced:
                self._fenced.add(room)
                self.ctx.stats["complete_fenced"] += 1
            return
        self._fenced.discard(room)
        del self._completing[room]
        missing = self._missing_kv(room, entry)  # before `clear` drops the byte count
        self.receiver.clear(room)
        if missing is None:
            missing = self._bad_checksum(act)
        if missing is not None:
            self._report_failed(room, act.rid, missing)
            return
        self.report(
            room, "complete", first_token=act.first_token, first_logprobs=act.first_logprobs
        )

    def _report_failed(self, room: int, rid: str | None, reason: str) -> None:
        log.warning(
            "decode rank %s: room %s rid %s failed: %s",
            self.ctx.coord,
            room,
            rid,
            reason,
            extra=request_fields(room, rid),
        )
        self.ctx.stats[failure_key(reason)] += 1
        self.report(room, "failed", reason)

    def _sweep(self, room: int) -> None:
        """Report `released` once the room left this rank's table and no frame
        of it is still being written into its pages (else a later tick retries)."""
        if room in self._completing:
            self._complete(room)
            if room in self._completing:
                return  # `complete` first, once its frames landed
        if room in self.rooms and room not in self.table:
            if not self._stop_receiving(room):
                if room not in self._fenced:
                    self._fenced.add(room)
                    self.ctx.stats["release_fenced"] += 1
                return
            self._fenced.discard(room)
            del self.rooms[room]
            self._kv_sources.pop(room, None)
            self.report(room, "released")

    def fail_room(self, room: int, reason: str, now: float) -> None:
        self._fail(room, reason)

    def _fail(self, room: int, reason: str) -> None:
        if room in self.table:
            self.perform(self.table.abort(room, reason, time.monotonic()))
        self._sweep(room)

    # ------------------------------------------------------------ events
    def on_message(self, msg: Any, now: float, sender: str | None = None) -> None:
        if isinstance(msg, AbortAck):
            self.ctx.stats["abort_ack_received"] += 1
        self.perform(self.table.on_message(msg, now, sender))
        room = getattr(msg, "room", None)
        if room is not None:
            self._sweep(room)
        else:
            for r in list(self.rooms):
                self._sweep(r)

    def _on_pages(self, msg: GroupPages, now: float) -> None:
        r = self.rooms.get(msg.room)
        if r is None or msg.room not in self.table:
            self._sweep(msg.room)
            return
        if r.resolved:
            self._assign(msg.room, list(msg.pages), now, msg.reuse)
        else:
            r.pending_pages = list(msg.pages)
            r.pending_reuse = msg.reuse

    def _on_fail(self, msg: GroupFail, now: float) -> None:
        self._fail(msg.room, msg.reason)

    def _on_fail_peer(self, msg: GroupFailPeer, now: float) -> None:
        # `gone`: the operator saw the pod deleted or exited, nothing of it can
        # write any more. Otherwise (NotReady) it may be hung and resume: on a
        # one-sided transport its rooms' pages stay quarantined like after a
        # heartbeat verdict, until it acks, restarts elsewhere or is gone.
        scope = self.table.report_scope(msg.peer, msg.incarnation)
        if scope is not ReportScope.CURRENT:
            # About a start of the peer this rank never saw, or one a successor
            # replaced at the same address: nothing of the successor's (its
            # connections, its cached route, new rooms) is touched.
            self.ctx.stats[f"fail_peer_{scope.value}"] += 1
            log.info(
                "decode rank %s: report about %s incarnation %s is %s here",
                self.ctx.coord,
                msg.peer,
                msg.incarnation,
                scope.value,
            )
            if scope is ReportScope.STALE:
                self.perform(
                    self.table.fail_peer(
                        msg.peer, msg.reason, now, definitive=msg.gone, incarnation=msg.incarnation
                    )
                )
                self._sweep_all()
            return
        self._peer_lost(msg.peer, msg.reason, now, definitive=msg.gone, incarnation=msg.incarnation)

    def _open(self, msg: GroupOpen, now: float) -> None:
        try:
            gen = self.table.add_room(msg.leg(), msg.peer, now)
        except RoomError as err:
            self.report(msg.room, "failed", f"rejected: {err}")
            self.report(msg.room, "released")
            return
        self.rooms[msg.room] = _Room(msg.rid, msg.peer, msg.prefill_dp, gen, msg.num_tokens)
        self.liveness.watch(msg.peer, now)
        gate = self.table.gate_new_room(msg.room, now)
        if gate.actions:
            # The operator reported it gone (or not ready): fail now rather
            # than retry /route against it; a probe soon tells whether it is
            # back for the next room.
            self.liveness.hold(msg.peer, now)
            self.perform(gate.actions)
            self._sweep(msg.room)
            return
        if gate.probe is not None:
            # Declared dead by the heartbeat: it may be back already. Held
            # rooms share one probe, started now (or the one in flight).
            self.ctx.stats["room_held_for_probe"] += 1
            log.info(
                "decode rank %s: room %d held for a probe of %s",
                self.ctx.coord,
                msg.room,
                gate.probe,
            )
            self.liveness.hold(gate.probe, now)
            self.act(self.liveness.start_probes(now), now)
            return
        self._fetch_route(msg.room, msg.peer, now)

    def _fetch_route(self, room: int, peer: str, now: float) -> None:
        client = self.bootstrap.get(peer)
        cached = client.cached_instance
        if cached is not None:
            self._resolve_room(room, cached, None)
            return
        wait_s = self.ctx.room_settings.bootstrap_s

        def done(info: Any, err: BaseException | None) -> None:
            if err is None:
                # An answer from /route is as good as a probe (`now`: when it was asked).
                self.post(
                    lambda: self.act(self.liveness.on_route_answer(peer, now), time.monotonic())
                )
            self.post(lambda: self._resolve_room(room, info, err))

        self.aio.submit(client.instance(wait_s=wait_s), done)

    def _resolve_room(
        self, room: int, info: InstanceInfo | None, err: BaseException | None
    ) -> None:
        r = self.rooms.get(room)
        if r is None or room not in self.table:
            self._sweep(room)
            return
        if err is not None or info is None:
            self._fail(room, f"{_bootstrap_reason(err)}: {err}")
            return
        try:
            check_compat(info.compat, self.ctx.compat, ours_name="prefill", theirs_name="decode")
            topo = PDTopology(
                info.shape,
                self.ctx.shape,
                ModelShape(self.ctx.num_layers, self.ctx.num_kv_heads),
            )
            # The instance's own dp size decides; the worker's entry check used the manifest's.
            prefill_dp = topo.prefill_dp_for_room(room, r.prefill_dp)
            slices = topo.sources(self.ctx.coord, prefill_dp)
        except DpRankConflict as err1:
            self._fail(room, str(err1))
            return
        except CompatError as err2:
            self._fail(room, f"incompatible: {err2}")
            return
        except TopologyError as err3:
            self._fail(room, f"unsupported_topology: {err3}")
            return
        endpoints = {a.rank: a.endpoint for a in info.ranks}
        incarnations = {a.rank: a.incarnation for a in info.ranks}
        sources = []
        for prefill_rank in dict.fromkeys(s.prefill_rank for s in slices):
            endpoint = endpoints.get(prefill_rank)
            if endpoint is None:
                self._fail(room, f"bootstrap_error: no address for prefill rank {prefill_rank}")
                return
            sources.append(
                Source(
                    prefill_rank,
                    endpoint,
                    topo.num_destinations(prefill_rank),
                    incarnations.get(prefill_rank),
                )
            )
        # One slice per prefill rank (its layers and heads in common with ours).
        per_rank = [s.prefill_rank for s in slices]
        r.slices = {
            s.prefill_rank: s
            for s in slices
            if not s.is_dummy and per_rank.count(s.prefill_rank) == 1
        }
        now = time.monotonic()
        self._kv_sources[room] = frozenset(s.endpoint for s in sources)
        self.perform(self.table.resolve(room, sources, now, info.incarnation))
        r.resolved = True
        if r.pending_pages is not None and room in self.table:
            pages, r.pending_pages = r.pending_pages, None
            self._assign(room, pages, now, r.pending_reuse)
        self._sweep(room)

    def _assign(
        self, room: int, pages: list[int], now: float, reuse: ReusedPrefix | None = None
    ) -> None:
        r = self.rooms[room]
        r.reuse = reuse
        # Start accepting frames before any source can know the pages. The
        # reused pages are other sequences' too: the receiver sees them as -1,
        # so a frame aimed at them is refused (`bad_page_table`, the room
        # fails) instead of written.
        num_reused = 0 if reuse is None else reuse.num_pages
        self._receiving[room] = (r.generation, (-1,) * num_reused + tuple(pages[num_reused:]))
        try:
            self.perform(self.table.assign_pages(room, pages, now, reuse))
        except RoomError as err:
            self._receiving.pop(room, None)
            self._fail(room, f"rejected: {err}")
            return
        self._sweep(room)

    # ------------------------------------------------------------ liveness
    def tick(self, now: float) -> None:
        self.perform(self.table.tick(now))
        for room in list(self.rooms):
            self._sweep(room)
        in_use = {r.peer for r in self.rooms.values()}
        self.act(self.liveness.tick(now, in_use), now)

    def act(self, acts: list[LivenessAction], now: float) -> None:
        """Perform what `PeerLiveness` decided, in order."""
        for act in acts:
            _LIVENESS_HANDLERS[type(act)](self, act, now)

    def _start_probe(self, act: StartProbe, now: float) -> None:
        peer = act.peer

        def done(start: str | None, err: BaseException | None) -> None:
            ok = start is not None and err is None
            self.post(lambda: self._on_probe(peer, ok, start or None))

        self.aio.submit(self.bootstrap.get(peer).probe(act.timeout_s), done)

    def _on_probe(self, peer: str, ok: bool, start: str | None) -> None:
        # `start`: which start of the prefill answered; a new one ends an
        # operator's definitive report at once (peer_liveness.py).
        now = time.monotonic()
        self.act(self.liveness.on_probe(peer, ok, now, start), now)

    def _fail_held(self, act: FailHeldRooms, now: float) -> None:
        self.perform(self.table.probe_failed(act.peer, now))
        self._sweep_all()

    def _unreachable(self, act: DeclareUnreachable, now: float) -> None:
        log.warning(
            "decode rank %s: prefill %s unreachable; failing its rooms", self.ctx.coord, act.peer
        )
        self.ctx.stats["peer_dead"] += 1
        # Unreachable is not gone: a hung process may wake up and write.
        # New rooms on it are held for a probe until one finds it answering.
        self._peer_lost(
            act.peer, "prefill_unreachable", now, definitive=False, until_recovered=True
        )

    def _answers(self, act: PeerAnswers, now: float) -> None:
        log.info("decode rank %s: prefill %s answers again", self.ctx.coord, act.peer)

    def _forget_route(self, act: ForgetRoute, now: float) -> None:
        self.bootstrap.invalidate(act.peer)

    def _resume_held(self, act: ResumeHeld, now: float) -> None:
        released = [room for peer in act.peers for room in self.table.peer_recovered(peer)]
        now = time.monotonic()
        for room in released:
            r = self.rooms.get(room)
            if r is not None:
                self._fetch_route(room, r.peer, now)

    def _drop_sockets(self, act: DropSockets, now: float) -> None:
        for endpoint in act.endpoints:
            self.endpoint.drop_peer(endpoint)

    def _fail_peer_rooms(self, act: FailPeerRooms, now: float) -> None:
        self.perform(
            self.table.fail_peer(
                act.peer,
                act.reason,
                now,
                definitive=act.definitive,
                until_recovered=act.until_recovered,
                incarnation=act.incarnation,
            )
        )
        self._sweep_all()

    def _forget_idle(self, act: ForgetIdle, now: float) -> None:
        log.info("decode rank %s: prefill %s idle; no longer probed", self.ctx.coord, act.peer)
        self.ctx.stats["peer_idle_dropped"] += 1
        self.bootstrap.discard(act.peer)

    def _peer_lost(
        self,
        peer: str,
        reason: str,
        now: float,
        *,
        definitive: bool,
        until_recovered: bool = False,
        incarnation: str | None = None,
    ) -> None:
        """Heartbeat verdict or the operator's fast path: fail the rooms, forget the peer."""
        routes = {}
        for watched in self.liveness.watched_by(peer):
            cached = self.bootstrap.get(watched).cached_instance
            routes[watched] = [] if cached is None else [r.endpoint for r in cached.ranks]
        acts = self.liveness.lost(
            peer,
            reason,
            now,
            definitive=definitive,
            until_recovered=until_recovered,
            rooms=[view.peers for view in self.table.list_rooms(now)],
            routes=routes,
            incarnation=incarnation,
        )
        self.act(acts, now)

    def _check_restarted(self, act: CheckRestart, now: float) -> None:
        """A quarantined instance answers again: same process (it will ack) or a new one?"""
        peer = act.peer
        client = self.bootstrap.get(peer)

        def done(info: InstanceInfo | None, err: BaseException | None) -> None:
            self.post(lambda: self._on_restart_check(peer, info))

        self.aio.submit(client.instance(wait_s=self.ctx.room_settings.bootstrap_s), done)

    def _on_restart_check(self, peer: str, info: InstanceInfo | None) -> None:
        if info is None or not self.liveness.is_quarantined(peer):
            return  # not answering /route yet (the next probe retries), or settled meanwhile
        now = time.monotonic()
        self.act(self.liveness.restart_checked(peer, [rank.endpoint for rank in info.ranks]), now)
        # The same endpoints answer: the same process resumed and will ack. Keep
        # watching while a room still waits on them (the answer may be stale).
        waiting = {e for view in self.table.list_rooms(now) for e in view.peers[1:]}
        self.liveness.keep_quarantined(peer, waiting)
        self._sweep_all()

    def _release_restarted(self, act: ReleaseRestarted, now: float) -> None:
        # Registered again elsewhere: the process that held our pages is gone.
        log.info("decode rank %s: %s restarted; releasing its pages", self.ctx.coord, act.endpoint)
        self.endpoint.drop_peer(act.endpoint)
        self.perform(self.table.fail_peer(act.endpoint, "prefill_restarted", now))

    def _sweep_all(self) -> None:
        for room in list(self.rooms):
            self._sweep(room)

    def peers_down(self) -> dict[str, str]:
        """Prefill peers declared dead now → why (any thread): new rooms on them
        fail at once (operator report) or wait for one probe (heartbeat)."""
        with self.lock:
            return self.table.peers_down(time.monotonic())

    def table_views(self, now: float) -> list[dict[str, Any]]:
        return [asdict(v) | {"rank": str(self.ctx.coord)} for v in self.table.list_rooms(now)]


def _bootstrap_reason(err: BaseException | None) -> str:
    # Distinct labels: an instance still registering its ranks, a token
    # problem and a server nobody answers call for different fixes.
    if isinstance(err, BootstrapNotReady):
        return "prefill_not_ready"
    if isinstance(err, BootstrapAuthError):
        return "bootstrap_unauthorized"
    if isinstance(err, BootstrapError):
        return "bootstrap_unreachable"
    return "bootstrap_error"


def _transfer_reason(reason: str) -> str:
    # A checksum failure is its own reason (metric label, client message), not a
    # generic transfer error: it says the bytes arrived but were corrupted.
    if reason in (CHECKSUM_MISMATCH, CHECKSUM_MISSING):
        return reason
    return f"transfer_failed: {reason}"


# The group commands a decode rank follows.
DecodeAgent.group_handlers = {
    GroupOpen: DecodeAgent._open,
    GroupPages: DecodeAgent._on_pages,
    GroupFail: DecodeAgent._on_fail,
    GroupFailPeer: DecodeAgent._on_fail_peer,
}

_LIVENESS_HANDLERS: dict[type, Callable[[DecodeAgent, Any, float], None]] = {
    StartProbe: DecodeAgent._start_probe,
    FailHeldRooms: DecodeAgent._fail_held,
    DeclareUnreachable: DecodeAgent._unreachable,
    PeerAnswers: DecodeAgent._answers,
    ForgetRoute: DecodeAgent._forget_route,
    ResumeHeld: DecodeAgent._resume_held,
    CheckRestart: DecodeAgent._check_restarted,
    DropSockets: DecodeAgent._drop_sockets,
    FailPeerRooms: DecodeAgent._fail_peer_rooms,
    ReleaseRestarted: DecodeAgent._release_restarted,
    ForgetIdle: DecodeAgent._forget_idle,
}

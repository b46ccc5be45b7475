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
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo
from pdcluster.runtime.pd.compat import CompatError, check_compat
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.decode_rooms import DecodeRankInfo, DecodeRoomTable
from pdcluster.runtime.pd.decode_sources import Source
from pdcluster.runtime.pd.heartbeat import HeartbeatTracker, Verdict
from pdcluster.runtime.pd.instance_counts import failure_key
from pdcluster.runtime.pd.room_common import RoomError, peer_matches
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
    GroupMessage,
    GroupOpen,
    GroupPages,
)
from pdcluster.runtime.spec import KVDtype, TransferBackend
from pdcluster.runtime.transfer.checksum import CHECKSUM_MISMATCH, CHECKSUM_MISSING
from pdcluster.runtime.transfer.frames import FrameError, decode_header
from pdcluster.runtime.transfer.identity import kv_source_ok
from pdcluster.runtime.transfer.page_checksum import compute_kv_checksum, token_slots
from pdcluster.runtime.transfer.tcp import KVReceiver

log = logging.getLogger("pdcluster.pd.decode")

# How long one sweep waits for a frame still being written into a finished
# room's pages before leaving `released` to a later tick (seconds).
FENCE_WAIT_S = 0.05


@dataclass
class _Room:
    rid: str
    peer: str
    prefill_dp: int | None
    generation: int
    num_tokens: int
    resolved: bool = False
    pending_pages: list[int] | None = None
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
            ),
            ctx.room_settings,
        )
        # room -> (generation, pages) while frames for it may be written here.
        self._receiving: dict[int, tuple[int, tuple[int, ...]]] = {}
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
        # Rooms out of the table whose `released` waits for a write in flight.
        self._fenced: set[int] = set()
        self.bootstrap = BootstrapPool(ctx.token or None)
        hb = ctx.transfer.heartbeat
        self.heartbeat = HeartbeatTracker(
            hb.interval_seconds, hb.failure_threshold, idle_s=hb.idle_seconds
        )
        # peer -> when its probe in flight started.
        self._probing: dict[str, float] = {}
        # fail_peer target (as given) -> when it was declared lost. Only a probe
        # that *started* later may revive it: one already in flight when the
        # operator reported the pod gone proves nothing.
        self._lost_at: dict[str, float] = {}
        # Heartbeat peer -> when its probes declared it dead. Kept (unlike
        # `_lost_at`) until it answers again: a restart can take longer than
        # `bootstrap_s`, and a fresh /route answer must still revive it then,
        # or its next death would go unreported (STILL_DEAD, no verdict).
        self._dead_at: dict[str, float] = {}
        # shm only: prefill instance -> rank endpoints it had when it stopped
        # answering. Pages its rooms held stay quarantined until it acks, or
        # comes back on other endpoints (the old process is gone).
        self._quarantined: dict[str, set[str]] = {}

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

    def _missing_kv(self, room: int) -> str | None:
        """Why the room's KV is incomplete although every source said Success, or None.

        Every source sends Success after its frames, on the same connection,
        so they were all placed by now — unless the connection dropped and
        came back in between (libzmq then loses messages silently). Decoding
        from pages that were never written would be garbage nobody notices.
        """
        r = self.rooms.get(room)
        entry = self._receiving.get(room)
        if self.one_sided or r is None or entry is None:
            return None  # shm writes land in place; nothing travels to be lost
        ctx = self.ctx
        itemsize = KVDtype(ctx.compat.kv_dtype).itemsize
        layers, heads = ctx.layers[1] - ctx.layers[0], ctx.heads[1] - ctx.heads[0]
        expected = r.num_tokens * layers * 2 * heads * ctx.head_dim * itemsize
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
            layers = range(*s.decode_local_layers)
            slots = token_slots(act.pages, start, end, ps)
            got = compute_kv_checksum(self.pool, layers, slots, s.decode_local_heads)
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
                self.send(act.endpoint, act.message)
            elif isinstance(act, A.TransferComplete):
                missing = self._missing_kv(act.room)
                self._stop_receiving(act.room)
                if missing is None:
                    missing = self._bad_checksum(act)
                if missing is not None:
                    log.warning(
                        "decode rank %s: room %s rid %s failed: %s",
                        self.ctx.coord,
                        act.room,
                        act.rid,
                        missing,
                    )
                    self.ctx.stats[failure_key(missing)] += 1
                    self.report(act.room, "failed", missing)
                    continue
                self.report(act.room, "complete", first_token=act.first_token)
            elif isinstance(act, A.RoomFailed):
                log.warning(
                    "decode rank %s: room %s rid %s failed: %s",
                    self.ctx.coord,
                    act.room,
                    act.rid,
                    act.reason,
                )
                self.ctx.stats[failure_key(act.reason)] += 1
                self._receiving.pop(act.room, None)
                self.report(act.room, "failed", act.reason)
            elif isinstance(act, A.ReleasePages):
                # `released` itself waits in _sweep until no write is in flight.
                self._receiving.pop(act.room, None)
            elif isinstance(act, A.PrefillReady):
                self.report(act.room, "ready")
            elif isinstance(act, A.Dropped):
                self.ctx.stats[f"dropped:{act.reason}"] += 1

    def _sweep(self, room: int) -> None:
        """Report `released` once the room left this rank's table and no frame
        of it is still being written into its pages (else a later tick retries)."""
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
    def on_message(self, msg: Any, now: float) -> None:
        self.perform(self.table.on_message(msg, now))
        room = getattr(msg, "room", None)
        if room is not None:
            self._sweep(room)
        else:
            for r in list(self.rooms):
                self._sweep(r)

    def on_group(self, msg: GroupMessage, now: float) -> None:
        if isinstance(msg, GroupOpen):
            self._open(msg, now)
        elif isinstance(msg, GroupPages):
            r = self.rooms.get(msg.room)
            if r is None or msg.room not in self.table:
                self._sweep(msg.room)
                return
            if r.resolved:
                self._assign(msg.room, list(msg.pages), now)
            else:
                r.pending_pages = list(msg.pages)
        elif isinstance(msg, GroupFail):
            self._fail(msg.room, msg.reason)
        elif isinstance(msg, GroupFailPeer):
            # `gone`: the operator saw the pod deleted or exited, nothing of it can
            # write any more. Otherwise (NotReady) it may be hung and resume: on a
            # one-sided transport its rooms' pages stay quarantined like after a
            # heartbeat verdict, until it acks, restarts elsewhere or is gone.
            self._peer_lost(msg.peer, msg.reason, now, definitive=msg.gone)

    def _open(self, msg: GroupOpen, now: float) -> None:
        try:
            gen = self.table.add_room(
                msg.room,
                msg.rid,
                msg.peer,
                now,
                msg.prompt,
                rid_is_local=msg.rid_is_local,
                num_tokens=msg.num_tokens,
            )
        except RoomError as err:
            self.report(msg.room, "failed", f"rejected: {err}")
            self.report(msg.room, "released")
            return
        self.rooms[msg.room] = _Room(msg.rid, msg.peer, msg.prefill_dp, gen, msg.num_tokens)
        if msg.peer not in self.heartbeat.peers():
            self.heartbeat.add(msg.peer, now)
        gate = self.table.gate_new_room(msg.room, now)
        if gate.actions:
            # The operator reported it gone (or not ready): fail now rather
            # than retry /route against it; a probe soon tells whether it is
            # back for the next room.
            self.heartbeat.hasten(msg.peer, now)
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
            self.heartbeat.hasten(gate.probe, now)
            self._start_probes(now)
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
                # An answer from /route is as good as a probe: a restarted
                # instance is used as soon as it answers, not one interval later.
                self.post(lambda: self._revive(peer, now, recovered=False, refetch=False))
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
        sources = []
        for prefill_rank in dict.fromkeys(s.prefill_rank for s in slices):
            endpoint = endpoints.get(prefill_rank)
            if endpoint is None:
                self._fail(room, f"bootstrap_error: no address for prefill rank {prefill_rank}")
                return
            sources.append(Source(prefill_rank, endpoint, topo.num_destinations(prefill_rank)))
        # One slice per prefill rank (its layers and heads in common with ours).
        per_rank = [s.prefill_rank for s in slices]
        r.slices = {
            s.prefill_rank: s
            for s in slices
            if not s.is_dummy and per_rank.count(s.prefill_rank) == 1
        }
        now = time.monotonic()
        self._kv_sources[room] = frozenset(s.endpoint for s in sources)
        self.perform(self.table.resolve(room, sources, now))
        r.resolved = True
        if r.pending_pages is not None and room in self.table:
            pages, r.pending_pages = r.pending_pages, None
            self._assign(room, pages, now)
        self._sweep(room)

    def _assign(self, room: int, pages: list[int], now: float) -> None:
        r = self.rooms[room]
        # Start accepting frames before any source can know the pages.
        self._receiving[room] = (r.generation, tuple(pages))
        try:
            self.perform(self.table.assign_pages(room, pages, now))
        except RoomError:
            self._receiving.pop(room, None)
        self._sweep(room)

    # ------------------------------------------------------------ liveness
    def tick(self, now: float) -> None:
        self.perform(self.table.tick(now))
        # The table forgets a lost peer after bootstrap_s; so may we.
        horizon = now - self.ctx.room_settings.bootstrap_s
        self._lost_at = {p: at for p, at in self._lost_at.items() if at > horizon}
        for room in list(self.rooms):
            self._sweep(room)
        self._drop_idle_peers(now)
        self._start_probes(now)

    def _drop_idle_peers(self, now: float) -> None:
        """Stop probing prefill instances no room used for `heartbeat.idleSeconds`."""
        in_use = {r.peer for r in self.rooms.values()} | set(self._quarantined)
        for peer in self.heartbeat.prune_idle(now, in_use):
            log.info("decode rank %s: prefill %s idle; no longer probed", self.ctx.coord, peer)
            self.ctx.stats["peer_idle_dropped"] += 1
            self.bootstrap.discard(peer)

    def _start_probes(self, now: float) -> None:
        for peer in self.heartbeat.due(now):
            if peer in self._probing:
                continue
            self._probing[peer] = now
            client = self.bootstrap.get(peer)
            timeout = self.heartbeat.probe_timeout_s

            def done(ok: Any, err: BaseException | None, peer: str = peer) -> None:
                self.post(lambda: self._on_probe(peer, bool(ok) and err is None))

            self.aio.submit(client.health(timeout), done)

    def _on_probe(self, peer: str, ok: bool) -> None:
        started = self._probing.pop(peer, 0.0)
        now = time.monotonic()
        verdict = self.heartbeat.on_result(peer, ok, now)
        if not ok:
            # Rooms held for this probe (the peer was already declared dead) fail now.
            self.perform(self.table.probe_failed(peer, now))
            for room in list(self.rooms):
                self._sweep(room)
        if verdict is Verdict.DEAD:
            log.warning(
                "decode rank %s: prefill %s unreachable; failing its rooms", self.ctx.coord, peer
            )
            self.ctx.stats["peer_dead"] += 1
            self._dead_at[peer] = now
            # Unreachable is not gone: a hung process may wake up and write.
            # New rooms on it fail at once until a probe finds it answering.
            self._peer_lost(
                peer, "prefill_unreachable", now, definitive=False, until_recovered=True
            )
        elif verdict in (Verdict.OK, Verdict.RECOVERED):
            self._revive(peer, started, recovered=verdict is Verdict.RECOVERED, refetch=True)

    def _revive(self, peer: str, started: float, *, recovered: bool, refetch: bool) -> None:
        """`peer` answered a request sent at `started`: undo verdicts older than that."""
        revived = [p for p, at in self._lost_at.items() if at <= started and peer_matches(p, peer)]
        dead_at = self._dead_at.get(peer)
        recovered = recovered or (dead_at is not None and dead_at <= started)
        if recovered:
            self._dead_at.pop(peer, None)
        if recovered or revived:
            log.info("decode rank %s: prefill %s answers again", self.ctx.coord, peer)
            self.heartbeat.mark_alive(peer)
            if refetch:
                # It may have restarted on new rank addresses: fetch /route afresh.
                self.bootstrap.invalidate(peer)
            released = self.table.peer_recovered(peer)
            for p in revived:
                released += self.table.peer_recovered(p)
                del self._lost_at[p]
            now = time.monotonic()
            for room in released:
                r = self.rooms.get(room)
                if r is not None:
                    self._fetch_route(room, r.peer, now)
        if peer in self._quarantined:
            self._check_restarted(peer)

    def _peer_lost(
        self, peer: str, reason: str, now: float, *, definitive: bool, until_recovered: bool = False
    ) -> None:
        """Heartbeat verdict or the operator's fast path: fail the rooms, forget the peer."""
        self._lost_at[peer] = now
        quarantine = self.one_sided and not definitive
        # Rank endpoints of each lost instance: what the rooms use, and /route's answer.
        lost: dict[str, set[str]] = {}
        for view in self.table.list_rooms(now):
            instance, *used = view.peers
            if peer_matches(peer, instance, *used):
                lost.setdefault(instance, set()).update(used)
        for watched in self.heartbeat.peers():
            if peer_matches(peer, watched):
                client = self.bootstrap.get(watched)
                cached = client.cached_instance
                known = lost.setdefault(watched, set())
                if cached is not None:
                    known.update(rank.endpoint for rank in cached.ranks)
                client.invalidate()
        for instance, endpoints in lost.items():
            if quarantine:
                # Keep the sockets: the ABORTs queued on them reach the process
                # if it resumes, and its acks free the pages.
                self._quarantined.setdefault(instance, set()).update(endpoints)
            else:
                # Sockets to a dead process only queue messages nobody reads.
                for endpoint in endpoints:
                    self.endpoint.drop_peer(endpoint)
        if definitive:
            for watched in [w for w in self._quarantined if peer_matches(peer, w)]:
                del self._quarantined[watched]
        self.perform(
            self.table.fail_peer(
                peer, reason, now, definitive=definitive, until_recovered=until_recovered
            )
        )
        for room in list(self.rooms):
            self._sweep(room)

    def _check_restarted(self, peer: str) -> None:
        """A quarantined instance answers again: same process (it will ack) or a new one?"""
        client = self.bootstrap.get(peer)

        def done(info: InstanceInfo | None, err: BaseException | None) -> None:
            self.post(lambda: self._on_restart_check(peer, info))

        self.aio.submit(client.instance(wait_s=self.ctx.room_settings.bootstrap_s), done)

    def _on_restart_check(self, peer: str, info: InstanceInfo | None) -> None:
        old = self._quarantined.get(peer)
        if old is None or info is None:
            return  # settled meanwhile, or not answering /route yet: the next probe retries
        now = time.monotonic()
        gone = old - {rank.endpoint for rank in info.ranks}
        for endpoint in sorted(gone):
            # Registered again elsewhere: the process that held our pages is gone.
            log.info("decode rank %s: %s restarted; releasing its pages", self.ctx.coord, endpoint)
            self.endpoint.drop_peer(endpoint)
            self.perform(self.table.fail_peer(endpoint, "prefill_restarted", now))
        # The same endpoints answer: the same process resumed and will ack. Keep
        # watching while a room still waits on them (the answer may be stale).
        waiting = {e for view in self.table.list_rooms(now) for e in view.peers[1:]}
        left = (old - gone) & waiting
        if left:
            self._quarantined[peer] = left
        else:
            del self._quarantined[peer]
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

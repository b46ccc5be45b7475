"""Prefill rank agent: registers with the bootstrap server, streams KV out.

Per room on this rank: the group leader opens it (`GroupOpen`) and the table
says `StartCompute` at once; decode ranks send their page indices
(`TransferMeta`), and once every destination is known (`SendHeldKV`) each
computed chunk's KV (this rank's layers, heads and cp token range) becomes
transfer jobs, the chunks computed before that first. The last job is
followed by `finish_sending` (held back until `SendHeldKV` if the compute
ended first): the table sends Success only after every write drained, so
Success is always the last thing decode sees.

Write accounting: `jobs[room]` counts jobs this rank submitted and not yet
reported done. Completions arrive from the sender thread (through the inbox
when the agent is busy);
a cancelled or failed room's leftovers are reported done (not ok) once the
sender says nothing of the room can move any more (`in_flight == 0`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pdcluster.runtime import stage_trace
from pdcluster.runtime.engine.kv_pool import KVPoolShape
from pdcluster.runtime.pd import actions as A
from pdcluster.runtime.pd.bootstrap_registry import RankRegistration
from pdcluster.runtime.pd.coords import RankCoord
from pdcluster.runtime.pd.instance_counts import failure_key
from pdcluster.runtime.pd.messages import FirstLogprobs, KVLayoutRegister, LayoutAck
from pdcluster.runtime.pd.prefill_claims import DestinationView, PrefillRankInfo
from pdcluster.runtime.pd.prefill_rooms import PrefillRoomTable
from pdcluster.runtime.pd.prefix_reuse import first_sent_token
from pdcluster.runtime.pd.readiness import RegistrationBackoff
from pdcluster.runtime.pd.room_common import RoomError
from pdcluster.runtime.pd.topology import PoolSpans, cp_token_range, overlap
from pdcluster.runtime.pd_worker.agent import AgentContext, RankAgent, make_nixl_agent
from pdcluster.runtime.pd_worker.bootstrap_client import (
    BootstrapClient,
    BootstrapUnreachable,
    RetryPolicy,
)
from pdcluster.runtime.pd_worker.group import GroupFail, GroupFailPeer, GroupOpen
from pdcluster.runtime.spec import AllocationPolicy, TransferBackend
from pdcluster.runtime.telemetry.request_log import request_fields
from pdcluster.runtime.transfer.job import TransferJob
from pdcluster.runtime.transfer.nixl import NixlTransport
from pdcluster.runtime.transfer.page_checksum import compute_kv_checksum, token_slots
from pdcluster.runtime.transfer.page_span import sendable_end, written_end
from pdcluster.runtime.transfer.sender import KVSender, SenderConfig
from pdcluster.runtime.transfer.shm import ShmTransport
from pdcluster.runtime.transfer.shm_dirs import shm_base
from pdcluster.runtime.transfer.shm_paths import check_pool_path
from pdcluster.runtime.transfer.tcp import TcpTransport

log = logging.getLogger("pdcluster.pd.prefill")


@dataclass
class _Room:
    rid: str
    num_tokens: int
    page_table: tuple[int, ...] = ()
    computed: int = 0  # tokens whose KV exists on this rank
    sent_upto: int = 0  # tokens already turned into jobs (early policy)
    jobs: int = 0  # submitted, not yet reported done
    kv_done: bool = False
    first_token: int | None = None
    first_logprobs: FirstLogprobs | None = None
    # Finish once the first token (leader) and every destination are known.
    finish_pending: bool = False
    # transfer.checksum: decode rank -> CRC so far of the KV sent to it, read
    # from the source pages by the request's own page table (page_checksum).
    checksums: dict[RankCoord, int] = field(default_factory=dict)


class PrefillAgent(RankAgent):
    def __init__(self, ctx: AgentContext, pool: Any, is_leader: bool) -> None:
        super().__init__(ctx, pool)
        self.is_leader = is_leader
        self.table = PrefillRoomTable(
            PrefillRankInfo(ctx.coord, self.address, ctx.compat, ctx.token or None),
            ctx.room_settings,
        )
        self.backend = ctx.transfer.backend
        self.one_sided = self.backend.is_one_sided
        self.checksum = bool(ctx.transfer.checksum)
        self.nixl_agent: Any = None
        self.transport: Any
        if self.backend is TransferBackend.nixl:
            # Prefill only initiates WRITEs: its transport's polling progresses UCX.
            self.nixl_agent = make_nixl_agent(self.address, pool, progress_thread=False)
            self.transport = NixlTransport(self.endpoint, self.nixl_agent)
        elif self.one_sided:
            self.transport = ShmTransport(self.endpoint)
        else:
            self.transport = TcpTransport(self.endpoint)
        self.sender = KVSender(
            pool,
            self.transport,
            SenderConfig(src_rank=ctx.group_rank, checksum=bool(ctx.transfer.checksum)),
            on_complete=self._on_job_sent,
            on_failure=lambda room, gen, reason: self.post(lambda: self._job_failed(room, reason)),
        )
        self.sender.start()
        self.rooms: dict[int, _Room] = {}
        self.rid_room: dict[str, int] = {}
        self._shm_peers: set[str] = set()
        self.registered = False
        self.registration_error: str | None = None
        self.register_backoff = RegistrationBackoff()

    # ------------------------------------------------------------ start-up
    def register(self) -> None:
        """PUT /route with this rank's address, retried with capped back-off until it lands.

        Rank 0's bootstrap server listens only once the whole worker is built,
        and a follower may come up long before it: an unreachable server or a
        5xx is retried for as long as the rank runs. A 4xx (wrong token,
        inconsistent compatibility fields) is final and kept in
        `registration_error`, which keeps the worker's /health at 503.
        """
        client = BootstrapClient(
            self.ctx.bootstrap_address, self.ctx.token or None, retry=RetryPolicy(attempts=1)
        )
        reg = RankRegistration(
            rank=self.ctx.coord,
            shape=self.ctx.shape,
            endpoint=self.address,
            compat=self.ctx.compat,
            incarnation=self.ctx.incarnation,
        )

        async def go() -> None:
            delays = self.register_backoff.delays()
            try:
                while not self._stopping.is_set():
                    try:
                        await client.register(reg)
                        return
                    except BootstrapUnreachable as err:
                        self.ctx.stats["bootstrap_register_retry"] += 1
                        if self.ctx.stats["bootstrap_register_retry"] in (1, 10, 100):
                            log.warning(
                                "rank %s: bootstrap server not answering yet, retrying: %s",
                                self.ctx.coord,
                                err,
                            )
                    await asyncio.sleep(next(delays))
            finally:
                await client.aclose()

        def done(_: Any, err: BaseException | None) -> None:
            if err is not None:
                log.error("rank %s: bootstrap registration failed: %s", self.ctx.coord, err)
                self.ctx.stats["bootstrap_register_failed"] += 1
                self.registration_error = str(err)
            elif not self._stopping.is_set():
                log.info("rank %s: registered with the bootstrap server", self.ctx.coord)
                self.registered = True

        self.aio.submit(go(), done)

    def counts(self) -> dict[str, int]:
        """The rank's counters, with the sender's timing (`kv:sent_bytes`, `kv:busy_us`)."""
        counts = super().counts()
        counts.update({f"kv:{k}": v for k, v in self.sender.timing().items()})
        return counts

    def close(self) -> None:
        super().close()
        self.sender.close()
        if self.nixl_agent is not None:
            self.transport.close()
            self.nixl_agent.close()

    # ------------------------------------------------------------ actions
    def perform(self, acts: list[Any]) -> None:
        for act in acts:
            performer = _PERFORMERS.get(type(act))
            if performer is not None:
                performer(self, act)

    def _count_dropped(self, act: A.Dropped) -> None:
        self.ctx.stats[f"dropped:{act.reason}"] += 1

    def _room_failed(self, act: A.RoomFailed) -> None:
        log.warning(
            "prefill rank %s: room %s rid %s failed: %s",
            self.ctx.coord,
            act.room,
            act.rid,
            act.reason,
            extra=request_fields(act.room, act.rid),
        )
        self.ctx.stats[failure_key(act.reason)] += 1
        self.sender.cancel(act.room)
        self.report(act.room, "failed", act.reason)

    def _forget_if_done(self, room: int) -> None:
        r = self.rooms.get(room)
        if r is not None and room not in self.table and r.jobs == 0:
            del self.rooms[room]
            if self.rid_room.get(r.rid) == room:
                del self.rid_room[r.rid]

    # ------------------------------------------------------------ events
    def on_message(self, msg: Any, now: float, sender: str | None = None) -> None:
        # Decode's messages name their sender (`decode_endpoint`), which the
        # endpoint already held against the proven one (`_on_control`).
        acts = self.table.on_message(msg, now, sender)
        if isinstance(msg, KVLayoutRegister) and self.one_sided:
            acts = self._check_shm_layout(msg, acts)
        self.perform(acts)
        room = getattr(msg, "room", None)
        if room is not None:
            self._maybe_send(room)
            self._forget_if_done(room)

    def _on_group_open(self, msg: GroupOpen, now: float) -> None:
        self.rooms[msg.room] = _Room(msg.rid, msg.num_tokens)
        self.rid_room[msg.rid] = msg.room
        try:
            self.perform(self.table.open_room(msg.leg(), now))
        except RoomError as err:
            self.rooms.pop(msg.room, None)
            self.rid_room.pop(msg.rid, None)
            self.report(msg.room, "failed", f"rejected: {err}")

    def _on_group_fail(self, msg: GroupFail, now: float) -> None:
        self.fail_room(msg.room, msg.reason, now)

    def _on_group_fail_peer(self, msg: GroupFailPeer, now: float) -> None:
        # `gone` does not matter here: a decode never writes into prefill's
        # pages, so even a hung one that resumes cannot touch what is freed.
        self.perform(self.table.fail_peer(msg.peer, msg.reason, now, msg.incarnation))

    def fail_room(self, room: int, reason: str, now: float) -> None:
        if room in self.table:
            self.perform(self.table.fail(room, reason, now))
        self._forget_if_done(room)

    def tick(self, now: float) -> None:
        self.perform(self.table.tick(now))
        for room, r in list(self.rooms.items()):
            # Jobs of a cancelled/failed room that will never complete: report
            # them done once nothing of the room can move any more.
            if r.jobs and self.sender.is_closed_room(room) and self.sender.in_flight(room) == 0:
                n, r.jobs = r.jobs, 0
                if room in self.table:
                    self.perform(self.table.writes_done(room, n, False, now))
            self._forget_if_done(room)

    def _on_job_sent(self, job: TransferJob) -> None:
        # Sender or transport I/O thread. Done here when the agent is idle:
        # the room's last write done is what Success waits for (it needs no
        # `drain`, and its sends only queue).
        stage_trace.mark(job.room, "prefill.kv_sent")
        self.run_or_post(lambda: self._job_done(job.room, ok=True))

    def _job_done(self, room: int, ok: bool) -> None:
        r = self.rooms.get(room)
        if r is None or r.jobs == 0:
            return
        r.jobs -= 1
        if room in self.table:
            self.perform(self.table.writes_done(room, 1, ok, time.monotonic()))
        self._forget_if_done(room)

    def _job_failed(self, room: int, reason: str) -> None:
        if room not in self.table:
            return
        now = time.monotonic()
        if reason == "peer_stalled":
            # The decode rank took nothing for the send timeout (hung): every room
            # writing to it would stall the same way, one after another, and keep
            # the transfers to other ranks waiting behind them. Fail them all now.
            for dest in self.table.destinations(room):
                log.warning(
                    "prefill rank %s: decode %s stalled; failing its rooms",
                    self.ctx.coord,
                    dest.endpoint,
                )
                self.perform(self.table.fail_peer(dest.endpoint, "decode_stalled", now))
        if room in self.table:
            self.perform(self.table.fail(room, f"transfer_failed: {reason}", now))

    def _check_shm_layout(self, msg: KVLayoutRegister, acts: list[Any]) -> list[Any]:
        """`shm` writes straight into decode's pool file: refuse a layout whose pool is not here.

        A decode on another node (or in another pod without a shared
        /dev/shm) registers a path this rank cannot open; accepting it would
        fail the first write inside the engine's step. Refused at
        registration instead, so its rooms fail with the reason at once.
        """
        accepted = [
            a
            for a in acts
            if isinstance(a, A.Send)
            and isinstance(a.message, LayoutAck)
            and a.message.accepted
            and a.endpoint == msg.decode_endpoint
        ]
        if not accepted:
            return acts
        problem = self._nixl_problem(msg) if self.nixl_agent else self._shm_problem(msg)
        if problem is None:
            return acts
        self.table.peers.forget_matching(msg.decode_endpoint)
        self.ctx.stats["dropped:backend_mismatch"] += 1
        log.warning(
            "prefill rank %s: layout of %s refused: %s",
            self.ctx.coord,
            msg.decode_endpoint,
            problem,
        )
        ack = LayoutAck(
            rank=self.ctx.coord,
            endpoint=self.address,
            accepted=False,
            reason=f"backend_mismatch: {problem}",
        )
        return [a for a in acts if a not in accepted] + [A.Send(msg.decode_endpoint, ack)]

    def _shm_problem(self, lay: KVLayoutRegister) -> str | None:
        path = lay.shm_pool_path
        if not path:
            return "prefill shm, decode offers no shared-memory pool (tcp)"
        try:
            size = os.stat(path).st_size
        except OSError as err:
            return (
                f"prefill shm cannot open decode's pool {path!r} ({err.strerror}): shm needs "
                "prefill and decode on one host sharing its shared memory"
            )
        need = self._peer_shape(lay).nbytes
        if size != need:
            return (
                f"prefill shm: decode's pool {path!r} holds {size} bytes, its layout needs {need}"
            )
        return None

    def _nixl_problem(self, lay: KVLayoutRegister) -> str | None:
        """Why decode's NIXL region cannot take our frames, or None once its agent is
        added and its page units prepared: at registration, not at its first room."""
        if lay.nixl is None:
            return f"prefill nixl, decode offers no NIXL region ({lay.compat.transfer_backend})"
        try:
            shape = self._peer_shape(lay)
            self.transport.check_region(lay.nixl, shape)
            if not self.transport.has_peer(lay.decode_endpoint, lay.nixl):
                self.transport.register_peer(lay.decode_endpoint, lay.nixl, shape)
        except ValueError as err:
            return f"prefill nixl: {err}"
        return None

    def _peer_shape(self, lay: KVLayoutRegister) -> KVPoolShape:
        return KVPoolShape(
            num_layers=lay.layer_end - lay.layer_start,
            num_pages=lay.num_pages,
            page_size=self.ctx.page_size,
            num_kv_heads=lay.head_end - lay.head_start,
            head_dim=self.ctx.head_dim,
            dtype=self.ctx.compat.kv_dtype,
            layout=self.pool.shape.layout,
        )

    # ------------------------------------------------------------ KV out
    def on_chunk(self, rid: str, page_table: Any, start: int, end: int) -> None:
        """Runner thread: KV of tokens [start, end) is now in this rank's pool.

        One room's error (a destination that cannot be written) fails that
        room, never the step: the engine thread runs this hook.
        """
        with self.lock:
            room = self.rid_room.get(rid)
            if room is None:
                return
            try:
                self._on_chunk(room, page_table, end)
            except Exception as err:
                log.exception(
                    "prefill rank %s: room %s: sending its KV failed", self.ctx.coord, room
                )
                if room in self.table:
                    reason = f"transfer_failed: {type(err).__name__}: {err}"
                    self.perform(self.table.fail(room, reason, time.monotonic()))

    def _on_chunk(self, room: int, page_table: Any, end: int) -> None:
        r = self.rooms[room]
        r.page_table = tuple(page_table)
        r.computed = max(r.computed, end)
        now = time.monotonic()
        if self.table.policy is AllocationPolicy.early:
            self._maybe_send(room)
        if r.computed >= r.num_tokens and not r.kv_done:
            r.kv_done = True
            if self.table.policy is AllocationPolicy.prefill_complete:
                if room in self.table:
                    self.perform(self.table.kv_computed(room, now))
            elif not self.is_leader:
                self._finish(room)

    def leader_first_token(
        self, room: int, first_token: int, logprobs: FirstLogprobs | None = None
    ) -> None:
        """Leader (agent thread): the engine sampled the room's first token (and
        its logprobs, when the request asked for them)."""
        r = self.rooms.get(room)
        if r is None:
            return
        r.first_token = first_token
        r.first_logprobs = logprobs
        if self.table.policy is AllocationPolicy.early or r.finish_pending:
            self._finish(room)

    def _finish(self, room: int) -> None:
        r = self.rooms[room]
        if room not in self.table:
            return
        if not self.table.can_send(room):
            # early: the compute ended before every destination was known;
            # `SendHeldKV` finishes. Counted: how often decode's metadata comes
            # after a whole prompt's compute.
            if not r.finish_pending:
                self.ctx.stats["finish_held"] += 1
            r.finish_pending = True
            return
        if self.is_leader and r.first_token is None:
            r.finish_pending = True  # the first token goes with Success
            return
        r.finish_pending = False
        acts = self.table.finish_sending(
            room,
            r.first_token,
            None,
            time.monotonic(),
            checksums=r.checksums,
            first_logprobs=r.first_logprobs,
        )
        self.perform(acts)

    def _send_held(self, room: int) -> None:
        r = self.rooms.get(room)
        if r is None:
            return
        if self.table.policy is AllocationPolicy.prefill_complete:
            r.sent_upto = 0
            r.checksums.clear()
            self._maybe_send(room)
            self._finish(room)
            return
        # early: the leader may start a request held back for pairing now
        # (`pd/early_start.py`); the chunks computed while destinations were
        # missing go out, the rest streams from `_on_chunk`.
        self.report(room, "paired")
        self._maybe_send(room)
        if r.finish_pending:
            self._finish(room)

    def _maybe_send(self, room: int) -> None:
        """Turn computed-but-unsent tokens into jobs for every known destination."""
        r = self.rooms.get(room)
        if r is None or not self.table.can_send(room) or r.computed <= r.sent_upto:
            return
        if self.table.policy is AllocationPolicy.prefill_complete and not r.kv_done:
            return
        dests = self.table.destinations(room)
        mine = cp_token_range(
            r.num_tokens, self.ctx.page_size, self.ctx.shape.cp, self.ctx.coord.cp
        )
        ps, whole = self.ctx.page_size, self.pool.shape.whole_pages
        t0 = max(r.sent_upto, mine[0])
        t1 = sendable_end(r.computed, mine[1], ps, whole)
        if t0 >= t1:
            return
        r.sent_upto = t1
        end = written_end(t1, mine[1], ps, whole)
        n = 0
        for dest in dests:
            # Decode holds the pages of its reused prefix (other sequences read
            # them): nothing before `first_sent_token` is ever written.
            d0 = max(t0, first_sent_token(dest.reuse, ps))
            if d0 >= t1:
                continue
            job = self._job(room, r, dest, d0, end)
            if job is not None and self.sender.submit(job):
                n += 1
                if self.checksum:
                    self._add_checksum(r, dest.decode_rank, job, d0, t1)
        if n:
            stage_trace.mark(room, "prefill.kv_submit")
            r.jobs += n
            self.perform(self.table.writes_enqueued(room, n, time.monotonic()))

    def _add_checksum(
        self, r: _Room, decode_rank: RankCoord, job: TransferJob, t0: int, t1: int
    ) -> None:
        # From the pages the request's page table names, not the job's slots:
        # a job reading a wrong page then disagrees with what decode finds.
        slots = token_slots(r.page_table, t0, t1, self.ctx.page_size)
        crc = r.checksums.get(decode_rank, 0)
        r.checksums[decode_rank] = compute_kv_checksum(
            self.pool, job.src_layers, slots, job.src_heads, crc
        )

    def _job(
        self, room: int, r: _Room, dest: DestinationView, t0: int, t1: int
    ) -> TransferJob | None:
        lay = dest.layout
        dst_layers, dst_heads = (lay.layer_start, lay.layer_end), (lay.head_start, lay.head_end)
        layers = overlap(self.ctx.layers, dst_layers)
        heads = overlap(self.ctx.heads, dst_heads)
        if layers is None or heads is None:
            return None
        src = PoolSpans.within(layers, heads, self.ctx.layers, self.ctx.heads)
        dst = PoolSpans.within(layers, heads, dst_layers, dst_heads)
        ps = self.ctx.page_size
        dst_slots = None
        if self.nixl_agent is not None:
            self._ensure_nixl_peer(dest)
            dst_slots = token_slots(dest.pages, t0, t1, ps)
        elif self.one_sided:
            self._ensure_shm_peer(dest)
            dst_slots = token_slots(dest.pages, t0, t1, ps)
        return TransferJob(
            room=room,
            generation=dest.generation,
            peer=dest.endpoint,
            src_slots=token_slots(r.page_table, t0, t1, ps),
            token_start=t0,
            token_end=t1,
            src_layers=tuple(range(*src.layers)),
            dst_layers=tuple(range(*dst.layers)),
            src_heads=src.heads,
            dst_heads=dst.heads,
            dst_slots=dst_slots,
        )

    def _ensure_nixl_peer(self, dest: DestinationView) -> None:
        region = dest.layout.nixl
        if region is None:
            raise ValueError(f"decode rank {dest.decode_rank} offers no NIXL region")
        # A decode that restarted registers a new agent: it replaces the old one.
        if not self.transport.has_peer(dest.endpoint, region):
            self.transport.register_peer(dest.endpoint, region, self._peer_shape(dest.layout))

    def _ensure_shm_peer(self, dest: DestinationView) -> None:
        if dest.endpoint in self._shm_peers:
            return
        lay = dest.layout
        if not lay.shm_pool_path:
            raise ValueError(f"decode rank {dest.decode_rank} offers no shared-memory pool")
        # Only a pool file of this cluster: a registration must not make us write elsewhere.
        check_pool_path(
            os.path.realpath(lay.shm_pool_path),
            shm_base(),
            self.ctx.cluster,
            os.environ.get("PDCLUSTER_SHM_DIR"),
        )
        shape = self._peer_shape(lay)
        # The chunk hook runs inside the runner's inference mode; a pool mapped
        # there would be an inference tensor the sender thread may not write.
        with torch.inference_mode(False):
            self.transport.register_peer(dest.endpoint, lay.shm_pool_path, shape)
        self._shm_peers.add(dest.endpoint)

    def table_views(self, now: float) -> list[dict[str, Any]]:
        return [asdict(v) | {"rank": str(self.ctx.coord)} for v in self.table.list_rooms(now)]


# What `PrefillAgent.perform` does for each action the room table returns.
_PERFORMERS: dict[type, Callable[[PrefillAgent, Any], None]] = {
    A.Send: lambda agent, act: agent.send(act.endpoint, act.message),
    A.StartCompute: lambda agent, act: agent.report(act.room, "start"),
    A.SendHeldKV: lambda agent, act: agent._send_held(act.room),
    A.CancelWrites: lambda agent, act: agent.sender.cancel(act.room),
    A.CloseDestination: lambda agent, act: agent.endpoint.drop_peer(act.endpoint),
    A.ReleaseSource: lambda agent, act: agent.report(act.room, "released"),
    A.RoomFailed: PrefillAgent._room_failed,
    A.RoomSucceeded: lambda agent, act: agent.report(
        act.room, "succeeded", sent_tokens=act.sent_tokens
    ),
    A.Dropped: PrefillAgent._count_dropped,
}

# The group commands a prefill rank follows.
PrefillAgent.group_handlers = {
    GroupOpen: PrefillAgent._on_group_open,
    GroupFail: PrefillAgent._on_group_fail,
    GroupFailPeer: PrefillAgent._on_group_fail_peer,
}

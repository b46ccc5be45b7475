"""Leader-side coordination of a PD dp group, run on the engine thread.

The coordinator is the only code that lets the PD control plane touch the
engine. It turns the ranks' reports into engine actions, and only on the
agreement of every rank of the group:

prefill:  all ranks `start`      → add the request (prefill_only)
          engine sampled token 0 → the leader's agent may finish sending
          all ranks `succeeded`  → the prefill leg answers 200
          all ranks `released`   → free the request's prefill pages
decode:   all ranks `complete`   → add the request (prefilled) with the pages
          all ranks `released`   → (failed room) free the reserved pages
either:   any rank `failed`      → fail the room on every rank, tell the client
          a step failed its rid  → fail the room (the engine keeps serving)

Prefill backpressure: at most `transfer.maxRooms` rooms of the group are
open on the ranks at once; a leg beyond that waits in a FIFO queue of
`transfer.roomQueueLimit` (`room_queue.py`) and is opened on the ranks when
a room ends. Only a leg past both bounds is refused (503, `Retry-After`).

Reports arrive from the agent thread through a thread-safe queue and are
drained in `tick()`, so engine and allocator calls stay on one thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdcluster.runtime import stage_trace
from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator
from pdcluster.runtime.engine.engine import EngineRequest, RequestRejected, StepOutput
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.sequence import SequenceMode
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.pd.decode_admission import AdmissionError, DecodeAdmission
from pdcluster.runtime.pd.early_start import EarlyStartBudget
from pdcluster.runtime.pd.failure_labels import reason_label
from pdcluster.runtime.pd.instance_counts import RoomFailureTally
from pdcluster.runtime.pd.messages import FirstLogprobs
from pdcluster.runtime.pd.peer_address import BootstrapAddress
from pdcluster.runtime.pd.prefix_reuse import build_reuse, num_reusable_pages, reuse_keys
from pdcluster.runtime.pd.prompt_digest import prompt_id
from pdcluster.runtime.pd.room_queue import Offer, RoomQueue
from pdcluster.runtime.pd_worker.agent import AgentContext
from pdcluster.runtime.pd_worker.group import (
    GroupFail,
    GroupMessage,
    GroupOpen,
    GroupPages,
    GroupReport,
)
from pdcluster.runtime.serving.engine_service import EngineService, TokenEvent
from pdcluster.runtime.spec import (
    AllocationPolicy,
    FailurePolicy,
    KVDtype,
    PDClusterSpec,
    Role,
    pages_for,
)
from pdcluster.runtime.telemetry.request_log import request_fields
from pdcluster.runtime.telemetry.span_plan import KV_BACKEND, KV_BYTES, RequestStamps, Stage
from pdcluster.runtime.transfer.ucx_report import is_rdma_requested

log = logging.getLogger("pdcluster.pd")

# Seconds between two reads of what the KV transport negotiated (metric label).
TRANSPORT_EXPORT_S = 5.0

# Agent counters that count peer input dropped as malformed or unexpected.
REJECT_PREFIXES = ("reject:", "group_reject:", "dropped:", "endpoint:", "kv:")
# Endpoint counters about our own sends, not about what peers sent us.
NOT_REJECTS = frozenset(
    f"endpoint:{k}"
    for k in (
        "send_timeout",
        "send_failed",
        "send_dropped",
        "send_discarded",
        "peer_stalled",
        "callback_error",
        "peer_evicted",  # our own DEALERs closed to stay under the cap
        "peer_idle_closed",
        "peers_over_cap",
    )
)


class RoomConflict(ValueError):
    """A room or rid is already in use on this worker."""


class GroupAgent(Protocol):
    """What a coordinator uses of its leader rank's agent (`agent.RankAgent`)."""

    ctx: AgentContext
    # Where the agent hands this rank's reports, and those its followers send.
    report_sink: Callable[[GroupReport], None] | None
    group_sink: Callable[[GroupReport], None] | None

    def broadcast(self, msg: GroupMessage, *, here_now: bool = False) -> None:
        """Send `msg` to every rank of the dp group, this one included
        (`here_now`: this one on the calling thread when the agent is idle)."""

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the agent thread."""

    def run_or_post(self, fn: Callable[[], None]) -> None:
        """Run `fn` now under the agent's lock if it is free, else on the agent thread."""


class PrefillGroupAgent(GroupAgent, Protocol):
    """A prefill leader's agent (`prefill_agent.PrefillAgent`)."""

    def leader_first_token(
        self, room: int, first_token: int, logprobs: FirstLogprobs | None = None
    ) -> None:
        """The engine sampled the room's first token: the last chunk may go out."""


@dataclass(frozen=True)
class Leg:
    """One leg of a PD request, as the HTTP backend hands it to its coordinator."""

    room_id: int
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    rid_is_local: bool = False  # the worker minted `rid`: it never leaves this instance
    stamps: RequestStamps | None = None  # tracing on: the stages this leader sees


@dataclass
class _Room:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    rid_is_local: bool = False  # the worker minted `rid`: it never leaves this instance
    reports: dict[str, set[int]] = field(default_factory=lambda: collections.defaultdict(set))
    failed: str | None = None
    engine_added: bool = False
    # prefill, early: every rank is ready to compute, but the early-start
    # budget is spent (`pd/early_start.py`): the request starts once paired.
    start_deferred: bool = False
    first_token: int | None = None
    first_logprobs: FirstLogprobs | None = None  # with first_token, when the request asks
    # prefill: prompt tokens whose KV travelled (ranks' `succeeded` reports)
    sent_tokens: int | None = None
    # decode only
    num_pages: int = 0
    pages: tuple[int, ...] | None = None
    handed_off: bool = False
    leg_done: bool = False
    # The request itself was aborted (client gone, abort_request): nothing to recompute.
    aborted: bool = False
    opened_at: float = field(default_factory=time.monotonic)
    pages_at: float | None = None  # decode: when pages were reserved (transfer starts)
    # decode: the first `num_reused` of `pages` are cached pages this room
    # references (decode-side prefix reuse); the rest are owned.
    num_reused: int = 0
    stamps: RequestStamps | None = None  # the leg's stage stamps (tracing on)

    def mark(self, stage: str) -> None:
        if self.stamps is not None:
            self.stamps.mark(stage)

    def note_kv(self, num_bytes: int, backend: str) -> None:
        if self.stamps is not None:
            self.stamps.note(KV_BYTES, num_bytes)
            self.stamps.note(KV_BACKEND, backend)


class _Coordinator:
    role: Role

    def __init__(
        self, agent: GroupAgent, service: EngineService, group_size: int, metrics: WorkerMetrics
    ) -> None:
        self.agent = agent
        self.service = service
        self.engine = service.engine
        self.group_size = group_size
        self.metrics = metrics
        self.rooms: dict[int, _Room] = {}
        self.rid_room: dict[str, int] = {}
        self._reports: collections.deque[GroupReport] = collections.deque()
        self._rejects_seen: dict[str, int] = {}
        self._lock = threading.Lock()
        # Rooms failed on any rank of the group, each counted once (under `_lock`).
        self._tally = RoomFailureTally(agent.ctx.room_settings.tombstone_ttl)
        agent.report_sink = self._queue_report
        agent.group_sink = self._queue_report
        service.add_tick(self.tick)
        service.output_hooks.append(self.on_output)
        service.abort_hooks.append(self.on_abort)
        service.fail_hooks.append(self.on_engine_failure)

    def _queue_report(self, rep: GroupReport) -> None:
        stage_trace.mark(rep.room, f"{self.role}.report.{rep.kind}")
        with self._lock:
            if rep.kind == "failed":
                # Every rank's failure counts here, even for a room this leader
                # never opened (metadata that arrived without its leg).
                self._tally.record(rep.room, rep.reason or "failed", time.monotonic())
            self._reports.append(rep)
        self.service.wake()

    def rooms_failed(self) -> dict[str, int]:
        """Rooms of this group failed on any rank, by `room_failed:<reason>` (any thread)."""
        with self._lock:
            return self._tally.counts()

    def tick(self) -> None:
        while True:
            with self._lock:
                if not self._reports:
                    break
                rep = self._reports.popleft()
            room = self.rooms.get(rep.room)
            if room is None:
                continue
            room.reports[rep.kind].add(rep.rank)
            if rep.first_token is not None and room.first_token is None:
                room.first_token = rep.first_token
                room.first_logprobs = rep.first_logprobs
            if rep.sent_tokens is not None:
                room.sent_tokens = max(room.sent_tokens or 0, rep.sent_tokens)
            try:
                self.on_report(rep.room, room, rep)
            except Exception as err:  # noqa: BLE001 - one bad room must not stop the engine
                log.exception("%s: room %s: handling %s failed", self.role, rep.room, rep.kind)
                self.fail(rep.room, f"internal_error: {type(err).__name__}: {err}")
        self._export_gauges()

    def _export_rejects(self) -> None:
        """Dropped peer input counted by the rank agent → `pdcluster_protocol_rejects_total`."""
        counts = dict(self.agent.ctx.stats)
        receiver = getattr(self.agent, "receiver", None)
        if receiver is not None:
            counts.update({f"kv:{k}": v for k, v in receiver.stats.items() if k != "accepted"})
        for key, count in counts.items():
            if not key.startswith(REJECT_PREFIXES) or key in NOT_REJECTS:
                continue
            new = count - self._rejects_seen.get(key, 0)
            if new > 0:
                self.metrics.protocol_rejects.labels(reason=key).inc(new)
                self._rejects_seen[key] = count

    def _export_transport(self) -> None:
        """`pdcluster_kv_transport_info`: re-read every few seconds (nixl reads UCX's log)."""
        now = time.monotonic()
        if now < getattr(self, "_transport_due", 0.0):
            return
        self._transport_due = now + TRANSPORT_EXPORT_S
        report_of = getattr(self.agent, "transport_report", None)
        if report_of is None:  # a stand-in agent (tests)
            return
        report = report_of()
        labels = (
            report["backend"],
            ",".join(report.get("ucx_transports", [])),
            str(bool(report.get("tcp_fallback", False))).lower(),
        )
        if labels != getattr(self, "_transport_labels", None):
            old = getattr(self, "_transport_labels", None)
            if old is not None:
                self.metrics.kv_transport.remove(*old)
            self.metrics.kv_transport.labels(*labels).set(1)
            self._transport_labels = labels
            missing = labels[2] == "true" and is_rdma_requested(self.agent.ctx.transfer)
            self.metrics.kv_rdma_missing.set(1 if missing else 0)

    def _export_gauges(self) -> None:
        self._export_rejects()
        self._export_transport()
        states = collections.Counter(self.room_state(r) for r in self.rooms.values())
        for state in ("waiting", "transferring", "computing", "failed", "decoding"):
            self.metrics.rooms.labels(state=state).set(states.get(state, 0))
        sched = self.engine.scheduler
        self.metrics.queue_size.labels(stage="engine_waiting").set(sched.num_waiting)
        self.metrics.queue_size.labels(stage="engine_running").set(sched.num_running)
        self.metrics.queued_prefill_tokens.set(sched.num_queued_prefill_tokens)

    def room_state(self, room: _Room) -> str:
        if room.failed is not None:
            return "failed"
        if room.handed_off:
            return "decoding"
        if room.engine_added:
            return "computing"
        if room.pages is not None:
            return "transferring"
        return "waiting"

    def kv_bytes(self, num_tokens: int) -> int:
        """KV bytes of `num_tokens` tokens over the whole model (all ranks)."""
        ctx = self.agent.ctx
        itemsize = KVDtype(ctx.compat.kv_dtype).itemsize
        return num_tokens * ctx.num_layers * 2 * ctx.num_kv_heads * ctx.head_dim * itemsize

    def all_ranks(self, room: _Room, kind: str) -> bool:
        return len(room.reports[kind]) >= self.group_size

    def _register(self, room_id: int, room: _Room) -> None:
        if room_id in self.rooms:
            raise RoomConflict(f"room {room_id} is already in use on this worker")
        if room.rid in self.rid_room:
            raise RoomConflict(f"rid {room.rid!r} is already in flight")
        self.rooms[room_id] = room
        self.rid_room[room.rid] = room_id

    def _forget(self, room_id: int) -> None:
        room = self.rooms.pop(room_id, None)
        if room is not None and self.rid_room.get(room.rid) == room_id:
            del self.rid_room[room.rid]

    def fail(self, room_id: int, reason: str) -> None:
        room = self.rooms.get(room_id)
        if room is None or room.failed is not None or room.handed_off:
            return
        room.failed = reason
        log.warning(
            "%s: room %s rid %s failed: %s",
            self.role,
            room_id,
            room.rid,
            reason,
            extra=request_fields(room_id, room.rid),
        )
        self.metrics.failures.labels(reason=reason_label(reason)).inc()
        self.agent.broadcast(GroupFail(room_id, reason))
        self.on_failed(room_id, room)

    def on_abort(self, rid: str) -> None:
        room_id = self.rid_room.get(rid)
        if room_id is not None:
            self.rooms[room_id].aborted = True
            self.fail(room_id, "aborted")

    def on_engine_failure(self, rid: str, reason: str) -> None:
        """Engine thread: a step (or a hook) failed this request; the engine goes on."""
        room_id = self.rid_room.get(rid)
        if room_id is not None:
            self.fail(room_id, reason)

    # role hooks
    def on_report(self, room_id: int, room: _Room, rep: GroupReport) -> None:
        raise NotImplementedError

    def on_failed(self, room_id: int, room: _Room) -> None:
        raise NotImplementedError

    def on_output(self, output: StepOutput) -> bool:
        return False


class PrefillCoordinator(_Coordinator):
    role = Role.prefill
    agent: PrefillGroupAgent

    def __init__(
        self,
        agent: PrefillGroupAgent,
        service: EngineService,
        group_size: int,
        metrics: WorkerMetrics,
        max_rooms: int = 4096,
        queue_limit: int = 4096,
        early_start: EarlyStartBudget | None = None,
    ) -> None:
        """`early_start`: under `early`, how much prompt may compute before its
        room is paired (None: `prefill_complete`, where every room computes at once)."""
        super().__init__(agent, service, group_size, metrics)
        self.queue = RoomQueue(max_rooms, queue_limit)
        self.early_start = early_start

    def is_full(self) -> bool:
        """Any thread: a new leg would be refused now (a racy read, rechecked in `open`)."""
        return self.queue.is_full()

    def open(self, leg: Leg) -> None:
        """Engine thread: the prefill leg arrived. Raises QueueFull past the queue."""
        room_id, rid = leg.room_id, leg.rid
        room = _Room(rid, leg.prompt, leg.sampling, leg.rid_is_local, stamps=leg.stamps)
        self._register(room_id, room)
        try:
            offer = self.queue.offer(room_id)
        except Exception:
            self._forget(room_id)
            raise
        if offer is Offer.start:
            self._broadcast_open(room_id, self.rooms[room_id])
        else:
            log.info(
                "prefill: room %s rid %s queued (%d waiting)",
                room_id,
                rid,
                self.queue.num_queued,
                extra=request_fields(room_id, rid),
            )

    def _broadcast_open(self, room_id: int, room: _Room) -> None:
        self.agent.broadcast(
            GroupOpen(
                room_id,
                room.rid,
                len(room.prompt),
                prompt=prompt_id(room.prompt),
                rid_is_local=room.rid_is_local,
                page_keys=reuse_keys(room.prompt, self.agent.ctx.page_size),
            ),
            here_now=True,
        )

    def _forget(self, room_id: int) -> None:
        super()._forget(room_id)
        if self.early_start is not None:
            self.early_start.leave(room_id)
        for started in self.queue.release(room_id):
            room = self.rooms.get(started)
            if room is None or room.failed is not None:
                self._forget(started)
                continue
            self._broadcast_open(started, room)

    def on_report(self, room_id: int, room: _Room, rep: GroupReport) -> None:
        if rep.kind == "failed":
            self.fail(room_id, rep.reason or "failed")
        elif rep.kind == "start" and self.all_ranks(room, "start") and not room.engine_added:
            if room.failed is not None:
                return
            budget = self.early_start
            if (
                budget is not None
                and not self.all_ranks(room, "paired")
                and not budget.try_start(room_id, len(room.prompt))
            ):
                room.start_deferred = True
                return
            self._compute(room_id, room)
        elif rep.kind == "paired" and self.all_ranks(room, "paired"):
            room.mark(Stage.paired)
            if self.early_start is not None:
                self.early_start.leave(room_id)
            if room.start_deferred and room.failed is None and not room.engine_added:
                room.start_deferred = False
                self._compute(room_id, room)
        elif rep.kind == "succeeded" and self.all_ranks(room, "succeeded") and not room.leg_done:
            room.leg_done = True
            room.mark(Stage.kv_sent)
            sent = len(room.prompt) if room.sent_tokens is None else room.sent_tokens
            self.metrics.transfer_bytes.labels(direction="out").inc(self.kv_bytes(sent))
            room.note_kv(self.kv_bytes(sent), self.agent.ctx.compat.transfer_backend)
            self.metrics.transfer_seconds.observe(time.monotonic() - room.opened_at)
            first = [] if room.first_token is None else [room.first_token]
            self.service.emit(room.rid, TokenEvent(first, "", True, "stop"))
        elif rep.kind == "released":
            self._maybe_free(room_id, room)

    def _compute(self, room_id: int, room: _Room) -> None:
        try:
            self.engine.add_request(
                EngineRequest(room.rid, room.prompt, room.sampling, mode=SequenceMode.prefill_only)
            )
        except RequestRejected as err:
            self.fail(room_id, f"rejected: {err}")
            return
        room.engine_added = True
        room.mark(Stage.compute_start)
        stage_trace.mark(room_id, "prefill.engine_add")

    def _maybe_free(self, room_id: int, room: _Room) -> None:
        if not self.all_ranks(room, "released"):
            return
        if room.engine_added:
            # A running request stops and frees; a finished (held) one is released.
            self.engine.abort(room.rid)
            seq = self.engine.scheduler.get(room.rid)
            if seq is not None:
                self.engine.release(room.rid)
        self._forget(room_id)

    def on_failed(self, room_id: int, room: _Room) -> None:
        self.service.fail(room.rid, f"prefill failed: {room.failed}", status=502)
        if not room.engine_added:
            # Nothing was computed: no rank holds pages of this room.
            self._forget(room_id)

    def on_output(self, output: StepOutput) -> bool:
        room_id = self.rid_room.get(output.rid)
        if room_id is None:
            return False
        room = self.rooms[room_id]
        if output.finished and output.finish_reason == "prefill_done" and output.new_token_ids:
            first = int(output.new_token_ids[-1])
            room.first_token = first
            room.mark(Stage.first_token)
            stage_trace.mark(room_id, "prefill.first_token")
            lp = FirstLogprobs.of(output.new_logprobs[-1] if output.new_logprobs else None)
            self.agent.run_or_post(lambda: self.agent.leader_first_token(room_id, first, lp))
        elif output.finished and output.finish_reason != "prefill_done":
            self.fail(room_id, f"engine_{output.finish_reason}")
        return True


class DecodeCoordinator(_Coordinator):
    role = Role.decode

    def __init__(
        self,
        agent: GroupAgent,
        service: EngineService,
        group_size: int,
        metrics: WorkerMetrics,
        spec: PDClusterSpec,
    ) -> None:
        super().__init__(agent, service, group_size, metrics)
        self.policy = spec.transfer.allocation_policy
        self.recompute = spec.transfer.failure_policy is FailurePolicy.recompute
        self.page_size = spec.kv_cache.page_size
        decode = spec.role_spec(Role.decode)
        assert decode is not None, "a decode coordinator needs the decode role's spec"
        slots = max(1, decode.engine.max_running_requests)
        self.admission = DecodeAdmission(slots, self.engine.num_total_pages)

    def num_pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def open(self, leg: Leg, peer: BootstrapAddress, prefill_dp: int | None) -> None:
        """Engine thread: the decode leg arrived, its KV to come from prefill `peer`."""
        room_id, prompt = leg.room_id, leg.prompt
        room = _Room(
            leg.rid,
            prompt,
            leg.sampling,
            num_pages=self.num_pages_for(len(prompt)),
            stamps=leg.stamps,
        )
        self._register(room_id, room)
        self.agent.broadcast(
            GroupOpen(
                room_id,
                leg.rid,
                len(prompt),
                peer,
                prefill_dp,
                prompt=prompt_id(prompt),
                rid_is_local=leg.rid_is_local,
            ),
            here_now=True,
        )
        if self.policy is AllocationPolicy.early:
            self._enqueue(room_id, room)

    def _enqueue(self, room_id: int, room: _Room) -> None:
        try:
            self.admission.enqueue(room_id, room.num_pages)
        except AdmissionError as err:
            self.fail(room_id, f"{err.reason}: {err}")

    def tick(self) -> None:
        super().tick()
        for admitted in self.admission.admit(self._allocate_head):
            room = self.rooms.get(admitted.room)
            if room is None or room.failed is not None:
                self._give_back(admitted.pages, 0 if room is None else room.num_reused)
                if room is not None:
                    room.num_reused = 0
                self.admission.release_slot(admitted.room)
                continue
            room.pages = admitted.pages
            room.pages_at = time.monotonic()
            room.mark(Stage.pages_reserved)
            reuse = build_reuse(room.prompt, room.num_reused, self.page_size)
            self.agent.broadcast(
                GroupPages(admitted.room, list(admitted.pages), reuse), here_now=True
            )
        self.metrics.queue_size.labels(stage="decode_admission").set(self.admission.num_waiting)

    def _allocate_head(self, n: int) -> list[int] | None:
        """Pages for the admission head's `n`: with the prefix cache on, the
        cached pages holding its prompt's leading full pages first (referenced
        now, so nothing evicts or writes them while the room lives), then new
        ones; None (nothing taken) when they do not fit."""
        allocator = self.engine.allocator
        head = self.admission.head()
        room = None if head is None else self.rooms.get(head)
        if (
            room is None
            or room.failed is not None
            or not isinstance(allocator, CachingPageAllocator)
            or not allocator.is_enabled
        ):
            return list(allocator.allocate(n)) if allocator.can_allocate(n) else None
        match = allocator.match(room.prompt, record=False)
        hits = match.pages[: num_reusable_pages(len(match.pages), len(room.prompt), self.page_size)]
        # Referenced hit pages stop counting as free (they leave the LRU).
        evictable = sum(1 for p in hits if allocator.refcount(p) == 0)
        need = n - len(hits)
        if need + evictable > allocator.num_free:
            return None
        allocator.acquire(hits)
        room.num_reused = len(hits)
        return [*hits, *allocator.allocate(need)]

    def _give_back(self, pages: tuple[int, ...], num_reused: int) -> None:
        """Return pages a room held: release its reference on the reused cached
        ones, free the owned rest."""
        allocator = self.engine.allocator
        if num_reused:
            assert isinstance(allocator, CachingPageAllocator)
            allocator.release(pages[:num_reused])
        allocator.free(pages[num_reused:])

    def on_report(self, room_id: int, room: _Room, rep: GroupReport) -> None:
        if rep.kind == "failed":
            self.fail(room_id, rep.reason or "failed")
        elif rep.kind == "ready" and self.all_ranks(room, "ready") and room.failed is None:
            self._enqueue(room_id, room)
        elif rep.kind == "complete" and self.all_ranks(room, "complete"):
            self._hand_off(room_id, room)
        elif rep.kind == "released":
            self._maybe_free(room_id, room)

    def _hand_off(self, room_id: int, room: _Room) -> None:
        if room.failed is not None or room.handed_off or room.pages is None:
            return
        self.admission.release_slot(room_id)
        room.handed_off = True
        room.mark(Stage.kv_received)
        reused_tokens = room.num_reused * self.page_size
        received = self.kv_bytes(len(room.prompt) - reused_tokens)
        self.metrics.transfer_bytes.labels(direction="in").inc(received)
        room.note_kv(received, self.agent.ctx.compat.transfer_backend)
        if room.num_reused:
            self.metrics.decode_reuse_pages.inc(room.num_reused)
            self.metrics.decode_reuse_bytes.inc(self.kv_bytes(reused_tokens))
        if room.pages_at is not None:
            self.metrics.transfer_seconds.observe(time.monotonic() - room.pages_at)
        if room.first_token is None:
            room.handed_off = False
            self.fail(room_id, "protocol_error: no first token from prefill")
            return
        try:
            self.engine.add_request(
                EngineRequest(
                    room.rid,
                    room.prompt,
                    room.sampling,
                    mode=SequenceMode.prefilled,
                    page_table=list(room.pages),
                    first_token=room.first_token,
                    first_logprobs=(
                        room.first_logprobs.to_engine() if room.first_logprobs else None
                    ),
                )
            )
        except RequestRejected as err:
            room.handed_off = False
            self.fail(room_id, f"rejected: {err}")
            return
        stage_trace.mark(room_id, "decode.engine_add")
        # Prefill sampled the first token already: the client gets it now,
        # not after the first decode step.
        for output in self.engine.report_first_token(room.rid):
            self.service.deliver(output)
        self._forget_if_released(room_id, room)

    def _maybe_free(self, room_id: int, room: _Room) -> None:
        if not self.all_ranks(room, "released"):
            return
        if room.handed_off:
            self._forget(room_id)  # the pages belong to the engine request now
            return
        if room.failed is None:
            return  # released without failing: a success hand-off is on its way
        if room.pages is not None:
            self._give_back(room.pages, room.num_reused)
            room.pages = None
            room.num_reused = 0
        if self.admission.holds_slot(room_id):
            self.admission.release_slot(room_id)
        self._forget(room_id)

    def _forget_if_released(self, room_id: int, room: _Room) -> None:
        if self.all_ranks(room, "released"):
            self._forget(room_id)

    def on_failed(self, room_id: int, room: _Room) -> None:
        self.admission.cancel(room_id)
        if self.recompute and not room.aborted:
            # Decode holds the whole model: compute the prompt here instead.
            try:
                self.engine.add_request(EngineRequest(room.rid, room.prompt, room.sampling))
                self.metrics.failures.labels(reason="recomputed").inc()
                # The rid now belongs to the engine; the room only waits for its pages.
                del self.rid_room[room.rid]
                return
            except RequestRejected as err:
                room.failed = f"{room.failed}; recompute rejected: {err}"
        self.service.fail(room.rid, f"kv transfer failed: {room.failed}", status=502)
        if room.pages is None and self.all_ranks(room, "released"):
            self._forget(room_id)

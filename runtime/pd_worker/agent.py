"""The per-rank PD agent: one rank's room table, transfer endpoint and loop.

Threads of a rank process and what they may touch:
- the agent thread owns the room table: every table call happens under
  `self.lock`, fed from `self.inbox` (decoded peer messages, group
  commands, transfer completions, HTTP results) and `tick()` every 50 ms;
- the endpoint's I/O thread decodes each control frame and hands the step
  over with `run_or_post`: run there when the agent is idle, else queued
  (it never waits for the lock);
- the runner (engine) thread calls the prefill chunk hook, which takes the
  lock briefly to enqueue transfer jobs;
- a small asyncio loop thread runs HTTP calls (bootstrap registration,
  /route fetches, heartbeats) and posts their results back to the inbox.

The leader of the group additionally runs a coordinator on the engine
thread; this agent hands it its reports through `report_sink`, followers
send theirs to the leader's endpoint (see `group.py`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdcluster.runtime import stage_trace
from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.pd.compat import CompatInfo
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd.instance_counts import RankCountsBook
from pdcluster.runtime.pd.peer_address import BootstrapAddress, ZmqEndpoint
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.group import (
    GroupFail,
    GroupMessage,
    GroupOpen,
    GroupPageKeys,
    GroupProtocolError,
    GroupReport,
    GroupStats,
    OpenAssembly,
    ReportKind,
    decode_group,
    encode_group,
    is_group_frame,
    wire_messages,
)
from pdcluster.runtime.spec import Role, TransferSpec
from pdcluster.runtime.transfer.curve import cluster_keys
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig
from pdcluster.runtime.transfer.identity import claim_mismatch, group_must_be_local, group_route

log = logging.getLogger("pdcluster.pd")

TICK_S = 0.05
# Followers push their counters on change and at least this often; the
# leader reports a follower silent for STATS_STALE_S as missing.
STATS_PUSH_S = 1.0
STATS_STALE_S = 3.0


@dataclass
class AgentContext:
    """Everything a rank agent needs to know about itself (built at start-up)."""

    role: Role  # prefill or decode
    cluster: str
    instance: int
    coord: RankCoord
    group_rank: int  # index inside the dp group (global rank order, dp excluded)
    group_size: int
    shape: InstanceShape  # the whole instance (all dp groups)
    compat: CompatInfo
    token: str
    room_settings: RoomSettings
    transfer: TransferSpec
    layers: tuple[int, int]  # global layer range of this rank
    heads: tuple[int, int]  # global kv-head range of this rank
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    host: str
    advertise_host: str
    bootstrap_address: BootstrapAddress  # prefill: this instance's bootstrap server
    curve: bool = False  # spec.auth.zmqCurve: encrypt and authenticate ZMQ with token keys
    # Which start of this rank's pod (its uid on Kubernetes, $PDCLUSTER_INCARNATION);
    # None in local mode. Registered with the bootstrap server (prefill) or in
    # the KV layout (decode), so a peer tells a loss report about this pod from
    # one about its predecessor at the same address.
    incarnation: str | None = None
    stats: Counter[str] = field(default_factory=Counter)


def model_fingerprint(
    model_name: str, seed: int, config: Any, tokenizer: str, chat_template: str
) -> str:
    """What both sides must share: the weights (name, seed, architecture), the
    tokenizer and the chat template (each leg tokenizes the request itself).

    `weights=… tokenizer=… chat_template=…`, so a mismatch can name the part
    that differs (`compat.describe`).
    """
    text = f"{model_name}|{seed}|{config!r}"
    weights = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"weights={weights} tokenizer={tokenizer} chat_template={chat_template}"


class AsyncRunner:
    """An asyncio loop on its own thread for the agent's HTTP calls."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, coro: Coroutine[Any, Any, Any], done: Callable[[Any, BaseException | None], None]
    ) -> Future[Any]:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)

        def finish(f: Future[Any]) -> None:
            err = f.exception()
            done(None if err is not None else f.result(), err)

        fut.add_done_callback(finish)
        return fut

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


# The field naming a message's own sender, where it is not `decode_endpoint`.
_SENDER_FIELD: dict[type, str] = {pdmsg.LayoutAck: "endpoint"}


def _claimed_sender(msg: Any) -> str | None:
    """The endpoint a message names as its own sender, if it names one."""
    claimed = getattr(msg, _SENDER_FIELD.get(type(msg), "decode_endpoint"), None)
    return claimed if isinstance(claimed, str) else None


class RankAgent:
    """Shared machinery; `PrefillAgent` and `DecodeAgent` add the role's logic."""

    def __init__(self, ctx: AgentContext, pool: Any) -> None:
        self.ctx = ctx
        self.pool = pool
        self.lock = threading.RLock()
        self.inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        # Steps posted and not yet run (under `_queued_lock`): `run_or_post`
        # runs a step here only when none is ahead of it.
        self._queued = 0
        self._queued_lock = threading.Lock()
        # True while the lock's holder runs a step or a tick: a step handed
        # over from inside one is queued behind it, never run nested in it.
        self._in_step = False
        self.endpoint = Endpoint(
            EndpointConfig(
                host=ctx.host,
                advertise_host=ctx.advertise_host,
                # A peer that takes nothing for as long as a failed room may wait
                # for its writes to drain is stuck: drop it (its rooms fail) rather
                # than let it hold the sender's buffers and stall every other room.
                send_timeout=ctx.room_settings.release_s,
                curve=cluster_keys(ctx.token) if ctx.curve else None,
                token=ctx.token,
            ),
            on_control=self._on_control,
        )
        # Ranks of an instance sharing a pod keep their group traffic on loopback.
        self.endpoint.local_only = self._group_frame_must_be_local
        self.endpoint.start()
        self.aio = AsyncRunner(f"pd-http-{ctx.group_rank}")
        self.leader_address: ZmqEndpoint | None = None
        self.follower_addresses: list[ZmqEndpoint] = []
        # Follower: room openings whose page keys are still arriving (group.py).
        self.openings = OpenAssembly()
        # Leader only: where this rank's own reports go (the coordinator's queue).
        self.report_sink: Callable[[GroupReport], None] | None = None
        self.group_sink: Callable[[GroupReport], None] | None = None
        # Leader only (set in start()): the followers' latest counters.
        self.rank_counts: RankCountsBook | None = None
        # Its own lock: an agent step may hold `self.lock` for a while, and the
        # admin endpoint reading the counters must not wait for it.
        self._counts_lock = threading.Lock()
        self._pushed: tuple[float, dict[str, int]] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pd-agent-{ctx.group_rank}", daemon=True
        )

    @property
    def address(self) -> ZmqEndpoint:
        """This rank's ZMQ endpoint, as peers and the group's ranks reach it."""
        return ZmqEndpoint(self.endpoint.address)

    def start(self) -> None:
        if self.follower_addresses:
            followers = [i for i in range(self.ctx.group_size) if i != self.ctx.group_rank]
            self.rank_counts = RankCountsBook(followers, STATS_STALE_S)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self.post(lambda: None)
        self._thread.join(5)
        self.aio.close()
        self.endpoint.close()

    # ------------------------------------------------------------------ loop
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the agent thread (thread-safe)."""
        with self._queued_lock:
            self._queued += 1
        self.inbox.put(fn)

    def run_or_post(self, fn: Callable[[], None]) -> None:
        """Run `fn` here and now if the agent is idle, else `post` it.

        For the steps on a request's path (a peer's message, a room opening,
        its first token): handing them to the agent thread costs a thread
        wake-up and a GIL hand-off each (0.3-0.5 ms on a busy two-core box).
        "Idle" is: the lock is free and no posted step is waiting or running,
        so the steps still run one at a time in the order they were handed
        over, as if every one had been posted, only sooner. The caller never
        waits for the agent (a try-lock). Its error is logged, as on the
        agent thread, never raised to the caller.
        """
        if not self.lock.acquire(blocking=False):
            self.post(fn)
            return
        try:
            with self._queued_lock:
                ahead = self._queued
            if ahead or self._in_step:
                self.post(fn)
                return
            self._in_step = True
            try:
                fn()
            finally:
                self._in_step = False
        except Exception:
            log.exception("rank %s: agent step failed", self.ctx.coord)
        finally:
            self.lock.release()

    def _run_queued(self, fn: Callable[[], None]) -> None:
        """Agent thread, under the lock: one posted step, counted done even if it fails."""
        try:
            fn()
        finally:
            with self._queued_lock:
                self._queued -= 1

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stopping.is_set():
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                fn = self.inbox.get(timeout=timeout)
            except queue.Empty:
                fn = None
            try:
                with self.lock:
                    self._in_step = True
                    try:
                        if fn is not None:
                            self._run_queued(fn)
                        while True:
                            try:
                                queued = self.inbox.get_nowait()
                            except queue.Empty:
                                break
                            self._run_queued(queued)
                        if time.monotonic() >= next_tick:
                            self.tick(time.monotonic())
                            self.publish_stats()
                            self.push_stats(time.monotonic())
                            next_tick = time.monotonic() + TICK_S
                    finally:
                        self._in_step = False
            except Exception:
                log.exception("rank %s: agent step failed", self.ctx.coord)

    def tick(self, now: float) -> None:
        """Role hook: timeouts, drains; called under the lock every TICK_S."""

    def fail_all_rooms(self, reason: str) -> None:
        """Any thread: fail every live room of this rank's table (the engine is hung)."""

        def run() -> None:
            now = time.monotonic()
            for view in self.table_views(now):
                if view["state"] not in ("Failed", "Success"):
                    self.fail_room(int(view["room"]), reason, now)

        self.post(run)

    def fail_room(self, room: int, reason: str, now: float) -> None:
        """Role hook (agent thread): fail one room of the table with `reason`."""
        raise NotImplementedError

    def publish_stats(self) -> None:
        """Copy the endpoint's drop counters into `ctx.stats` (server info, metrics).

        Frames the endpoint drops itself (wrong part count, unknown kind,
        oversized, bad sender address) never reach the agent, so without this
        garbage on the socket would go uncounted.
        """
        for reason, count in self.endpoint.stats.items():
            self.ctx.stats[f"endpoint:{reason}"] = count

    def counts(self) -> dict[str, int]:
        """A copy of this rank's counters (the endpoint thread may bump one meanwhile)."""
        for _ in range(5):
            try:
                return dict(self.ctx.stats)
            except RuntimeError:  # resized during the copy: try again
                continue
        return {}

    def push_stats(self, now: float) -> None:
        """Follower: send the counters to the leader when they changed, or as a keepalive."""
        if self.leader_address is None:
            return
        counts = self.counts()
        if self._pushed is not None:
            at, last = self._pushed
            if counts == last and now - at < STATS_PUSH_S:
                return
        self._pushed = (now, counts)
        msg = GroupStats(self.ctx.group_rank, str(self.ctx.coord), counts)
        self.send_group(self.leader_address, encode_group(msg))

    def send_group(self, address: str, data: bytes) -> None:
        """A group frame to a rank of this instance, over loopback when it shares the pod."""
        self.endpoint.send_control(group_route(address, self.ctx.host, self.address), data)

    def _group_frame_must_be_local(self, data: bytes) -> bool:
        # Endpoint I/O thread; the group's addresses are set once at start-up.
        if not is_group_frame(data):
            return False
        peers: list[str] = [a for a in (self.leader_address, *self.follower_addresses) if a]
        return group_must_be_local(self.ctx.host, self.address, peers)

    def group_counts(self, now: float) -> tuple[dict[str, dict[str, int]], list[str]]:
        """Leader: each follower's last counters and the followers missing (any thread)."""
        with self._counts_lock:
            if self.rank_counts is None:
                return {}, []
            return self.rank_counts.by_rank(), self.rank_counts.missing(now)

    # ------------------------------------------------------------ inbound
    def _on_control(self, sender: str, data: bytes) -> None:
        # Endpoint I/O thread: decode here (cheap); act here when the agent is
        # idle, else on the agent thread, in arrival order either way.
        if is_group_frame(data):
            if sender != self.leader_address and sender not in self.follower_addresses:
                # Only this dp group's ranks coordinate it; a peer outside it
                # must not open, fail or report rooms here.
                self.ctx.stats["group_reject:not_in_group"] += 1
                return
            try:
                group = decode_group(data)
            except GroupProtocolError as err:
                # The error text quotes the peer's bytes: count by its code only.
                self.ctx.stats[f"group_reject:{str(err).split(':', 1)[0]}"] += 1
                return
            self.run_or_post(lambda: self._on_group_checked(group))
            return
        try:
            msg = pdmsg.decode(data)
        except pdmsg.ProtocolError as err:
            self.ctx.stats[f"reject:{err.reason}"] += 1
            log.debug("rank %s: dropped frame from %s: %s", self.ctx.coord, sender, err)
            return
        if claim_mismatch(sender, _claimed_sender(msg)):
            # The connection proved `sender`; a message speaking for another
            # endpoint is forged: acting on it (or answering there) would let
            # any peer fail another's rooms.
            self.ctx.stats["reject:sender_mismatch"] += 1
            return
        stage_trace.mark_message(self.ctx.role, "rx", msg)
        self.run_or_post(lambda: self.on_message(msg, time.monotonic(), sender))

    def _on_group_checked(self, msg: GroupMessage) -> None:
        """Leader bookkeeping (stats, reports) here; every other command to the role."""
        handler = _LEADER_HANDLERS.get(type(msg))
        if handler is None:
            self.on_group(msg, time.monotonic())
        else:
            handler(self, msg)

    def _on_group_stats(self, msg: GroupStats) -> None:
        if self.rank_counts is None:
            self.ctx.stats["group_reject:not_leader"] += 1
            return
        try:
            with self._counts_lock:
                self.rank_counts.update(msg.rank, msg.name, msg.counts, time.monotonic())
        except ValueError:
            self.ctx.stats["group_reject:bad_stats"] += 1

    def _on_group_report(self, msg: GroupReport) -> None:
        if self.group_sink is None:
            self.ctx.stats["group_reject:not_leader"] += 1
            return
        self.group_sink(msg)

    def on_message(self, msg: Any, now: float, sender: str | None = None) -> None:
        """A peer's message; `sender`: the endpoint its connection proved."""
        raise NotImplementedError

    # The group commands a role's ranks follow: message type -> handler (each
    # role's module sets it below its class). A command a role does not know is
    # ignored.
    group_handlers: ClassVar[Mapping[type, Callable[[Any, Any, float], None]]] = {}

    def on_group(self, msg: GroupMessage, now: float) -> None:
        if isinstance(msg, GroupOpen | GroupPageKeys):
            opened = self._assemble(msg)
            if opened is None:
                return
            msg = opened
        elif isinstance(msg, GroupFail):
            self.openings.forget(msg.room)
        handler = self.group_handlers.get(type(msg))
        if handler is not None:
            handler(self, msg, now)

    def _assemble(self, msg: GroupOpen | GroupPageKeys) -> GroupOpen | None:
        """The opening to act on once every page key of it arrived, else None."""
        try:
            return self.openings.take(msg)
        except GroupProtocolError as err:
            code = str(err).split(":", 1)[0]
            self.ctx.stats[f"group_reject:{code}"] += 1
            log.warning("rank %s: room %s cannot open: %s", self.ctx.coord, msg.room, err)
            self.report(msg.room, "failed", f"rejected: {code}")
            return None

    # ------------------------------------------------------------ outbound
    def send(self, endpoint: str, message: Any) -> None:
        stage_trace.mark_message(self.ctx.role, "tx", message)
        self.endpoint.send_control(endpoint, pdmsg.encode(message))

    def report(
        self,
        room: int,
        kind: ReportKind,
        reason: str | None = None,
        first_token: int | None = None,
        sent_tokens: int | None = None,
        first_logprobs: pdmsg.FirstLogprobs | None = None,
    ) -> None:
        rep = GroupReport(
            room, self.ctx.group_rank, kind, reason, first_token, sent_tokens, first_logprobs
        )
        if self.report_sink is not None:
            self.report_sink(rep)
        elif self.leader_address is not None:
            self.send_group(self.leader_address, encode_group(rep))
        else:
            log.error("rank %s: no leader to report %s for room %s", self.ctx.coord, kind, room)

    def broadcast(self, msg: GroupMessage, *, here_now: bool = False) -> None:
        """Leader: a group command to every follower and to this rank itself.

        `here_now`: this rank applies it on the calling thread when the lock
        is free (`run_or_post`), for a room's opening and its pages.
        """
        stage_trace.mark_message(self.ctx.role, "bcast", msg)
        # A room's opening may go as several frames (its page keys in chunks).
        frames = [encode_group(part) for part in wire_messages(msg)]
        for addr in self.follower_addresses:
            for data in frames:
                self.send_group(addr, data)
        apply = lambda: self.on_group(msg, time.monotonic())  # noqa: E731
        if here_now:
            self.run_or_post(apply)
        else:
            self.post(apply)

    def room_views(self, now: float) -> list[dict[str, Any]]:
        with self.lock:
            views = self.table_views(now)
        return views

    def table_views(self, now: float) -> list[dict[str, Any]]:
        raise NotImplementedError

    def transport_report(self) -> dict[str, Any]:
        """The KV backend and, for nixl, what UCX negotiated (for /get_server_info)."""
        report: dict[str, Any] = {"backend": str(self.ctx.transfer.backend)}
        nixl_agent = getattr(self, "nixl_agent", None)
        if nixl_agent is not None:
            report.update(nixl_agent.report(bool(self.ctx.transfer.ucx.require_rdma)))
            stats = getattr(getattr(self, "transport", None), "stats", None)
            if stats is not None:
                report["writes"] = dict(stats)
        return report


def make_nixl_agent(address: str, pool: Any, *, progress_thread: bool = True) -> Any:
    """This rank's NIXL agent with `pool` registered (the `nixl` backend only).

    `progress_thread=False` for a rank that only initiates WRITEs (prefill).
    """
    from pdcluster.runtime.transfer.nixl_agent import NixlAgent

    return NixlAgent(address, pool, progress_thread=progress_thread)


# Group messages only the leader takes, whatever the role.
_LEADER_HANDLERS: dict[type, Callable[[RankAgent, Any], None]] = {
    GroupStats: RankAgent._on_group_stats,
    GroupReport: RankAgent._on_group_report,
}

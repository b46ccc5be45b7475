"""The worker half of the connector: one rank's agent of ours, on vLLM's KV cache.

`register_kv_caches` wraps vLLM's KV buffer as a pool (`KVPool.over`, the
order read by `kv_layout.describe_vllm_kv`) and starts our own rank agent on
it: a `PrefillAgent` (it registers with its instance's bootstrap server on
the side port, and streams each chunk's KV as vLLM computes it) or a
`DecodeAgent` (/route, compatibility, heartbeats, KV frames landing in the
blocks vLLM reserved). Nothing of the protocol is redone here; each vLLM hook
hands one step to the agent and reads back what its room table concluded:

- `handle_preemptions` / `start_load_kv`: the step's commands go to the agent
  (once per step, before its chunks);
- `wait_for_save`: each chunk this step computed becomes transfer jobs;
- `get_finished`: the requests whose load or send ended (`worker_rooms.py`).
  In a step that computes nothing (vLLM steps in a loop while a request
  waits for its KV, or while a prefill holds blocks for a decode) it waits
  up to `IDLE_WAIT_S` for one to end instead of returning at once: the
  loop would otherwise spin a core that the transfer it waits for needs;
- `build_connector_worker_meta`: rooms failed here, peer verdicts, counters.

A preempted prefill request's blocks may go to another request in this
very step: its room fails and `handle_preemptions` waits (bounded by the
release timeout) until no write still reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import httpx
import torch

from pdcluster.runtime.engine.kv_pool import KVPool
from pdcluster.runtime.pd.peer_address import BootstrapAddress
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.agent import AgentContext, RankAgent
from pdcluster.runtime.pd_worker.group import GroupFail, GroupOpen, GroupPages, GroupReport
from pdcluster.runtime.spec import Role
from pdcluster.runtime.transfer.page_span import num_written_tokens
from pdcluster.runtime.vllm_connector.commands import Chunk, RankNews, Refuse, StepCommands
from pdcluster.runtime.vllm_connector.kv_layout import LayerView, VllmKV, describe_vllm_kv
from pdcluster.runtime.vllm_connector.rank import EngineFacts
from pdcluster.runtime.vllm_connector.settings import ConnectorSettings
from pdcluster.runtime.vllm_connector.worker_rooms import Finished, WorkerRooms

log = logging.getLogger("pdcluster.vllm")

# How long applying a step's commands may wait for a busy agent (seconds).
APPLY_WAIT_S = 5.0
# How long a step that computes nothing waits for a load or send to end (seconds): the
# longest a request arriving meanwhile waits for the engine to take it.
IDLE_WAIT_S = 0.005
# How often a decode rank compares its peer verdicts with those it last sent (seconds).
VERDICT_POLL_S = 0.2

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"kv cache dtype {dtype} is not one of {sorted(_DTYPES.values())}")
    return name


def vllm_pool(
    kv_caches: Mapping[str, torch.Tensor], backend: str, head_size: int, kernel: str | None
) -> tuple[KVPool, VllmKV]:
    """vLLM's per-layer KV views (layer order) as one pool over their shared buffer."""
    tensors = list(kv_caches.values())
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        raise ValueError("layers sharing one KV cache are not supported by the PDCluster connector")
    tensors.sort(key=lambda t: t.data_ptr())
    views = [
        LayerView(tuple(t.shape), tuple(t.stride()), t.data_ptr())  # type: ignore[arg-type]
        for t in tensors
    ]
    kv = describe_vllm_kv(
        views,
        backend=backend,
        dtype=dtype_name(tensors[0].dtype),
        head_size=head_size,
        kernel=kernel,
    )
    return KVPool.over(_region(tensors[0], kv), kv.shape), kv


def _region(first: torch.Tensor, kv: VllmKV) -> torch.Tensor:
    """The pool's bytes as one tensor of its dims, over vLLM's storage (no copy)."""
    numel = kv.shape.numel
    storage = first.untyped_storage()
    if first.storage_offset() * first.element_size() + kv.nbytes > storage.nbytes():
        raise ValueError("vLLM's KV views reach past their buffer")
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    flat.set_(storage, first.storage_offset(), (numel,), (1,))
    if flat.data_ptr() != kv.address:
        raise ValueError("vLLM's KV buffer does not start at its first layer")
    return flat.view(kv.shape.dims())


class ConnectorWorker:
    """One rank: our agent on vLLM's cache, fed one vLLM step at a time."""

    def __init__(
        self, settings: ConnectorSettings, facts: EngineFacts, token: str, name: str
    ) -> None:
        facts.check()
        self.settings = settings
        self.facts = facts
        self.token = token
        self.name = name  # the rank's name in counters and logs
        self.rooms = WorkerRooms(facts.role)
        # Guards `rooms` (reports come from the agent thread); notified on each report.
        self._lock = threading.Condition()
        self._idle_step = False
        self.agent: RankAgent | None = None
        self._applied_step = -1
        self._chunks: list[Chunk] = []
        # Decode: room -> (when its pages left, the bytes it will receive).
        self._loads: dict[int, tuple[float, int]] = {}
        self._received_bytes = 0
        self._received_us = 0
        self._opened: dict[int, int] = {}  # room -> prompt tokens (decode)
        self._closed = threading.Event()

    # ------------------------------------------------------------ start-up
    def register(
        self, kv_caches: Mapping[str, torch.Tensor], backend: str, kernel: str | None
    ) -> None:
        """vLLM allocated its KV cache: start the rank's agent on it."""
        pool, kv = vllm_pool(kv_caches, backend, self.facts.head_size, kernel)
        self.facts.check_cache(pool.shape)
        settings, facts = self.settings, self.facts
        heads = facts.heads
        advertise = settings.advertise_host or settings.host
        ctx = AgentContext(
            role=facts.role,
            cluster=settings.cluster,
            instance=0,
            coord=facts.coord,
            group_rank=facts.tp_rank,
            group_size=facts.tp_size,
            shape=facts.shape,
            compat=facts.compat(kv.kv_layout, settings.transfer.backend),
            token=self.token,
            room_settings=RoomSettings.from_spec(
                settings.transfer,
                prefill_wait_s=settings.transfer.prefill_wait_timeout_seconds,
                max_rooms=settings.transfer.max_rooms + settings.transfer.room_queue_limit,
            ),
            transfer=settings.transfer,
            layers=(0, facts.num_layers),
            heads=heads,
            num_layers=facts.num_layers,
            num_kv_heads=facts.num_kv_heads,
            head_dim=facts.head_size,
            page_size=facts.block_size,
            num_pages=pool.shape.num_pages,
            host=settings.host,
            advertise_host=advertise,
            bootstrap_address=BootstrapAddress(f"{advertise}:{settings.side_port}"),
            curve=settings.zmq_curve,
            incarnation=settings.incarnation,
        )
        agent: Any
        if facts.role is Role.prefill:
            from pdcluster.runtime.pd_worker.prefill_agent import PrefillAgent

            agent = PrefillAgent(ctx, pool, is_leader=False)
        else:
            from pdcluster.runtime.pd_worker.decode_agent import DecodeAgent

            agent = DecodeAgent(ctx, pool, None)
        agent.report_sink = self._on_report
        agent.start()
        if facts.role is Role.prefill:
            agent.register()
        else:
            host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
            side = f"http://{host}:{settings.side_port}"
            threading.Thread(
                target=self._push_verdicts,
                args=(agent, side),
                name=f"{self.name}-verdicts",
                daemon=True,
            ).start()
        self.agent = agent
        log.info(
            "%s: %s rank %s on vLLM's %s cache (layout %s, %d blocks), endpoint %s",
            self.name,
            facts.role,
            facts.coord,
            backend,
            kv.kv_layout,
            pool.shape.num_pages,
            agent.address,
        )

    def _push_verdicts(self, agent: Any, side: str) -> None:
        """Decode: send this rank's peer verdicts to the side port whenever they change.

        vLLM runs a step (and hands the scheduler our news) only while it has
        requests; an idle decode's verdicts (a prefill reported lost, then
        seen answering again) must still reach the router, which holds a
        prefill out while a decode reports it down.
        """
        sent: dict[str, str] | None = None
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        with httpx.Client(timeout=2.0, trust_env=False, headers=headers) as http:
            while not self._closed.wait(VERDICT_POLL_S):
                verdicts = agent.peers_down()
                if verdicts == sent:
                    continue
                try:
                    resp = http.put(
                        side + "/admin/rank_peers_down",
                        json={"rank": self.name, "peers_down": verdicts},
                    )
                except httpx.HTTPError as err:
                    log.debug("%s: verdicts not sent yet: %s", self.name, err)
                    continue
                if resp.status_code == 200:
                    sent = verdicts
                else:
                    log.warning("%s: verdicts refused: %s", self.name, resp.status_code)

    def _on_report(self, rep: GroupReport) -> None:
        # Agent thread (or whichever thread ran the step that concluded it).
        with self._lock:
            self.rooms.report(rep)
            self._lock.notify_all()
            started = self._loads.pop(rep.room, None)
            if started is not None and rep.kind == "complete":
                # Decode: a load's bytes and time, pages sent → every source done.
                at, nbytes = started
                self._received_bytes += nbytes
                self._received_us += int((time.monotonic() - at) * 1e6)

    # ------------------------------------------------------------ each step
    def apply(self, step: int, commands: StepCommands, idle: bool = False) -> None:
        """The step's commands, once (vLLM may hand the metadata to two hooks).
        `idle`: the step computes nothing (see `finished`)."""
        if step == self._applied_step or self.agent is None:
            return
        self._applied_step = step
        self._idle_step = idle
        self._chunks = []
        for req_id, cmd in commands.commands:
            if isinstance(cmd, Chunk):
                self._chunks.append(cmd)
                continue
            with self._lock:
                if isinstance(cmd, Refuse):
                    assert req_id is not None
                    self.rooms.refused(req_id, cmd.room, cmd.reason)
                    continue
                if isinstance(cmd, GroupOpen):
                    assert req_id is not None
                    self.rooms.opened(req_id, cmd.room)
                    if self.facts.role is Role.decode:
                        self._opened[cmd.room] = cmd.num_tokens
                elif isinstance(cmd, GroupPages):
                    self.rooms.pages(cmd.room)
                    self._start_load(cmd)
                elif isinstance(cmd, GroupFail):
                    self._opened.pop(cmd.room, None)
                    self._loads.pop(cmd.room, None)
            self._on_agent(partial(self._to_agent, cmd))
        if commands.preempted:
            self._wait_unread(commands)

    def _start_load(self, cmd: GroupPages) -> None:
        """Decode, under the lock: a room's load starts now (for its counters)."""
        num_tokens = self._opened.pop(cmd.room, 0)
        if self.agent is None or not num_tokens:
            return
        shape = self.agent.pool.shape
        first = 0 if cmd.reuse is None else cmd.reuse.num_pages * shape.page_size
        tokens = num_written_tokens(num_tokens, first, shape.page_size, shape.whole_pages)
        self._loads[cmd.room] = (time.monotonic(), tokens * shape.bytes_per_token)

    def _to_agent(self, cmd: Any) -> None:
        assert self.agent is not None
        self.agent.on_group(cmd, time.monotonic())

    def _on_agent(self, fn: Callable[[], None]) -> None:
        """Run `fn` as one of the agent's steps, in order with its others, and wait."""
        assert self.agent is not None
        done = threading.Event()

        def step() -> None:
            try:
                fn()
            finally:
                done.set()

        self.agent.run_or_post(step)
        if not done.wait(APPLY_WAIT_S):
            log.error("%s: the agent did not take a step within %.0fs", self.name, APPLY_WAIT_S)

    def _wait_unread(self, commands: StepCommands) -> None:
        """Preempted prefill rooms: until no write reads their blocks (they failed above)."""
        sender = getattr(self.agent, "sender", None)
        if sender is None:
            return
        deadline = time.monotonic() + self.settings.transfer.abort_release_timeout_seconds
        rooms = {
            cmd.room
            for req_id, cmd in commands.commands
            if req_id in commands.preempted and hasattr(cmd, "room")
        }
        for room in rooms:
            if not sender.drain(room, timeout=max(0.0, deadline - time.monotonic())):
                log.error("%s: room %d still has writes reading preempted blocks", self.name, room)

    def after_forward(self) -> None:
        """`wait_for_save`: this step's chunks are computed; their KV may leave."""
        if not self._chunks or self.agent is None:
            return
        on_chunk = getattr(self.agent, "on_chunk", None)
        for chunk in self._chunks:
            if on_chunk is not None:
                on_chunk(chunk.rid, chunk.pages, 0, chunk.end)
        self._chunks = []

    def finished(self, finished_req_ids: set[str]) -> Finished:
        """The requests whose load or send ended. In a step that computes nothing,
        wait (briefly) for one: vLLM calls again at once otherwise."""
        with self._lock:
            self.rooms.vllm_finished(finished_req_ids)
            if self._idle_step:
                self._idle_step = False
                self._lock.wait_for(lambda: self.rooms.has_finished, IDLE_WAIT_S)
            return self.rooms.take_finished()

    def news(self) -> RankNews:
        """What the scheduler hears after this step: rooms failed here, and the peer
        verdicts and counters when they changed (a copy of a few dozen numbers per
        step; nothing travels when nothing changed)."""
        agent = self.agent
        if agent is not None:
            peers = agent.peers_down() if hasattr(agent, "peers_down") else None
            counts = self._counters(agent)
            with self._lock:
                if peers is not None:
                    self.rooms.peers_down(peers)
                self.rooms.counters(self.name, counts)
        with self._lock:
            return self.rooms.take_news()

    def _counters(self, agent: RankAgent) -> dict[str, int]:
        counts = agent.counts()
        receiver = getattr(agent, "receiver", None)
        if receiver is not None:
            counts.update({f"kv:{k}": v for k, v in receiver.stats.items()})
        with self._lock:
            sent = self.rooms.sent_tokens
            if self._received_bytes:
                counts["kv_received_bytes"] = self._received_bytes
                counts["kv_received_us"] = self._received_us
        if sent:
            # Every destination of a room got the same tokens of this rank's slice.
            counts["kv_sent_tokens"] = sent
            counts["kv_sent_bytes"] = sent * agent.pool.shape.bytes_per_token
        return counts

    def close(self) -> None:
        self._closed.set()
        if self.agent is not None:
            self.agent.close()
            self.agent = None

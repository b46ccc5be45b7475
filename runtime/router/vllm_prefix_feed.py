"""Following vLLM workers' prefix-cache events over ZMQ: the I/O half of
`vllm_event_stream.py`, and the vLLM counterpart of `prefix_feed.py`.

For every healthy worker of a role routed by `cache_aware` that publishes
its events (`Worker.kv_events`: the operator's pod annotations, or local
mode's `--kv-events`), one task holds a SUB socket on the worker's PUB port
and opens a DEALER on its replay port when the stream asks for a replay.
Each frame goes through the pure decoder (`vllm/kv_events.py`) and the
stream; the task only carries out what the stream answers (reset or update
the worker's `PrefixIndex` entry, ask for a replay) and exports the
stream's counts. A frame that does not decode is counted and dropped.

A worker that leaves the pool, turns unhealthy (a restart) or changes its
ports stops its task and its entry is forgotten; a healthy one starts again
from a replay. A socket error drops the entry and retries after a back-off.
Each router replica follows every worker on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdcluster.runtime.backoff import exponential_delay
from pdcluster.runtime.prefix_events import Apply
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.prefix_index import PrefixIndex
from pdcluster.runtime.router.vllm_block_keys import DEFAULT_MAX_BLOCKS
from pdcluster.runtime.router.vllm_event_stream import (
    Action,
    ApplyKeys,
    RequestReplay,
    ResetIndex,
    VllmEventStream,
)
from pdcluster.runtime.router.workers import KVEventPorts, Worker
from pdcluster.runtime.vllm.kv_events import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    KV_EVENTS_TOPIC,
    KVEventFrameError,
    decode_frame,
    decode_replay_reply,
    replay_request,
)

log = logging.getLogger(__name__)

# A replay that sends nothing for this long has failed (vLLM answers a replay
# from its publisher thread within its 0.1 s poll).
REPLAY_IDLE_TIMEOUT_S = 5.0
# Messages ZMQ queues per socket before dropping: a dropped live batch shows
# as a gap (a replay), a dropped replayed one as a short replay (a reset).
LIVE_HWM = 10_000
REPLAY_HWM = 20_000  # vLLM replays up to its buffer_steps (10,000) at once


@dataclass(eq=False)
class VllmPrefixFollower:
    index: PrefixIndex
    workers: Callable[[], Iterable[Worker]]  # the workers to follow, asked at each sync
    _: KW_ONLY
    page_size: int
    tokenizer: str = ""  # the router's tokenizer fingerprint (vLLM reads the same files)
    metrics: RouterMetrics | None = None
    max_blocks: int = DEFAULT_MAX_BLOCKS
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    replay_idle_timeout_s: float = REPLAY_IDLE_TIMEOUT_S
    max_backoff_s: float = 10.0
    topic: bytes = KV_EVENTS_TOPIC.encode()
    _tasks: dict[str, tuple[Worker, KVEventPorts, asyncio.Task[None]]] = field(
        default_factory=dict, init=False, repr=False
    )
    _ctx: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context, init=False, repr=False)

    def sync(self) -> None:
        """Follow exactly the eligible workers: start new tasks, stop stale ones."""
        wanted = {w.url: w for w in self.workers() if w.healthy and w.kv_events is not None}
        for url, (worker, ports, task) in list(self._tasks.items()):
            if wanted.get(url) is not worker or worker.kv_events != ports or task.done():
                task.cancel()
                del self._tasks[url]
                self.index.forget(url)
        for url, worker in wanted.items():
            if url not in self._tasks and worker.kv_events is not None:
                task = asyncio.create_task(self._follow(worker, worker.kv_events))
                self._tasks[url] = (worker, worker.kv_events, task)

    async def close(self) -> None:
        tasks = [task for _, _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------ one worker
    async def _follow(self, worker: Worker, ports: KVEventPorts) -> None:
        attempt = 0
        while True:
            try:
                await self._run(worker, ports)
            except Exception as err:  # a socket error, or a bug: never a silent stop
                self.index.forget(worker.url)
                attempt += 1
                delay = exponential_delay(0.2, self.max_backoff_s, attempt)
                expected = isinstance(err, zmq.ZMQError | ValueError)
                log.warning(
                    "kv events of %s failed (%s); retry in %.1f s",
                    worker.url,
                    err,
                    delay,
                    exc_info=not expected,
                )
                await asyncio.sleep(delay)

    def _socket(self, kind: int, hwm: int, host: str, port: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        # The transport's own bound, over the decoder's: a bigger frame costs no memory.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes + 4096)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    async def _run(self, worker: Worker, ports: KVEventPorts) -> None:
        stream = VllmEventStream(
            page_size=self.page_size, tokenizer=self.tokenizer, max_blocks=self.max_blocks
        )
        sub = self._socket(zmq.SUB, LIVE_HWM, worker.host, ports.publish)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await self._act(worker, ports, stream, stream.start())
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        log.info("kv events of %s: publisher disconnected", worker.url)
                        await self._act(worker, ports, stream, stream.on_disconnect())
                if sub in ready:
                    parts = await sub.recv_multipart()
                    try:
                        frame = decode_frame(
                            parts, topic=self.topic, max_payload_bytes=self.max_payload_bytes
                        )
                    except KVEventFrameError as err:
                        log.warning("kv events of %s: batch dropped: %s", worker.url, err)
                        actions = stream.on_bad_frame(err.reason)
                    else:
                        actions = stream.on_live(frame)
                    await self._act(worker, ports, stream, actions)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _act(
        self, worker: Worker, ports: KVEventPorts, stream: VllmEventStream, actions: list[Action]
    ) -> None:
        for action in actions:
            if isinstance(action, ResetIndex):
                self.index.reset(worker.url, action.snapshot)
            elif isinstance(action, ApplyKeys):
                result = self.index.apply(worker.url, action.batch)
                if result is not Apply.applied:  # the stream numbers every batch itself
                    raise ValueError(f"the index refused a batch of the stream ({result.value})")
            elif isinstance(action, RequestReplay):
                await self._replay(worker, ports, stream, action.from_seq)
        self._export(worker, stream)

    async def _replay(
        self, worker: Worker, ports: KVEventPorts, stream: VllmEventStream, from_seq: int
    ) -> None:
        """Ask the worker's replay socket for every batch from `from_seq`; one
        socket per replay, so a late answer to a failed one is never read."""
        dealer = self._socket(zmq.DEALER, REPLAY_HWM, worker.host, ports.replay)
        try:
            await dealer.send_multipart(replay_request(from_seq))
            while True:
                if not await dealer.poll(self.replay_idle_timeout_s * 1000):
                    log.warning(
                        "kv events of %s: replay from %d got no answer", worker.url, from_seq
                    )
                    await self._act(worker, ports, stream, stream.on_replay_failed())
                    return
                parts = await dealer.recv_multipart()
                try:
                    frame = decode_replay_reply(
                        parts, topic=self.topic, max_payload_bytes=self.max_payload_bytes
                    )
                except KVEventFrameError as err:
                    log.warning("kv events of %s: replayed batch dropped: %s", worker.url, err)
                    await self._act(worker, ports, stream, stream.on_bad_frame(err.reason))
                    continue
                if frame is None:
                    await self._act(worker, ports, stream, stream.on_replay_end())
                    return
                await self._act(worker, ports, stream, stream.on_replay(frame))
        finally:
            dealer.close(linger=0)

    def _export(self, worker: Worker, stream: VllmEventStream) -> None:
        counts, stream.counts = stream.counts, type(stream.counts)()
        if self.metrics is None:
            return
        counters = {
            "batches": self.metrics.kv_event_batches,
            "resyncs": self.metrics.kv_event_resyncs,
            "unindexed": self.metrics.kv_event_unindexed,
        }
        for (kind, reason), n in counts.items():
            counters[kind].labels(worker.url, reason).inc(n)

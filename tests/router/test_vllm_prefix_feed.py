"""The router following a vLLM worker's KV events over ZMQ
(runtime/router/vllm_prefix_feed.py), against a stand-in publisher that
speaks vLLM's wire protocol (a PUB socket and a ROUTER replay socket, as
`vllm.distributed.kv_events.ZmqEventPublisher` does)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import msgspec
import zmq

from pdcluster.runtime.prefix_keys import chain_page_keys, root_key
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.prefix_index import PrefixIndex
from pdcluster.runtime.router.vllm_event_stream import VLLM_KEY_SALT
from pdcluster.runtime.router.vllm_prefix_feed import VllmPrefixFollower
from pdcluster.runtime.router.workers import KVEventPorts, Worker
from pdcluster.runtime.spec import Role
from pdcluster.runtime.vllm.kv_events import KV_EVENTS_TOPIC

PAGE = 4
TOPIC = KV_EVENTS_TOPIC.encode()
END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def payload(tokens: list[int]) -> bytes:
    """One batch storing `tokens` as a chain from the root, as vLLM encodes it."""
    n = len(tokens) // PAGE
    event = {
        "type": "BlockStored",
        "block_hashes": [hash((tuple(tokens[: (i + 1) * PAGE]),)) & (2**64 - 1) for i in range(n)],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": PAGE,
        "lora_id": None,
        "medium": "GPU",
    }
    return msgspec.msgpack.encode([1.0, [event], 0])


class StandInPublisher:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, data in list(self.buffer):
                if seq >= first:
                    self.router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), data])
            self.router.send_multipart([client, *END])

    def publish(self, seq: int, data: bytes, *, keep: bool = True) -> None:
        if keep:
            self.buffer.append((seq, data))
        self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), data])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


async def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_the_follower_replays_follows_and_drops_a_malformed_batch_alone() -> None:
    publisher = StandInPublisher()
    worker = Worker(
        url="http://127.0.0.1:1",
        role=Role.colocated,
        healthy=True,
        kv_events=KVEventPorts(publisher.pub_port, publisher.replay_port),
    )
    index = PrefixIndex()
    metrics = RouterMetrics(lambda: [worker])
    root = root_key(VLLM_KEY_SALT)
    first, second = list(range(1, 9)), list(range(50, 54))

    def keys() -> set[bytes]:
        replica = index.replica(worker.url)
        return set() if replica is None else set(replica.keys)

    def counted(name: str, outcome: str) -> float:
        value = metrics.registry.get_sample_value(
            f"pdcluster_router_vllm_kv_event_{name}_total",
            {"worker": worker.url, ("outcome" if name == "batches" else "reason"): outcome},
        )
        return value or 0.0

    async def run() -> None:
        follower = VllmPrefixFollower(index, lambda: [worker], page_size=PAGE, metrics=metrics)
        try:
            # Batch 0 was published before the router came: it is replayed.
            publisher.buffer.append((0, payload(first)))
            follower.sync()
            want = set(chain_page_keys(first, PAGE, root))
            await wait_for(lambda: keys() == want, "the replayed batch")
            assert publisher.replay_requests == [0]
            # Live batches (sent until the subscription is through; repeats are duplicates).
            publisher.buffer.append((1, payload(second)))
            want |= set(chain_page_keys(second, PAGE, root))
            while keys() != want:
                publisher.publish(1, payload(second), keep=False)
                await asyncio.sleep(0.05)
            # A malformed batch is counted and dropped; the entries it may have
            # changed are dropped with it, and nothing else is disturbed.
            publisher.publish(2, b"\xc1 not msgpack")
            await wait_for(lambda: counted("batches", "bad_malformed") == 1, "the bad batch")
            await wait_for(lambda: keys() == set(), "the entries dropped")
            publisher.publish(3, payload(first))
            await wait_for(lambda: keys() == set(chain_page_keys(first, PAGE, root)), "batch 3")
            assert publisher.replay_requests == [0], "a bad batch is not asked for again"
            assert counted("resyncs", "bad_batch") == 1
            assert counted("batches", "applied") >= 3
            # A batch lost on the way (4) shows as a gap: it is replayed.
            third = list(range(70, 78))
            publisher.buffer.append((4, payload(third)))
            publisher.publish(5, payload(second))
            want = {*chain_page_keys(first, PAGE, root), *chain_page_keys(third, PAGE, root)}
            want |= set(chain_page_keys(second, PAGE, root))
            await wait_for(lambda: keys() == want, "the gap replayed")
            assert publisher.replay_requests == [0, 4]
            assert counted("resyncs", "gap") == 1
            # A worker that leaves the pool is forgotten.
            worker.healthy = False
            follower.sync()
            assert index.replica(worker.url) is None
        finally:
            await follower.close()

    try:
        asyncio.run(run())
    finally:
        publisher.close()

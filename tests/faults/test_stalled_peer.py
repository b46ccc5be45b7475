"""A peer that is connected but reads nothing (a hung process) is dropped, not waited on.

The endpoint hands KV payloads to libzmq without a copy; until libzmq
releases them, their staging buffers stay taken. A peer that never reads
would hold them forever and, with them, every transfer of the rank. Here a
raw ROUTER socket that never calls recv stands in for a SIGSTOPped decode
rank: its payloads must fail with "peer_stalled" within the send timeout,
and another peer must still be served.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig

MiB = 1 << 20


def test_payloads_to_a_peer_that_never_reads_fail_and_come_back() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)
    hung.setsockopt(zmq.RCVHWM, 1)
    hung.setsockopt(zmq.RCVBUF, 64 * 1024)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    received: list[bytes] = []
    got = threading.Event()

    def on_kv(header: bytes, payload: memoryview) -> None:
        received.append(header)
        got.set()

    live = Endpoint(EndpointConfig(), on_kv=on_kv)
    sender = Endpoint(EndpointConfig(send_timeout=0.5))
    live.start()
    sender.start()
    outcomes: list[str | None] = []
    lock = threading.Lock()

    def done(error: str | None) -> None:
        with lock:
            outcomes.append(error)

    try:
        payloads = [bytearray(8 * MiB) for _ in range(6)]
        for i, buf in enumerate(payloads):
            sender.send_kv(f"tcp://127.0.0.1:{port}", b"h%d" % i, buf, done, tag=1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with lock:
                if len(outcomes) == len(payloads):
                    break
            time.sleep(0.02)
        with lock:
            assert len(outcomes) == len(payloads), f"payloads still held: {outcomes}"
            assert "peer_stalled" in outcomes
        assert sender.stats.get("peer_stalled", 0) >= 1
        # Another peer is served as usual.
        sender.send_kv(live.address, b"ok", bytearray(1024), done, tag=2)
        assert got.wait(5)
        assert received == [b"ok"]
    finally:
        sender.close()
        live.close()
        hung.close(0)
        ctx.term()

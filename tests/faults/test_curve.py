"""CURVE on the ranks' ZMQ endpoints: only holders of the cluster token get a frame through.

Endpoints built with `cluster_keys(token)` talk to each other (encrypted);
a plain socket, or one keyed from another token, never completes the
handshake, so nothing it sends reaches the handlers — not even as a counted
reject.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from pdcluster.runtime.pd import messages as pdmsg
from pdcluster.runtime.transfer.curve import cluster_keys
from pdcluster.runtime.transfer.endpoint import Endpoint, EndpointConfig


class Inbox:
    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.event = threading.Event()

    def control(self, sender: str, data: bytes) -> None:
        self.items.append(data)
        self.event.set()


@pytest.fixture
def server() -> Any:
    inbox = Inbox()
    ep = Endpoint(EndpointConfig(curve=cluster_keys("cluster-a")), on_control=inbox.control)
    ep.start()
    yield ep, inbox
    ep.close()


def test_keys_are_derived_from_the_token() -> None:
    a, again, b = cluster_keys("cluster-a"), cluster_keys("cluster-a"), cluster_keys("cluster-b")
    assert a == again and a != b
    assert len(a.public) == len(a.secret) == 40
    assert "secret=<hidden>" in repr(a) and a.secret.decode() not in repr(a)
    with pytest.raises(ValueError, match="token"):
        cluster_keys("")


def test_endpoints_with_the_cluster_keys_talk(server: Any) -> None:
    ep, inbox = server
    client = Endpoint(EndpointConfig(curve=cluster_keys("cluster-a")))
    client.start()
    try:
        client.send_control(ep.address, pdmsg.HEADER + b"hello")
        assert inbox.event.wait(5)
        assert inbox.items == [pdmsg.HEADER + b"hello"]
    finally:
        client.close()


@pytest.mark.parametrize("keyed", ["plain", "other-token"])
def test_a_peer_without_the_token_gets_nothing_through(server: Any, keyed: str) -> None:
    ep, inbox = server
    if keyed == "plain":
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep.address)
        for _ in range(20):
            sock.send_multipart([b"C", b"tcp://127.0.0.1:9", pdmsg.HEADER + b"x"])
            sock.send_multipart([b"garbage"])
        time.sleep(0.5)
        sock.close(0)
        ctx.term()
    else:
        intruder = Endpoint(EndpointConfig(curve=cluster_keys("cluster-b")))
        intruder.start()
        try:
            intruder.send_control(ep.address, pdmsg.HEADER + b"x")
            time.sleep(0.5)
        finally:
            intruder.close()
    assert inbox.items == []
    assert ep.stats == {}  # not even a counted reject: nothing got past the handshake

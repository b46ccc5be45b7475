"""The multi-pod leader's starting server holds its port with the limits of every
other runtime server (docs/security.md, "Input limits").

Half-sent requests must not each hold a thread of the leader's process, must
be disconnected once the read deadline passes, and must not keep the
server from answering its probes meanwhile.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from pdcluster.runtime.http.limits import DEFAULT_LIMITS, ReadDeadlineProtocol
from pdcluster.runtime.pod_layout import PodLayout
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.starting_server import StartingServer

HALF_SENT = 60
READ_TIMEOUT_S = 1.0


@pytest.fixture
def starting() -> Iterator[tuple[StartingServer, str]]:
    port = free_port()
    limits = replace(DEFAULT_LIMITS, request_read_timeout_s=READ_TIMEOUT_S)
    server = StartingServer("127.0.0.1", port, PodLayout(num_ranks=4, ranks_per_pod=2), limits)
    server.start()
    yield server, f"http://127.0.0.1:{port}"
    server.close()


def _half_sent(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    return s


def _is_closed(s: socket.socket) -> bool:
    try:
        s.settimeout(0.05)
        return s.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        return True
    except TimeoutError:
        return False


def test_half_sent_requests_hold_no_thread_are_cut_and_probes_are_answered(
    starting: tuple[StartingServer, str],
) -> None:
    server, url = starting
    server.set_missing([2, 3])
    port = int(url.rsplit(":", 1)[1])
    before = threading.active_count()
    socks = [_half_sent(port) for _ in range(HALF_SENT)]
    try:
        time.sleep(0.3)
        # One event loop serves them all: no thread per connection.
        assert threading.active_count() - before < 5
        resp = httpx.get(url + "/health", timeout=2)
        assert resp.status_code == 503
        assert resp.json()["missing_ranks"] == [2, 3]
        assert httpx.get(url + "/health/live", timeout=2).status_code == 200
        deadline = time.monotonic() + READ_TIMEOUT_S * 5
        closed: set[int] = set()
        while len(closed) < HALF_SENT and time.monotonic() < deadline:
            closed |= {i for i, s in enumerate(socks) if i not in closed and _is_closed(s)}
        assert len(closed) == HALF_SENT, f"{HALF_SENT - len(closed)} half-sent requests still held"
    finally:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()


def test_the_starting_server_runs_with_the_shared_limits() -> None:
    server = StartingServer("127.0.0.1", free_port(), PodLayout(num_ranks=2, ranks_per_pod=1))
    try:
        config = server.config
        assert isinstance(config.http, type) and issubclass(config.http, ReadDeadlineProtocol)
        assert config.limit_concurrency == DEFAULT_LIMITS.max_concurrency
        assert config.http.max_header_bytes == DEFAULT_LIMITS.max_header_bytes
        assert config.http.read_timeout_s == DEFAULT_LIMITS.request_read_timeout_s
    finally:
        server.close()

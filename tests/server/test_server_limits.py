"""Every runtime HTTP server closes clients that dribble their request (slowloris)
and refuses header blocks over the limit.

N clients send one header byte at a time; meanwhile a normal client is
served, and once the read deadline passes the dribblers are disconnected.
The deadline covers reading a request only: a response that takes longer
than it is not cut, and the connection serves the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdcluster.runtime.http.limits import DEFAULT_LIMITS, ReadDeadlineProtocol, server_config

READ_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 8 * 1024
DRIBBLERS = 20


@pytest.fixture
def server() -> Iterator[str]:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/slow")
    async def slow() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for n in range(3):
                await asyncio.sleep(READ_TIMEOUT_S * 0.8)
                yield f"chunk {n}\n".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = replace(
        DEFAULT_LIMITS, request_read_timeout_s=READ_TIMEOUT_S, max_header_bytes=MAX_HEADER_BYTES
    )
    srv = uvicorn.Server(server_config(app, "127.0.0.1", port, limits))
    srv.config.setup_event_loop = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    sock.close()


def _is_closed(s: socket.socket) -> bool:
    try:
        s.send(b"x")
        s.settimeout(0.05)
        return s.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        return True
    except TimeoutError:
        return False


def test_dribbling_clients_are_closed_and_others_served(server: str) -> None:
    port = _port(server)
    request = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(DRIBBLERS)]
    started = time.monotonic()
    served_meanwhile, pings = 0, 0
    closed: set[int] = set()
    try:
        i = 0
        while time.monotonic() - started < READ_TIMEOUT_S * 3 and len(closed) < DRIBBLERS:
            for n, s in enumerate(socks):
                if n not in closed:
                    with contextlib.suppress(OSError):
                        s.send(request[i : i + 1])
            i += 1
            if len(closed) < DRIBBLERS:  # a normal client while dribblers hold sockets
                pings += 1
                served_meanwhile += httpx.get(server + "/ping", timeout=2).status_code == 200
            time.sleep(0.05)
            if time.monotonic() - started > READ_TIMEOUT_S:
                closed |= {n for n, s in enumerate(socks) if n not in closed and _is_closed(s)}
    finally:
        for s in socks:
            s.close()
    assert served_meanwhile == pings >= 2
    assert len(closed) == DRIBBLERS, f"only {len(closed)}/{DRIBBLERS} dribblers were closed"


def _port(server: str) -> int:
    return int(server.rsplit(":", 1)[1])


def _read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_a_header_block_over_the_limit_gets_431_and_the_server_goes_on(server: str) -> None:
    with socket.create_connection(("127.0.0.1", _port(server))) as s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1))
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert f"{MAX_HEADER_BYTES}-byte limit".encode() in reply
    # The same block a byte at a time is counted across reads.
    with socket.create_connection(("127.0.0.1", _port(server))) as s:
        head = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1)
        for i in range(0, len(head), 512):
            s.sendall(head[i : i + 512])
            time.sleep(0.001)
        assert _read_all(s).startswith(b"HTTP/1.1 431 ")
    # Under the limit, with a body in the same read: served.
    with socket.create_connection(("127.0.0.1", _port(server))) as s:
        s.sendall(
            b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: "
            + b"a" * (MAX_HEADER_BYTES // 2)
            + b"\r\nContent-Length: 65536\r\nConnection: close\r\n\r\n"
            + b"b" * 65536
        )
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert httpx.get(server + "/ping", timeout=2).json() == {"ok": "yes"}


def test_a_response_longer_than_the_read_deadline_is_not_cut(server: str) -> None:
    with httpx.Client(timeout=10) as client:
        t0 = time.monotonic()
        resp = client.get(server + "/slow")
        assert resp.text == "chunk 0\nchunk 1\nchunk 2\n"
        assert time.monotonic() - t0 > READ_TIMEOUT_S * 2
        # The deadline starts again at the end of the response: the same
        # connection serves the next request.
        assert client.get(server + "/ping").json() == {"ok": "yes"}
        assert client.get(server + "/slow").text.count("chunk") == 3


def test_pipelined_requests_are_answered_in_order_and_then_the_idle_connection_closes(
    server: str,
) -> None:
    with socket.create_connection(("127.0.0.1", _port(server))) as s:
        one = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(one * 3)
        t0 = time.monotonic()
        reply = _read_all(s, timeout=READ_TIMEOUT_S * 10)
    assert reply.count(b"HTTP/1.1 200 ") == 3, reply
    # Closed by the read deadline (or keep-alive), not by the client.
    assert time.monotonic() - t0 < READ_TIMEOUT_S * 8


def test_every_server_uses_the_limits() -> None:
    from pdcluster.runtime.pd.coords import InstanceShape
    from pdcluster.runtime.pd_worker.bootstrap_server import BootstrapServer, create_bootstrap_app
    from pdcluster.runtime.router.config import RouterConfig
    from pdcluster.runtime.router.server import _uvicorn_config

    router = _uvicorn_config(RouterConfig(colocated_urls=("http://127.0.0.1:1",)), "h", 1, "info")
    boot = BootstrapServer(create_bootstrap_app(InstanceShape(1, 1, 1, 1), "t"))
    try:
        for cfg in (router, boot._server.config):
            assert isinstance(cfg.http, type) and issubclass(cfg.http, ReadDeadlineProtocol)
            assert cfg.limit_concurrency == DEFAULT_LIMITS.max_concurrency
            assert cfg.http.max_header_bytes == DEFAULT_LIMITS.max_header_bytes
    finally:
        boot.stop()

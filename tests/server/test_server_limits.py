"""Every runtime HTTP server closes clients that dribble their request (slowloris).

N clients send one header byte at a time; meanwhile a normal client is
served, and once the read deadline passes the dribblers are disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from pdcluster.runtime.http.limits import DEFAULT_LIMITS, ReadDeadlineProtocol, server_config

READ_TIMEOUT_S = 1.0
DRIBBLERS = 20


@pytest.fixture
def server() -> Iterator[str]:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    limits = replace(DEFAULT_LIMITS, request_read_timeout_s=READ_TIMEOUT_S)
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
    port = int(server.rsplit(":", 1)[1])
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
            assert cfg.h11_max_incomplete_event_size == DEFAULT_LIMITS.max_header_bytes
    finally:
        boot.stop()

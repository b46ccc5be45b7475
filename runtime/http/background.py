"""One ASGI app served by uvicorn on a thread of its own, with the shared limits.

A rank process hosts small servers next to its real work: the prefill
leader's bootstrap server, and a multi-pod leader's starting server while
its ranks gather. Each runs `server_config` (limits.py) on its own event
loop, so a client that holds a connection costs a socket, never a thread,
and is cut at the read deadline like on every other server of the runtime.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Self

import uvicorn

from pdcluster.runtime.http.limits import DEFAULT_LIMITS, ServerLimits, server_config


class BackgroundServer:
    """Serve `app` on `host:port` (`port=0` picks a free port) from a daemon thread."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits = DEFAULT_LIMITS,
        name: str = "http-server",
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by accepted connections. Without it a keep-alive client
        # waits ~40 ms per answer (Nagle holding the reply until the client's
        # delayed ACK of the previous one).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        # ASGI 3 named, not guessed: uvicorn takes a bound method for ASGI 2.
        self.config = server_config(
            app, host, 0, limits, lifespan="off", access_log=False, interface="asgi3"
        )
        self._server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 10.0) -> Self:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and free the port (idempotent; also fine if never started)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

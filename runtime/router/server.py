"""Serve the router with uvicorn (the CLI and the local mode call this)."""

from __future__ import annotations

import socket
from dataclasses import replace

import uvicorn

from pdcluster.runtime.http.event_loop import DEFAULT_EVENT_LOOP, EventLoop
from pdcluster.runtime.http.limits import DEFAULT_LIMITS, server_config
from pdcluster.runtime.router.app import create_router_app
from pdcluster.runtime.router.config import RouterConfig


def _uvicorn_config(
    config: RouterConfig,
    host: str,
    port: int,
    log_level: str,
    loop: EventLoop = DEFAULT_EVENT_LOOP,
) -> uvicorn.Config:
    # Streams can be long; do not cut keep-alive connections mid-use.
    limits = replace(DEFAULT_LIMITS, keep_alive_s=30.0)
    app = create_router_app(config)
    return server_config(app, host, port, limits, loop, log_level=log_level, access_log=False)


def run_router(
    config: RouterConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    loop: EventLoop = DEFAULT_EVENT_LOOP,
) -> None:
    """Serve until interrupted (blocks), on a new event loop of kind `loop`."""
    uvicorn.Server(_uvicorn_config(config, host, port, log_level, loop)).run()


async def serve_router(
    config: RouterConfig,
    *,
    sock: socket.socket | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
) -> None:
    """Serve inside a running event loop; ``sock`` (already bound) wins over host/port.

    Create ``sock`` with ``proto=socket.IPPROTO_TCP``: asyncio turns on
    TCP_NODELAY for accepted connections only when the listening socket says
    TCP, and without it keep-alive answers stall ~40 ms on delayed ACKs.
    """
    server = uvicorn.Server(_uvicorn_config(config, host, port, log_level))
    await server.serve(sockets=[sock] if sock is not None else None)

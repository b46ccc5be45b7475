"""Serve the router with uvicorn (the CLI and the local mode call this)."""

from __future__ import annotations

import socket

import uvicorn

from pdcluster.runtime.router.app import create_router_app
from pdcluster.runtime.router.config import RouterConfig


def _uvicorn_config(config: RouterConfig, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        create_router_app(config),
        host=host,
        port=port,
        log_level=log_level,
        # Streams can be long; do not cut keep-alive connections mid-use.
        timeout_keep_alive=30,
        access_log=False,
    )


def run_router(
    config: RouterConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve until interrupted (blocks)."""
    uvicorn.Server(_uvicorn_config(config, host, port, log_level)).run()


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

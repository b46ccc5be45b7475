"""Fake workers' admin APIs (FastAPI apps) served by uvicorn on 127.0.0.1.

The operator's HTTP clients (failover fast path, prefill-peer publishing)
talk to these over real sockets: the timeouts and concurrency are the real
ones, only the worker behind the API is scripted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI


@contextlib.asynccontextmanager
async def serving(*apps: tuple[FastAPI, int]) -> AsyncIterator[None]:
    """Serve each (app, port) until the block ends; enters once every server listens."""
    servers = [
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        for app, port in apps
    ]
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    deadline = time.monotonic() + 10
    while not all(server.started for server in servers):
        assert time.monotonic() < deadline, "fake workers did not start"
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.gather(*tasks)

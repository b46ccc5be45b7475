"""The router sends the cluster token on every call to a worker (their API is guarded)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.testclient import TestClient

from pdcluster.runtime.router.app import create_router_app
from pdcluster.runtime.router.cli import parse_invocation
from pdcluster.runtime.router.config import RouterConfig

TOKEN = "cluster-token-for-router-tests"


@pytest.fixture
def worker() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A colocated stand-in worker that records (path, Authorization) of every call."""
    seen: list[tuple[str, str]] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def any_path(path: str, request: Request) -> Response:
        seen.append(("/" + path, request.headers.get("authorization", "")))
        if path == "get_server_info":
            return JSONResponse({"disaggregation_mode": "null", "dp_size": 1})
        if path == "generate":
            return JSONResponse(
                {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}}
            )
        return Response(status_code=200)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve([sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_probes_and_relays_carry_the_token(worker) -> None:
    url, seen = worker
    config = RouterConfig(colocated_urls=(url,), worker_token=TOKEN)
    with TestClient(create_router_app(config)) as client:
        client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    paths = {p for p, _ in seen}
    assert {"/get_server_info", "/generate"} <= paths, seen
    assert all(auth == f"Bearer {TOKEN}" for _, auth in seen), seen


def test_the_token_comes_from_the_environment() -> None:
    inv = parse_invocation(["--colocated", "http://127.0.0.1:1"], env={"PDCLUSTER_TOKEN": TOKEN})
    assert inv.config.worker_token == TOKEN
    assert TOKEN not in repr(inv.config)

"""Real uvicorn servers on 127.0.0.1 for router tests.

All servers of a test (stand-in workers and the router) run in one
background event loop, so tests drive them from the main thread with
ordinary blocking clients, exactly as a user would.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import openai
import uvicorn
from fastapi import FastAPI

from pdcluster.runtime.router.app import RouterState, create_router_app
from pdcluster.runtime.router.config import RouterConfig

from .standin import Rendezvous, StandinWorker

T = TypeVar("T")
START_TIMEOUT_S = 10.0


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the loop thread (state owned by the loop)."""

        async def wrapped() -> Any:
            return fn(*args)

        return self.run(wrapped())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    done: Future[None]

    def stop(self) -> None:
        self.server.should_exit = True
        self.done.result(START_TIMEOUT_S)


def stop_all(served: list[Served]) -> None:
    """Stop servers together (each takes up to uvicorn's 0.1 s tick)."""
    for s in served:
        s.server.should_exit = True
    for s in served:
        s.done.result(START_TIMEOUT_S)


def serve(loop: LoopThread, app: FastAPI) -> Served:
    # proto must say TCP: asyncio enables TCP_NODELAY on accepted sockets only
    # then, and without it every keep-alive answer waits ~40 ms for an ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, timeout_graceful_shutdown=1, lifespan="on"
    )
    server = uvicorn.Server(config)
    done = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), loop.loop)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if done.done():
            done.result()
            raise RuntimeError("server exited during startup")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.005)
    return Served(url=f"http://127.0.0.1:{port}", server=server, done=done)


@dataclass
class Cluster:
    loop: LoopThread
    prefill: list[StandinWorker] = field(default_factory=list)
    decode: list[StandinWorker] = field(default_factory=list)
    colocated: list[StandinWorker] = field(default_factory=list)
    router_url: str = ""
    router_app: FastAPI | None = None
    _served: list[Served] = field(default_factory=list)
    # Clients a test opened through the cluster, closed with it.
    _clients: list[Any] = field(default_factory=list)

    @property
    def state(self) -> RouterState:
        assert self.router_app is not None
        state: RouterState = self.router_app.state.router
        return state

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, trust_env=False, timeout=10, **kwargs)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        """The official client, unchanged, pointed at the router."""
        client = openai.OpenAI(
            base_url=f"{self.router_url}/v1",
            api_key=api_key,
            max_retries=0,
            http_client=httpx.Client(trust_env=False, timeout=10),
        )
        self._clients.append(client)
        return client

    def workers(self) -> list[StandinWorker]:
        return [*self.prefill, *self.decode, *self.colocated]

    def generate_error(self, status: int, words: str) -> httpx.Response:
        """POST a one-word /generate that must answer `status` with `words` in its error."""
        with self.client() as http:
            resp = http.post("/generate", json={"text": "x"})
        assert resp.status_code == status, resp.text
        assert words in resp.json()["error"]["message"]
        return resp

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        stop_all(self._served)


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


@contextmanager
def start_cluster(
    loop: LoopThread,
    *,
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    prefill_dp: int = 1,
    extra_urls: dict[str, list[str]] | None = None,
    prepare: Callable[[Cluster], None] | None = None,
    seed: int = 7,
    **router_settings: Any,
) -> Iterator[Cluster]:
    """Stand-in workers plus a router in front of them, all on 127.0.0.1."""
    cluster = Cluster(loop=loop)
    rendezvous = Rendezvous()
    try:
        for role, count in (("prefill", prefill), ("decode", decode), ("colocated", colocated)):
            for i in range(count):
                worker = StandinWorker(
                    role=role,
                    bootstrap_port=9000 + i,
                    dp_size=prefill_dp if role == "prefill" else 1,
                    rendezvous=rendezvous,
                )
                served = serve(loop, worker.build_app())
                worker.url = served.url
                cluster._served.append(served)
                getattr(cluster, role).append(worker)
        urls = {
            "prefill_urls": [w.url for w in cluster.prefill],
            "decode_urls": [w.url for w in cluster.decode],
            "colocated_urls": [w.url for w in cluster.colocated],
        }
        if prepare is not None:
            prepare(cluster)
        for key, extra in (extra_urls or {}).items():
            urls[key] = urls[key] + extra
        settings: dict[str, Any] = {"health_check_interval_s": 60.0, **router_settings}
        config = RouterConfig(**{k: tuple(v) for k, v in urls.items()}, **settings)
        app = create_router_app(config, rng=random.Random(seed))
        served = serve(loop, app)
        cluster._served.append(served)
        cluster.router_url = served.url
        cluster.router_app = app
        yield cluster
    finally:
        cluster.stop()

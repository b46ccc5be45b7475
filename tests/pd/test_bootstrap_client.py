"""Bootstrap client against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pdcluster.runtime.backoff import ExponentialBackoff
from pdcluster.runtime.pd.coords import InstanceShape, RankCoord
from pdcluster.runtime.pd_worker.bootstrap_client import (
    BootstrapAuthError,
    BootstrapClient,
    BootstrapNotReady,
    BootstrapPool,
    BootstrapRejected,
    BootstrapUnreachable,
    RetryPolicy,
    base_url,
)
from pdcluster.runtime.pd_worker.bootstrap_server import BootstrapServer, create_bootstrap_app

from .test_bootstrap_registry import SHAPE, reg

TOKEN = "tok-abc"
FAST = RetryPolicy(attempts=4, backoff=ExponentialBackoff(base_s=0.02, max_s=0.1))


class CountingApp:
    """ASGI wrapper counting requests per (method, path)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.counts: dict[tuple[str, str], int] = {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            key = (scope["method"], scope["path"])
            self.counts[key] = self.counts.get(key, 0) + 1
        await self.app(scope, receive, send)


@pytest.fixture
def app() -> CountingApp:
    return CountingApp(create_bootstrap_app(SHAPE, TOKEN))


@pytest.fixture
def server(app: CountingApp) -> AsyncIterator[BootstrapServer]:
    with BootstrapServer(app) as srv:  # type: ignore[arg-type]
        yield srv


@pytest.fixture
async def client(server: BootstrapServer) -> AsyncIterator[BootstrapClient]:
    c = BootstrapClient(f"127.0.0.1:{server.port}", TOKEN, retry=FAST)
    yield c
    await c.aclose()


async def register_all(client: BootstrapClient) -> None:
    for tp in range(2):
        for pp in range(2):
            await client.register(reg(tp, pp, port=7000 + 10 * tp + pp))


async def test_register_retries_until_the_server_starts(app: CountingApp) -> None:
    srv = BootstrapServer(app)  # port bound, not listening yet: connections are refused
    c = BootstrapClient(
        srv.url,
        TOKEN,
        retry=RetryPolicy(attempts=20, backoff=ExponentialBackoff(base_s=0.05, max_s=0.1)),
    )
    try:
        task = asyncio.create_task(c.register(reg()))
        await asyncio.sleep(0.2)
        assert not task.done()
        await asyncio.to_thread(srv.start)
        assert await asyncio.wait_for(task, 10) is True
    finally:
        await c.aclose()
        srv.stop()


async def test_register_gives_up_with_a_typed_error() -> None:
    srv = BootstrapServer(create_bootstrap_app(SHAPE, TOKEN))  # never started
    c = BootstrapClient(srv.url, TOKEN, retry=FAST)
    try:
        with pytest.raises(BootstrapUnreachable):
            await c.register(reg())
    finally:
        await c.aclose()
        srv.stop()


async def test_instance_waits_for_every_rank_then_caches(
    client: BootstrapClient, app: CountingApp
) -> None:
    waiter = asyncio.create_task(client.instance(wait_s=10))
    await asyncio.sleep(0.1)
    assert not waiter.done()  # 503 while ranks are missing
    await register_all(client)
    info = await asyncio.wait_for(waiter, 10)
    assert info.shape == SHAPE and len(info.ranks) == 4
    before = dict(app.counts)
    assert await client.instance() is info
    assert await client.rank_endpoint(RankCoord(tp=1, pp=1)) == "tcp://127.0.0.1:7011"
    assert app.counts == before  # both answered from the cache


async def test_not_ready_after_wait(client: BootstrapClient) -> None:
    await client.register(reg())
    with pytest.raises(BootstrapNotReady) as err:
        await client.instance(wait_s=0.2)
    assert (err.value.registered, err.value.expected) == (1, 4)


async def test_concurrent_callers_share_one_fetch(
    client: BootstrapClient, app: CountingApp
) -> None:
    await register_all(client)
    results = await asyncio.gather(*(client.instance() for _ in range(20)))
    assert all(r is results[0] for r in results)
    assert app.counts[("GET", "/route")] == 1


async def test_fetching_never_blocks_the_event_loop(client: BootstrapClient) -> None:
    # httpx imports its transport stack on first use (~0.2 s, once per process);
    # a worker pays that at start-up, not per fetch.
    assert await client.health()
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    with pytest.raises(BootstrapNotReady):
        await client.instance(wait_s=0.5)  # half a second of 503 retries
    tick.cancel()
    assert len(gaps) > 20 and max(gaps) < 0.1


async def test_rank_query_and_invalidate(client: BootstrapClient, server: BootstrapServer) -> None:
    await register_all(client)
    assert await client.rank_endpoint(RankCoord(tp=1)) == "tcp://127.0.0.1:7010"
    with pytest.raises(BootstrapRejected) as err:
        await client.rank_endpoint(RankCoord(tp=1, pp=5))
    assert err.value.status == 400 or err.value.status == 404
    server.stop()
    assert await client.rank_endpoint(RankCoord(tp=1)) == "tcp://127.0.0.1:7010"  # cached
    client.invalidate()
    with pytest.raises(BootstrapUnreachable):
        await client.rank_endpoint(RankCoord(tp=1))


async def test_unknown_rank_is_404(client: BootstrapClient) -> None:
    await client.register(reg())
    with pytest.raises(BootstrapRejected) as err:
        await client.rank_endpoint(RankCoord(tp=1))
    assert err.value.status == 404


async def test_wrong_token_fails_fast_without_retry(
    server: BootstrapServer, app: CountingApp
) -> None:
    c = BootstrapClient(server.url, "wrong", retry=FAST)
    with pytest.raises(BootstrapAuthError) as err:
        await c.register(reg())
    assert err.value.status == 403 and app.counts[("PUT", "/route")] == 1
    c2 = BootstrapClient(server.url, None, retry=FAST)
    with pytest.raises(BootstrapAuthError) as err:
        await c2.instance()
    assert err.value.status == 401
    await c.aclose()
    await c2.aclose()


async def test_rejection_names_the_field(client: BootstrapClient) -> None:
    await client.register(reg(0, 0))
    with pytest.raises(BootstrapRejected) as err:
        await client.register(reg(1, 0, page_size=32))
    assert err.value.status == 400 and err.value.field == "page_size"


async def test_health(client: BootstrapClient, server: BootstrapServer) -> None:
    assert await client.health() is True
    start = await client.probe()
    assert start and start == await client.probe()  # the same process: the same start
    server.stop()
    started = time.monotonic()
    assert await client.health(timeout_s=0.5) is False
    assert time.monotonic() - started < 2.0


async def test_dp_rank_round_trip() -> None:
    app = create_bootstrap_app(InstanceShape(dp=4), TOKEN)
    with BootstrapServer(app) as srv:
        pool = BootstrapPool(TOKEN, retry=FAST)
        c = pool.get(f"127.0.0.1:{srv.port}")
        assert pool.get(f"http://127.0.0.1:{srv.port}/") is c
        await c.register_dp_rank(room=2**62, dp_rank=2)
        assert await c.query_dp_ranks([2**62, 5]) == {2**62: 2}
        with pytest.raises(BootstrapRejected):
            await c.register_dp_rank(room=1, dp_rank=9)
        await pool.aclose()


@pytest.mark.parametrize(
    ("address", "url"),
    [("10.0.0.5:8998", "http://10.0.0.5:8998"), ("http://h:1/", "http://h:1")],
)
def test_base_url(address: str, url: str) -> None:
    assert base_url(address) == url


def test_empty_address_is_refused() -> None:
    with pytest.raises(ValueError):
        base_url("  ")


def test_keep_alive_answers_are_not_held_back_by_nagle(server: BootstrapServer) -> None:
    """A decode worker reuses its connection; each answer must come at once, not ~40 ms later."""
    conn = socket.create_connection((server.host, server.port))
    request = b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n\r\n"
    times = []
    try:
        for _ in range(9):
            started = time.perf_counter()
            conn.sendall(request)
            data = b""
            while b'"expected"' not in data:
                data += conn.recv(4096)
            times.append(time.perf_counter() - started)
    finally:
        conn.close()
    assert sorted(times)[4] < 0.025, (
        f"median {sorted(times)[4] * 1e3:.1f} ms per keep-alive request"
    )

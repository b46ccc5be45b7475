"""One worker-leg round trip through httpx and through aiohttp, side by side.

Starts one uvicorn server (the project's `server_config`: the workers' httptools
protocol with its read deadline) with a FastAPI app shaped like a worker's
streaming `/generate` (a pydantic body, one SSE event back), then times, in
alternating rounds, a streamed POST → first line read through each client
(each a pooled keep-alive client, as the router holds them). The difference
is client CPU on the caller's event loop: what the router pays per leg.

    .venv/bin/python bench/http_client.py [--requests 400] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pdcluster.runtime.http.limits import server_config
from pdcluster.runtime.router.leg_client import close_response, leg_session, response_lines


class Body(BaseModel):
    input_ids: list[int]
    stream: bool = True
    sampling_params: dict[str, int] = {}


def make_app() -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(body: Body) -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            yield f'data: {{"output_ids": [{len(body.input_ids)}]}}\n\n'.encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BODY = json.dumps({"input_ids": list(range(16)), "stream": True}).encode()
JSON = {"content-type": "application/json"}


async def through_httpx(url: str, n: int) -> list[float]:
    times = []
    async with httpx.AsyncClient(trust_env=False) as client:
        for _ in range(n):
            t = time.perf_counter()
            async with client.stream("POST", url, content=BODY, headers=JSON) as resp:
                async for line in resp.aiter_lines():
                    if line:
                        break
            times.append(time.perf_counter() - t)
    return times


async def through_aiohttp(url: str, n: int) -> list[float]:
    times = []
    session = leg_session(max_connections=1024, connect_timeout_s=5.0, headers={})
    async with session:
        for _ in range(n):
            t = time.perf_counter()
            resp = await session.post(url, data=BODY, headers=JSON)
            async for line in response_lines(resp):
                if line:
                    break
            close_response(resp)
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    server = uvicorn.Server(server_config(make_app(), "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/generate"
    clients: dict[str, Callable[[str, int], Awaitable[list[float]]]] = {
        "httpx": through_httpx,
        "aiohttp": through_aiohttp,
    }
    results: dict[str, list[float]] = {name: [] for name in clients}

    async def run() -> None:
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                times = await clients[name](url, args.requests)
                results[name].extend(times[20:])  # the first ones open the connection

    asyncio.run(run())
    server.should_exit = True
    thread.join(5)
    p50 = {name: statistics.median(ts) * 1e3 for name, ts in results.items()}
    print(f"{args.rounds} rounds of {args.requests} streamed POSTs, one at a time")
    print(f"{'client':10s} {'p50':>9s} {'p90':>9s}")
    for name, ts in results.items():
        p90 = statistics.quantiles(ts, n=10)[-1] * 1e3
        print(f"{name:10s} {p50[name]:7.2f}ms {p90:7.2f}ms")
    print(f"httpx - aiohttp p50: {p50['httpx'] - p50['aiohttp']:.2f} ms per round trip")


if __name__ == "__main__":
    main()

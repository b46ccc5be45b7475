"""Our router against SGLang's (`sglang-router`), in front of the same workers, in one run.

Starts the 1P1D example (`examples/pd-1p1d.yaml`, `tcp`; its own router
included), then SGLang's router in PD mode in front of the same prefill and
decode worker (as `docs/sglang-router.md` describes), and takes turns
between the two (the order flips every trial or round, so machine noise
hits both alike):

- TTFT: streaming `/generate` of `--lengths` prompt tokens, one request at a
  time, p50/p90 per router; `direct` is the same request sent by this
  script straight to both workers (both legs at once, as a PD router does),
  the floor a router adds its cost to;
- throughput: `--concurrency` streaming clients, each sending 16-token
  prompts for 16 new tokens back to back for `--seconds`; requests/s and
  generated tokens/s, median over `--rounds`; and each router's process CPU
  per request over the same rounds (user + system, all its threads), the
  steadier number on a small shared box: every router millisecond comes out
  of the workers' cores.

    .venv/bin/python bench/router.py [--quick]

`--quick` (fewer trials, 2 s rounds) finishes in under 3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import start_example  # noqa: E402

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402
from pdcluster.runtime.local.sglang_router import start_sglang_router  # noqa: E402

NEW_TOKENS = 16


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    pid: int = 0  # the router's process, for its CPU time (0: none)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body_of(prompt: list[int], new_tokens: int) -> dict[str, object]:
    return {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, object]
) -> tuple[float, int]:
    """(seconds to the first token, tokens generated) of one streaming /generate."""
    t0 = time.perf_counter()
    first: float | None = None
    num_tokens = 0
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            ids = event.get("output_ids") or []
            if ids and first is None:
                first = time.perf_counter() - t0
            num_tokens = max(num_tokens, len(ids))  # cumulative: the last event has all
    if first is None:
        raise RuntimeError(f"{url}: stream ended without a token")
    return first, num_tokens


async def direct_ttft(client: httpx.AsyncClient, cluster: LocalCluster, prompt: list[int]) -> float:
    """Both legs sent by this script, no router in between."""
    prefill = next(w for w in cluster.plan.workers if w.role == "prefill")
    decode = next(w for w in cluster.plan.workers if w.role == "decode")
    body = body_of(prompt, NEW_TOKENS)
    body.update(
        rid=secrets.token_hex(8),
        bootstrap_host="127.0.0.1",
        bootstrap_port=prefill.bootstrap_port,
        bootstrap_room=secrets.randbits(62),
    )
    leg = asyncio.ensure_future(stream_request(client, prefill.url, body))
    try:
        first, _ = await stream_request(client, decode.url, body)
    finally:
        await asyncio.gather(leg, return_exceptions=True)
    return first


async def ttft_table(
    client: httpx.AsyncClient,
    cluster: LocalCluster,
    targets: list[Target],
    lengths: list[int],
    trials: int,
) -> dict[tuple[int, str], list[float]]:
    rng = random.Random(0)
    times: dict[tuple[int, str], list[float]] = {}
    for n in lengths:
        for trial in range(trials + 1):  # trial 0 warms up
            order = targets if trial % 2 else targets[::-1]
            for target in order:
                # A prompt of its own for every request: the workers cache
                # prefixes, so a prompt one target sent first would be a cache
                # hit for the next.
                prompt = [rng.randrange(1, 256) for _ in range(n)]
                if target.name == "direct":
                    t = await direct_ttft(client, cluster, prompt)
                else:
                    t, _ = await stream_request(client, target.url, body_of(prompt, NEW_TOKENS))
                if trial:
                    times.setdefault((n, target.name), []).append(t)
    return times


async def throughput(
    client: httpx.AsyncClient, url: str, concurrency: int, seconds: float
) -> tuple[float, float, int]:
    """(requests/s, generated tokens/s, requests) of `concurrency` clients for `seconds`."""
    rng = random.Random(concurrency)
    deadline = time.perf_counter() + seconds
    done = [0, 0]

    async def one_client() -> None:
        while time.perf_counter() < deadline:
            prompt = [rng.randrange(1, 256) for _ in range(16)]
            _, num_tokens = await stream_request(client, url, body_of(prompt, NEW_TOKENS))
            done[0] += 1
            done[1] += num_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    return done[0] / elapsed, done[1] / elapsed, done[0]


def p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def run(
    args: argparse.Namespace, cluster: LocalCluster, sglang_url: str, sglang_pid: int
) -> None:
    ours = Target("ours", cluster.plan.endpoint, cluster.procs[cluster.plan.router.name].pid)
    # Both routers drive the same workers: their CPU per request says whether a
    # router makes the workers work harder, not only what it spends itself.
    worker_pids = [cluster.procs[w.name].pid for w in cluster.plan.workers]
    theirs = Target("sglang", sglang_url, sglang_pid)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {cluster.token}"}
    async with httpx.AsyncClient(
        timeout=300, limits=limits, headers=headers, trust_env=False
    ) as client:
        times = await ttft_table(
            client, cluster, [ours, theirs, Target("direct", "")], args.lengths, args.trials
        )
        print(f"TTFT, {args.trials} trials per cell (ms)")
        print(f"{'prompt':>7} {'router':>7} {'p50':>8} {'p90':>8} {'added p50':>10}")
        for n in args.lengths:
            floor = statistics.median(times[(n, "direct")])
            for name in ("direct", "ours", "sglang"):
                ts = times[(n, name)]
                added = statistics.median(ts) - floor
                print(
                    f"{n:>7} {name:>7} {statistics.median(ts) * 1e3:>8.1f} "
                    f"{p(ts, 90) * 1e3:>8.1f} {added * 1e3:>10.1f}"
                )
        print(f"\nthroughput, {args.seconds:g} s per round, median of {args.rounds} rounds")
        print(
            f"{'clients':>7} {'router':>7} {'req/s':>8} {'tok/s':>8} {'CPU ms/req':>11}"
            f" {'workers CPU ms/req':>19}"
        )
        for c in args.concurrency:
            results: dict[str, list[tuple[float, float, int]]] = {"ours": [], "sglang": []}
            cpu = {"ours": 0.0, "sglang": 0.0}
            workers_cpu = {"ours": 0.0, "sglang": 0.0}
            await throughput(client, ours.url, c, 0.5)  # warm the connections
            await throughput(client, theirs.url, c, 0.5)
            for r in range(args.rounds):
                for target in (ours, theirs) if r % 2 == 0 else (theirs, ours):
                    before = cpu_seconds(target.pid)
                    workers_before = sum(map(cpu_seconds, worker_pids))
                    results[target.name].append(
                        await throughput(client, target.url, c, args.seconds)
                    )
                    cpu[target.name] += cpu_seconds(target.pid) - before
                    workers_cpu[target.name] += sum(map(cpu_seconds, worker_pids)) - workers_before
            for name, rows in results.items():
                rps = statistics.median(x[0] for x in rows)
                tps = statistics.median(x[1] for x in rows)
                served = max(1, sum(x[2] for x in rows))
                per_request = cpu[name] / served * 1e3
                workers_per_request = workers_cpu[name] / served * 1e3
                print(
                    f"{c:>7} {name:>7} {rps:>8.1f} {tps:>8.1f} {per_request:>11.2f}"
                    f" {workers_per_request:>19.2f}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a run of under 3 minutes")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 2000])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.quick:
        args.trials, args.seconds, args.rounds = 6, 2.0, 1
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_example("pd-1p1d.yaml", Path(tmp))
        router = None
        try:
            workers = cluster.plan.workers
            prefills = [(w.url, w.bootstrap_port) for w in workers if w.role == "prefill"]
            decodes = [w.url for w in workers if w.role == "decode"]
            router = start_sglang_router(prefills, decodes, cluster.token, Path(tmp))
            asyncio.run(run(args, cluster, router.url, router.proc.pid))
        finally:
            if router is not None:
                router.stop()
            cluster.stop()


if __name__ == "__main__":
    main()

"""Router numbers on this machine: abort delay after a client disconnect, and
the latency the router adds. Not a test; run from the repository root:

    .venv/bin/python -m tests.router.measure

Everything (stand-ins and router) shares one event loop in one process, so
latencies include their contention; the abort delay is measured from the
client's close() to the abort_request arriving at each stand-in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import httpx

from .harness import LoopThread, start_cluster
from .test_app_pd import disconnect_delay

RUNS = 20


def _summary(samples_s: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples_s)
    p90 = ms[int(len(ms) * 0.9) - 1]
    return f"median {statistics.median(ms):.2f} ms, p90 {p90:.2f} ms, max {ms[-1]:.2f} ms"


def _latency(call: Callable[[], httpx.Response]) -> list[float]:
    samples = []
    for _ in range(RUNS + 5):
        start = time.perf_counter()
        assert call().status_code == 200
        samples.append(time.perf_counter() - start)
    return samples[5:]  # warm-up requests open the keep-alive connections


def main() -> None:
    loop = LoopThread()
    try:
        for stream in (True, False):
            delays = []
            for _ in range(RUNS):
                with start_cluster(loop) as cluster:
                    delays.append(disconnect_delay(cluster, stream))
            kind = "stream" if stream else "non-stream"
            print(f"abort delay after disconnect ({kind}, n={RUNS}): {_summary(delays)}")
        body = {"text": "a", "sampling_params": {"max_new_tokens": 4}}
        with start_cluster(loop, prefill=0, decode=0, colocated=1) as cluster:
            worker = cluster.colocated[0].url
            with httpx.Client(trust_env=False) as http:
                direct = _latency(
                    lambda: http.post(f"{worker}/generate", json={**body, "rid": "r"})
                )
                routed = _latency(lambda: http.post(f"{cluster.router_url}/generate", json=body))
            print(f"/generate direct to worker: {_summary(direct)}")
            print(f"/generate via router, colocated: {_summary(routed)}")
        with start_cluster(loop) as cluster, httpx.Client(trust_env=False) as http:
            pd = _latency(lambda: http.post(f"{cluster.router_url}/generate", json=body))
            print(f"/generate via router, prefill+decode legs: {_summary(pd)}")
    finally:
        loop.close()


if __name__ == "__main__":
    main()

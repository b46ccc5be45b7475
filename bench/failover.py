"""Failover latencies of a local PD cluster: lost prefill → failed rooms, and client aborts.

Starts one local cluster (two prefill instances, one decode instance, the
router; `tcp`; heartbeat `--interval` × `--threshold`) and measures, over
`--trials` trials each:

- detection: a prefill instance (prefill-1) is killed with SIGKILL or hung
  with SIGSTOP while KV streams from it into decode; the time from the
  signal to the moment decode lists none of that instance's rooms as live
  (`GET /admin/rooms`, polled every 5 ms) — by the heartbeat alone, and with
  the operator's fast path (`POST /admin/fail_peer` right after the signal);
- abort propagation: a streaming request through the router is dropped by
  its client while both legs run; the time from closing the connection to
  the moment no worker lists its room as live, and to every page back.

    .venv/bin/python bench/failover.py [--trials 20] [--interval 0.5] [--threshold 2]

A killed prefill is restarted after each trial (several seconds of CPU
each); a hung one is resumed.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import READY_S, local_plan, tiny_cluster, write_manifest  # noqa: E402

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402

POLL_S = 0.005


def manifest(interval: float, threshold: int) -> dict[str, Any]:
    return tiny_cluster(
        "bench-failover",
        {
            "kvCache": {"pageSize": 16, "numPages": 1024},
            "transfer": {
                "backend": "tcp",
                "bootstrapTimeoutSeconds": 10,
                "waitingTimeoutSeconds": 20,
                "abortReleaseTimeoutSeconds": 3,
                "heartbeat": {"intervalSeconds": interval, "failureThreshold": threshold},
            },
            "prefill": {"replicas": 2},
            "decode": {"replicas": 1},
            "router": {"healthCheckIntervalSeconds": 0.5},
        },
    )


class Bench:
    def __init__(self, tmp: Path, interval: float, threshold: int) -> None:
        self.plan = local_plan(write_manifest(manifest(interval, threshold), tmp))
        self.token = secrets.token_hex(16)
        self.cluster = LocalCluster(self.plan, tmp / "state", token=self.token)
        self.http = httpx.Client(timeout=10)
        self.specs = {p.name: p for p in self.plan.processes}
        self.rng = random.Random(0)
        self.pool = ThreadPoolExecutor(16)

    def start(self) -> None:
        self.cluster.start()
        self.cluster.wait_ready(READY_S)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.cluster.stop(grace=5)
        self.http.close()

    def url(self, name: str) -> str:
        return self.specs[name].url

    def peer(self, name: str) -> str:
        return f"127.0.0.1:{self.specs[name].bootstrap_port}"

    def rooms(self, name: str) -> list[dict[str, Any]]:
        resp = self.http.get(
            self.url(name) + "/admin/rooms", headers={"Authorization": f"Bearer {self.token}"}
        )
        rooms: list[dict[str, Any]] = resp.json()["rooms"]
        return rooms

    def live_tied(self, decode: str, prefill: str) -> list[dict[str, Any]]:
        peer = self.peer(prefill)
        return [r for r in self.rooms(decode) if peer in r["peers"] and r["state"] != "Failed"]

    def clean(self, name: str) -> bool:
        info = self.http.get(
            self.url(name) + "/get_server_info", headers={"Authorization": f"Bearer {self.token}"}
        ).json()
        return bool(info["num_free_pages"] == info["num_total_pages"] and info["num_rooms"] == 0)

    def wait(self, check: Callable[[], bool], timeout: float) -> float:
        t0 = time.monotonic()
        while not check():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"waited {timeout}s")
            time.sleep(POLL_S)
        return time.monotonic()

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(n)]

    def pd_leg(self, worker: str, body: dict[str, Any]) -> None:
        try:
            httpx.post(
                self.url(worker) + "/generate",
                json=body,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=30,
            )
        except httpx.HTTPError:
            pass  # the killed or hung side

    def send_victims(self, n: int = 4) -> None:
        """Long requests from prefill-1 into decode-0, both legs at once (as a PD router)."""
        for _ in range(n):
            body = {
                "input_ids": self.prompt(3000),
                "rid": "req-" + secrets.token_hex(16),
                "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.specs["prefill-1"].bootstrap_port,
                "bootstrap_room": secrets.randbits(63) or 1,
            }
            self.pool.submit(self.pd_leg, "prefill-1", body)
            self.pool.submit(self.pd_leg, "decode-0", body)

    def restart(self, name: str) -> None:
        spec = self.specs[name]
        self.cluster.spawn(spec)

        def healthy() -> bool:
            try:
                return self.http.get(spec.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait(healthy, 300)

    def detection(self, how: str, fast_path: bool) -> float:
        """Seconds from the signal to no live decode room of the lost prefill."""
        self.wait(lambda: all(self.clean(n) for n in ("prefill-1", "decode-0")), 60)
        self.send_victims()

        def mid_transfer() -> bool:
            rooms = self.live_tied("decode-0", "prefill-1")
            return len(rooms) >= 2 and any(r["state"] == "Transferring" for r in rooms)

        self.wait(mid_transfer, 60)
        pid = self.cluster.procs["prefill-1"].pid
        t0 = time.monotonic()
        os.killpg(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if fast_path:
            self.http.post(
                self.url("decode-0") + "/admin/fail_peer",
                # As the operator says it: a killed pod is gone, a stopped one only NotReady.
                json={
                    "peer": self.peer("prefill-1"),
                    "reason": "prefill_pod_lost",
                    "gone": how == "kill",
                },
                headers={"Authorization": f"Bearer {self.token}"},
            )
        t1 = self.wait(lambda: not self.live_tied("decode-0", "prefill-1"), 30)
        if how == "kill":
            self.cluster.procs["prefill-1"].wait(10)
            self.restart("prefill-1")
        else:
            os.killpg(pid, signal.SIGCONT)
        time.sleep(1.0)  # the heartbeat sees it back
        return t1 - t0

    def abort(self) -> tuple[float, float]:
        """(to no live room anywhere, to every page back) after the client left."""
        workers = ("prefill-0", "prefill-1", "decode-0")
        self.wait(lambda: all(self.clean(n) for n in workers), 60)
        body = {
            "input_ids": self.prompt(2500),
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True},
        }

        def live(name: str) -> bool:
            return any(r["state"] != "Failed" for r in self.rooms(name))

        with httpx.Client(timeout=30) as client:
            with client.stream("POST", self.plan.endpoint + "/generate", json=body):
                # Both legs hold a room: prefill computes, decode waits for KV.
                self.wait(lambda: live("decode-0") and (live("prefill-0") or live("prefill-1")), 30)
                t0 = time.monotonic()
        t1 = self.wait(lambda: not any(live(n) for n in workers), 30)
        t2 = self.wait(lambda: all(self.clean(n) for n in workers), 30)
        return t1 - t0, t2 - t0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def row(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return (
        f"| {name} | {len(ms)} | {statistics.median(ms):.0f} ms | {pct(ms, 0.99):.0f} ms "
        f"| {min(ms):.0f} ms | {max(ms):.0f} ms |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--threshold", type=int, default=2)
    ap.add_argument(
        "--only", choices=["detection", "abort"], default=None, help="run one part only"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(Path(tmp), args.interval, args.threshold)
        bench.start()
        results: dict[str, list[float]] = {}
        try:
            if args.only in (None, "detection"):
                for how in ("stop", "kill"):
                    for fast in (False, True):
                        name = f"{'SIGSTOP' if how == 'stop' else 'SIGKILL'} + " + (
                            "admin fail_peer" if fast else "heartbeat only"
                        )
                        results[name] = []
                        for _ in range(args.trials):
                            results[name].append(bench.detection(how, fast))
                        print(row(name, results[name]), flush=True)
            if args.only in (None, "abort"):
                gone, freed = [], []
                for _ in range(args.trials):
                    a, b = bench.abort()
                    gone.append(a)
                    freed.append(b)
                results["client disconnect → legs aborted"] = gone
                results["client disconnect → pages back"] = freed
                print(row("client disconnect → legs aborted", gone), flush=True)
                print(row("client disconnect → pages back", freed), flush=True)
        finally:
            bench.stop()
    bound = args.interval * args.threshold + 1.0
    print(f"\nheartbeat {args.interval:g} s × {args.threshold} (bound {bound:g} s)")
    print("| measurement | trials | p50 | p99 | min | max |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, values in results.items():
        print(row(name, values))


if __name__ == "__main__":
    main()

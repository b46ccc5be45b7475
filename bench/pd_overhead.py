"""TTFT of PD-disaggregated serving vs colocated serving, side by side in one run.

Starts two local clusters from the example manifests (colocated and 1P1D,
both behind the router), then alternates requests between them so machine
noise hits both alike. TTFT = time from sending a streaming `/generate`
through the router to the first SSE event carrying a token.

    .venv/bin/python bench/pd_overhead.py [--trials 10] [--lengths 16 2000]

Prints median/p90 TTFT per prompt length and the PD / colocated ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.local.launcher import LocalCluster, free_ports
from pdcluster.runtime.local.plan import build_local_plan, count_ports

ROOT = Path(__file__).resolve().parents[1]


def start(example: str, state: Path) -> LocalCluster:
    path = ROOT / "examples" / example
    manifest = load_manifest(str(path))
    plan = build_local_plan(
        manifest, str(path), free_ports(count_ports(manifest)), python=sys.executable
    )
    cluster = LocalCluster(plan, state / manifest.metadata.name)
    cluster.start()
    cluster.wait_ready(300)
    return cluster


def ttft(client: httpx.Client, endpoint: str, prompt: list[int]) -> float:
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
    }
    t0 = time.perf_counter()
    with client.stream("POST", f"{endpoint}/generate", json=body) as resp:
        resp.raise_for_status()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("output_ids"):
                    first = time.perf_counter() - t0
                    break
        else:
            raise RuntimeError("stream ended without a token")
        for _ in lines:  # drain the rest of the stream
            pass
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 2000])
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        coloc = start("colocated.yaml", Path(tmp))
        pd = start("pd-1p1d.yaml", Path(tmp))
        try:
            with httpx.Client(timeout=120) as client:
                rows = []
                for n in args.lengths:
                    times: dict[str, list[float]] = {"colocated": [], "pd": []}
                    for trial in range(args.trials + 1):  # trial 0 warms up
                        prompt = [rng.randrange(1, 256) for _ in range(n)]
                        for name, cl in (("colocated", coloc), ("pd", pd)):
                            t = ttft(client, cl.plan.endpoint, prompt)
                            if trial:
                                times[name].append(t)
                    rows.append((n, times))
        finally:
            pd.stop()
            coloc.stop()
    print(f"{'prompt':>7} {'colocated p50':>14} {'pd p50':>9} {'pd p90':>9} {'ratio p50':>10}")
    for n, times in rows:
        c50 = statistics.median(times["colocated"])
        p50 = statistics.median(times["pd"])
        p90 = statistics.quantiles(times["pd"], n=10)[-1]
        print(
            f"{n:>7} {c50 * 1e3:>11.1f} ms {p50 * 1e3:>6.1f} ms {p90 * 1e3:>6.1f} ms "
            f"{p50 / c50:>10.2f}"
        )


if __name__ == "__main__":
    main()

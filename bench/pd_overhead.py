"""TTFT of PD-disaggregated serving vs colocated serving, side by side in one run.

Starts local clusters from the example manifests (colocated, 1P1D over
tcp and, with `--nixl`, 1P1D over nixl: `pd-1p1d-nixl.yaml`; all behind the
router), then alternates requests between them so machine
noise hits both alike. TTFT = time from sending a streaming `/generate`
through the router to the first SSE event carrying a token.

    .venv/bin/python bench/pd_overhead.py [--trials 10] [--lengths 16 2000] [--nixl]

Prints median/p90 TTFT per prompt length and the PD / colocated ratio (per backend).
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
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import build_local_plan, count_ports
from pdcluster.runtime.ports import free_ports

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
    ap.add_argument("--nixl", action="store_true", help="also 1P1D over nixl (the nixl extra)")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {"colocated": start("colocated.yaml", Path(tmp))}
        try:
            clusters["pd"] = start("pd-1p1d.yaml", Path(tmp))
            if args.nixl:
                clusters["pd-nixl"] = start("pd-1p1d-nixl.yaml", Path(tmp))
            with httpx.Client(timeout=120) as client:
                rows = []
                for n in args.lengths:
                    times: dict[str, list[float]] = {name: [] for name in clusters}
                    for trial in range(args.trials + 1):  # trial 0 warms up
                        prompt = [rng.randrange(1, 256) for _ in range(n)]
                        for name, cl in clusters.items():
                            t = ttft(client, cl.plan.endpoint, prompt)
                            if trial:
                                times[name].append(t)
                    rows.append((n, times))
        finally:
            for cl in clusters.values():
                cl.stop()
    pds = [name for name in clusters if name != "colocated"]
    header = f"{'prompt':>7} {'colocated p50':>14}"
    for name in pds:
        header += f" {name + ' p50':>12} {name + ' p90':>12} {name + ' ratio':>12}"
    print(header)
    for n, times in rows:
        c50 = statistics.median(times["colocated"])
        line = f"{n:>7} {c50 * 1e3:>11.1f} ms"
        for name in pds:
            p50 = statistics.median(times[name])
            p90 = statistics.quantiles(times[name], n=10)[-1]
            line += f" {p50 * 1e3:>9.1f} ms {p90 * 1e3:>9.1f} ms {p50 / c50:>12.2f}"
        print(line)


if __name__ == "__main__":
    main()

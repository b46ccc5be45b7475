"""Decode-side prefix reuse: KV bytes moved per request, decode cache on vs off.

    .venv/bin/python bench/decode_reuse.py [--requests 64] [--backend tcp]

Workload (issue 15's shape): `--requests` prompts, each one of `--systems`
distinct shared prompts of `--system-tokens` tokens plus `--suffix-tokens`
unique tokens, `--new-tokens` generated, sent one at a time round robin
through the router of two local 2P1D clusters (tiny model) that differ
only in the decode role's `engine.prefixCache`; requests alternate between
the clusters so machine noise hits both alike. KV bytes per request are
read from the decode worker's `pdcluster_transfer_bytes_total{direction="in"}`
before and after each request (exact: counted from the tokens that
travelled). Prints bytes per request for each, their ratio (on/off), the
pages decode reused, and TTFT p50 of each (the streamed first token).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import build_local_plan, count_ports
from pdcluster.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
IN_BYTES = 'pdcluster_transfer_bytes_total{direction="in"}'
REUSED = "pdcluster_decode_reuse_pages_total"


def start(state: Path, name: str, backend: str, decode_cache: bool) -> LocalCluster:
    doc = yaml.safe_load((ROOT / "examples" / "pd-2p2d.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec.setdefault("transfer", {})["backend"] = backend
    spec["prefill"]["replicas"] = 2
    spec["decode"]["replicas"] = 1
    spec["decode"].setdefault("engine", {})["prefixCache"] = decode_cache
    path = state / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    manifest = load_manifest(str(path))
    plan = build_local_plan(
        manifest, str(path), free_ports(count_ports(manifest)), python=sys.executable
    )
    cluster = LocalCluster(plan, state / name)
    cluster.start()
    cluster.wait_ready(300)
    return cluster


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


def decode_url(cluster: LocalCluster) -> str:
    (proc,) = [p for p in cluster.plan.processes if p.role == "decode"]
    return proc.url


def ttft(client: httpx.Client, endpoint: str, prompt: list[int], new_tokens: int) -> float:
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    first = None
    t0 = time.perf_counter()
    with client.stream("POST", f"{endpoint}/generate", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:]).get("output_ids"):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", default="tcp", choices=["tcp", "shm", "nixl"])
    args = ap.parse_args()
    rng = random.Random(0)
    systems = [
        [rng.randrange(1, 256) for _ in range(args.system_tokens)] for _ in range(args.systems)
    ]
    prompts = [
        systems[i % args.systems] + [rng.randrange(1, 256) for _ in range(args.suffix_tokens)]
        for i in range(args.requests)
    ]
    moved: dict[str, list[float]] = {"on": [], "off": []}
    times: dict[str, list[float]] = {"on": [], "off": []}
    reused: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        try:
            for mode in ("on", "off"):
                clusters[mode] = start(Path(tmp), f"reuse-{mode}", args.backend, mode == "on")
            with httpx.Client(timeout=300) as client:
                for prompt in prompts:
                    for mode, cl in clusters.items():
                        url = decode_url(cl) + "/metrics"
                        before = counter(client.get(url).text, IN_BYTES)
                        times[mode].append(ttft(client, cl.plan.endpoint, prompt, args.new_tokens))
                        after = client.get(url).text
                        moved[mode].append(counter(after, IN_BYTES) - before)
                for mode, cl in clusters.items():
                    reused[mode] = counter(client.get(decode_url(cl) + "/metrics").text, REUSED)
        finally:
            for cl in clusters.values():
                cl.stop()
    on, off = statistics.mean(moved["on"]), statistics.mean(moved["off"])
    print(f"workload: {args.requests} requests, {args.systems} x {args.system_tokens}-token")
    print(f"  systems + {args.suffix_tokens} unique, {args.new_tokens} new, 2P1D {args.backend}")
    print(f"{'decode cache':>12} {'KV bytes/request':>18} {'TTFT p50':>10} {'pages reused':>13}")
    for mode, mean in (("on", on), ("off", off)):
        p50 = statistics.median(times[mode]) * 1e3
        print(f"{mode:>12} {mean:>18,.0f} {p50:>7.1f} ms {reused[mode]:>13,.0f}")
    print(f"bytes ratio on/off: {on / off:.3f}")
    ttft_ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    print(f"TTFT p50 ratio on/off: {ttft_ratio:.3f}")


if __name__ == "__main__":
    main()

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
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    ROOT,
    add_prefix_workload_args,
    round_robin_prompts,
    start_doc,
    ttft,
)

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402

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
    return start_doc(doc, state)


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if match is None else float(match.group(1))


def decode_url(cluster: LocalCluster) -> str:
    (proc,) = [p for p in cluster.plan.processes if p.role == "decode"]
    return proc.url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_prefix_workload_args(ap, requests=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", default="tcp", choices=["tcp", "shm", "nixl"])
    args = ap.parse_args()
    prompts = round_robin_prompts(random.Random(0), args)
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

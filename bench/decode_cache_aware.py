"""cache_aware for decode: KV bytes moved per request, decode picked by
cache_aware vs round_robin.

    .venv/bin/python bench/decode_cache_aware.py [--requests 32] [--backend tcp]

Workload (issue 15's shape, more system prompts than one decode's pool
holds): `--requests` prompts, each a system prompt drawn at random from
`--systems` distinct ones of `--system-tokens` tokens, plus
`--suffix-tokens` unique tokens, `--new-tokens` generated, sent one at a
time through the routers of two local 2P2D clusters (tiny model,
`--num-pages` per rank, prefix cache on for both roles, prefill by
cache_aware) that differ only in `router.policy.decode`; requests alternate
between the clusters so machine noise hits both alike. round_robin makes
every decode hold every system prompt (more than its pool: they evict each
other); cache_aware keeps each on one decode. KV bytes per request are read from both decodes'
`pdcluster_transfer_bytes_total{direction="in"}` before and after each
request (exact). Prints bytes per request, the share of the shared prompt's
pages decode reused on requests whose system prompt came before, TTFT p50,
and the ratios cache_aware / round_robin.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.local.launcher import LocalCluster
from pdcluster.runtime.local.plan import build_local_plan, count_ports
from pdcluster.runtime.ports import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_reuse import IN_BYTES, REUSED, ROOT, counter, ttft  # noqa: E402

PAGE = 16


def start(state: Path, name: str, backend: str, decode_policy: str, num_pages: int) -> LocalCluster:
    doc = yaml.safe_load((ROOT / "examples" / "pd-2p2d.yaml").read_text())
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec.setdefault("transfer", {})["backend"] = backend
    spec["kvCache"]["numPages"] = num_pages
    for role in ("prefill", "decode"):
        spec[role].setdefault("engine", {})["prefixCache"] = True
    spec["router"]["policy"] = {"prefill": "cache_aware", "decode": decode_policy}
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


def decode_metrics(client: httpx.Client, cluster: LocalCluster, name: str) -> float:
    """`name` summed over the cluster's decodes."""
    urls = [p.url for p in cluster.plan.processes if p.role == "decode"]
    return sum(counter(client.get(url + "/metrics").text, name) for url in urls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=640)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--backend", default="tcp", choices=["tcp", "shm", "nixl"])
    args = ap.parse_args()
    rng = random.Random(0)
    systems = [
        [rng.randrange(1, 256) for _ in range(args.system_tokens)] for _ in range(args.systems)
    ]
    drawn = [rng.randrange(args.systems) for _ in range(args.requests)]
    prompts = [
        systems[k] + [rng.randrange(1, 256) for _ in range(args.suffix_tokens)] for k in drawn
    ]
    repeats = [i for i, k in enumerate(drawn) if k in drawn[:i]]
    modes = ("cache_aware", "round_robin")
    moved: dict[str, list[float]] = {m: [] for m in modes}
    reused: dict[str, list[float]] = {m: [] for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        clusters: dict[str, LocalCluster] = {}
        try:
            for mode in modes:
                clusters[mode] = start(
                    Path(tmp),
                    f"daware-{mode.replace('_', '-')}",
                    args.backend,
                    mode,
                    args.num_pages,
                )
            with httpx.Client(timeout=300) as client:
                for prompt in prompts:
                    for mode, cl in clusters.items():
                        bytes0 = decode_metrics(client, cl, IN_BYTES)
                        pages0 = decode_metrics(client, cl, REUSED)
                        times[mode].append(ttft(client, cl.plan.endpoint, prompt, args.new_tokens))
                        moved[mode].append(decode_metrics(client, cl, IN_BYTES) - bytes0)
                        reused[mode].append(decode_metrics(client, cl, REUSED) - pages0)
        finally:
            for cl in clusters.values():
                cl.stop()
    shared_pages = args.system_tokens // PAGE
    print(f"workload: {args.requests} requests, {args.systems} x {args.system_tokens}-token")
    print(f"  systems (random order) + {args.suffix_tokens} unique, {args.new_tokens} new,")
    print(f"  2P2D {args.backend}, {args.num_pages} pages per rank; {len(repeats)} repeats")
    head = (
        f"{'decode policy':>13} {'KV bytes/request':>18} {'reuse of repeats':>17} {'TTFT p50':>10}"
    )
    print(head)
    for mode in modes:
        share = statistics.mean(reused[mode][i] for i in repeats) / shared_pages
        p50 = statistics.median(times[mode]) * 1e3
        print(f"{mode:>13} {statistics.mean(moved[mode]):>18,.0f} {share:>17.2f} {p50:>7.1f} ms")
    aware, rr = (statistics.mean(moved[m]) for m in modes)
    print(f"bytes ratio cache_aware/round_robin: {aware / rr:.3f}")
    ttft_ratio = statistics.median(times["cache_aware"]) / statistics.median(times["round_robin"])
    print(f"TTFT p50 ratio cache_aware/round_robin: {ttft_ratio:.3f}")


if __name__ == "__main__":
    main()

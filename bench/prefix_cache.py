"""Prefix caching through local mode 2P1D: cache off vs on, round_robin vs
cache_aware, side by side in one run.

    .venv/bin/python bench/prefix_cache.py
    .venv/bin/python bench/prefix_cache.py --requests 16 --chart docs/images/prefix_cache.png

Workload (issue 15): `--requests` requests, each one of `--systems` distinct
shared system prompts of `--system-tokens` tokens (picked at random, seeded)
plus `--suffix-tokens` unique tokens, `--new-tokens` new tokens, greedy.
Three clusters, each 2 prefill instances + 1 decode (tiny model, CPU), run
at once and take turns request by request, so machine noise hits all alike:

- `off`: prefix cache off, prefill policy round_robin;
- `round_robin`: prefix cache on for prefill, round_robin;
- `cache_aware`: prefix cache on for prefill, cache_aware.

`--pages` KV pages per rank: the default holds about two system prompts per
prefill, so where a request goes decides whether its prefix is still cached
(with room for all four, round_robin would miss only each prompt's first
visit to each prefill). Requests are sent one at a time; TTFT is measured at
the router to the first streamed token.

Columns: TTFT p50 and p90; its ratio to `off`; prefix hit rate = hit tokens
/ (requests x system tokens), what a perfect router approaches (every
request but each prompt's first); token hit rate = hit tokens / prompt
tokens looked up (the engine's counters); KV bytes sent by the prefills per
request (`pdcluster_transfer_bytes_total{direction="out"}`: only the tokens
sent, so decode-side reuse shows here; `off` has the cache off on both roles).
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
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    add_prefix_workload_args,
    prefix_systems,
    start_doc,
    tiny_cluster,
    ttft,
)

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402
from pdcluster.runtime.spec import Role  # noqa: E402

VARIANTS = {
    "off": (False, "round_robin"),
    "round_robin": (True, "round_robin"),
    "cache_aware": (True, "cache_aware"),
}


def start(name: str, cache: bool, policy: str, pages: int, state: Path) -> LocalCluster:
    doc = tiny_cluster(
        name.replace("_", "-"),
        {
            "kvCache": {"pageSize": 16, "numPages": pages},
            "prefill": {"replicas": 2, "engine": {"prefixCache": cache}},
            # Decode keeps the prompt pages it received (decode-side reuse) iff the
            # variant caches: `off` is no cache anywhere.
            "decode": {"engine": {"prefixCache": cache}},
            "router": {"policy": {"prefill": policy}},
        },
    )
    return start_doc(doc, state)


def _sum_metric(text: str, name: str, label: str = "") -> float:
    pattern = rf"^{name}(\{{[^}}]*{label}[^}}]*\}})? (\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))


def counters(client: httpx.Client, cluster: LocalCluster) -> dict[str, float]:
    out = {"hit": 0.0, "lookup": 0.0, "bytes": 0.0}
    for proc in cluster.plan.workers:
        if proc.role is not Role.prefill:
            continue
        text = client.get(f"{proc.url}/metrics").text
        out["hit"] += _sum_metric(text, "pdcluster_prefix_cache_hit_tokens_total")
        out["lookup"] += _sum_metric(text, "pdcluster_prefix_cache_lookup_tokens_total")
        out["bytes"] += _sum_metric(text, "pdcluster_transfer_bytes_total", 'direction="out"')
    return out


def chart(rows: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.bar(names, [rows[n]["p50_ms"] for n in names], color=["#999", "#6a9fd4", "#2c7a3f"])
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title("Time to first token")
    ax2.bar(names, [rows[n]["prefix_hit"] for n in names], color=["#999", "#6a9fd4", "#2c7a3f"])
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("prefix hit rate")
    ax2.set_title("Shared prompt tokens reused")
    for ax in (ax1, ax2):
        for label in ax.get_xticklabels():
            label.set_rotation(10)
    fig.suptitle("Prefix cache, local 2P1D (tiny model, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prefix_workload_args(ap, requests=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pages", type=int, default=256, help="KV pages per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chart", type=Path, help="write a PNG chart here")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    systems = prefix_systems(rng, args)
    prompts = [
        rng.choice(systems) + [rng.randrange(1, 256) for _ in range(args.suffix_tokens)]
        for _ in range(args.requests)
    ]
    warmup = [rng.randrange(1, 256) for _ in range(40)]  # no shared prefix
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        clusters: dict[str, LocalCluster] = {}
        try:
            for name, (cache, policy) in VARIANTS.items():
                clusters[name] = start(name, cache, policy, args.pages, Path(tmp))
            with httpx.Client(timeout=300) as client:
                for cl in clusters.values():
                    for _ in range(2):  # both prefills once (round robin / by load)
                        ttft(client, cl.plan.endpoint, warmup, 2)
                before = {n: counters(client, cl) for n, cl in clusters.items()}
                t0 = time.perf_counter()
                for prompt in prompts:
                    for name, cl in clusters.items():
                        times[name].append(ttft(client, cl.plan.endpoint, prompt, args.new_tokens))
                wall = time.perf_counter() - t0
                after = {n: counters(client, cl) for n, cl in clusters.items()}
        finally:
            for cl in clusters.values():
                cl.stop()

    rows: dict[str, dict[str, Any]] = {}
    off50 = statistics.median(times["off"])
    for name in VARIANTS:
        d = {k: after[name][k] - before[name][k] for k in after[name]}
        p50 = statistics.median(times[name])
        rows[name] = {
            "p50_ms": p50 * 1e3,
            "p90_ms": statistics.quantiles(times[name], n=10)[-1] * 1e3,
            "ratio": p50 / off50,
            "prefix_hit": d["hit"] / (args.requests * args.system_tokens),
            "token_hit": d["hit"] / d["lookup"] if d["lookup"] else 0.0,
            "kv_bytes_per_request": d["bytes"] / args.requests,
        }
    print(
        f"{args.requests} requests, {args.systems} system prompts x {args.system_tokens} "
        f"tokens + {args.suffix_tokens} unique, {args.new_tokens} new tokens, "
        f"{args.pages} pages/rank; {wall:.0f} s for all three"
    )
    print(
        f"{'variant':<12} {'TTFT p50':>10} {'TTFT p90':>10} {'vs off':>7} "
        f"{'prefix hit':>10} {'token hit':>9} {'KV bytes/req':>13}"
    )
    for name, r in rows.items():
        print(
            f"{name:<12} {r['p50_ms']:>7.1f} ms {r['p90_ms']:>7.1f} ms {r['ratio']:>7.2f} "
            f"{r['prefix_hit']:>10.2f} {r['token_hit']:>9.2f} {r['kv_bytes_per_request']:>13,.0f}"
        )
    aware, rr = rows["cache_aware"], rows["round_robin"]
    print(f"cache_aware / round_robin TTFT p50: {aware['p50_ms'] / rr['p50_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.chart:
        chart(rows, args.chart)


if __name__ == "__main__":
    main()

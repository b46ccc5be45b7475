"""Several builds of the runtime side by side in one run: PD fixed cost and router throughput.

Each build is `NAME=REV[:LOOP]`: a git revision (`HEAD`, a commit, a branch)
whose `runtime/` and `operator/` are extracted to a temporary folder, and
the event loop its processes run on (`PDCLUSTER_EVENT_LOOP`, default
uvloop, the runtime's own default). For every build the script starts the colocated and the 1P1D
example (`tcp`, each with its own router) with that build on PYTHONPATH,
then takes turns between all of them (the order rotates every trial and
round, so machine noise hits every build alike):

- TTFT: streaming `/generate` through each router, `--lengths` prompt
  tokens, 4 new tokens, one request at a time; per build the colocated and
  PD p50, PD p90, the fixed cost (PD p50 − colocated p50) and the ratio;
- throughput: `--concurrency` streaming clients on each build's 1P1D
  router, 16-token prompts for 16 new tokens, `--seconds` per round,
  median over `--rounds`.

    .venv/bin/python bench/builds.py base=main new=HEAD new+asyncio=HEAD:asyncio

The harness itself (this script, the examples) comes from the working tree.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, start_example  # noqa: E402
from router import body_of, stream_request, throughput  # noqa: E402

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402


@dataclass(frozen=True)
class Build:
    name: str
    rev: str
    loop: str


def parse_build(text: str) -> Build:
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=REV[:LOOP]")
    rev, _, loop = spec.partition(":")
    return Build(name, rev, loop or "uvloop")


def extract(rev: str, into: Path) -> Path:
    """`rev`'s runtime/ and operator/ as the `pdcluster` package; its PYTHONPATH entry."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "runtime", "operator"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    pkg = into / "_pkg" / "pdcluster"
    pkg.mkdir(parents=True)
    for folder in ("runtime", "operator"):
        (pkg / folder).symlink_to(into / folder)
    return into / "_pkg"


def start_build(build: Build, path_entry: Path, state: Path) -> dict[str, LocalCluster]:
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = str(path_entry)  # the processes' own environment
    os.environ["PDCLUSTER_EVENT_LOOP"] = build.loop
    try:
        clusters = {}
        for kind, example in (("colocated", "colocated.yaml"), ("pd", "pd-1p1d.yaml")):
            folder = state / f"{build.name}-{kind}"
            folder.mkdir()
            clusters[kind] = start_example(example, folder)
        return clusters
    finally:
        os.environ.clear()
        os.environ.update(saved)


def rotated(items: list[str], turn: int) -> list[str]:
    k = turn % len(items)
    out = items[k:] + items[:k]
    return out[::-1] if turn % 2 else out


async def measure(
    args: argparse.Namespace, clusters: dict[str, dict[str, LocalCluster]]
) -> tuple[dict[tuple[int, str, str], list[float]], dict[str, list[tuple[float, float]]]]:
    rng = random.Random(0)
    names = list(clusters)
    times: dict[tuple[int, str, str], list[float]] = {}
    rates: dict[str, list[tuple[float, float]]] = {}
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        for n in args.lengths:
            for trial in range(args.trials + 1):  # trial 0 warms up
                prompt = [rng.randrange(1, 256) for _ in range(n)]
                for name in rotated(names, trial):
                    for kind in ("colocated", "pd") if trial % 2 else ("pd", "colocated"):
                        url = clusters[name][kind].plan.endpoint
                        t, _ = await stream_request(client, url, body_of(prompt, 4))
                        if trial:
                            times.setdefault((n, name, kind), []).append(t)
        for turn in range(args.rounds + 1):  # round 0 warms up
            for name in rotated(names, turn):
                url = clusters[name]["pd"].plan.endpoint
                seconds = args.seconds if turn else 1.0
                rate = await throughput(client, url, args.concurrency, seconds)
                if turn:
                    rates.setdefault(name, []).append(rate)
    return times, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+", type=parse_build, help="NAME=REV[:asyncio|uvloop]")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 2000])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if len({b.name for b in args.builds}) != len(args.builds):
        ap.error("build names must differ")
    clusters: dict[str, dict[str, LocalCluster]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trees: dict[str, Path] = {}
            for build in args.builds:
                if build.rev not in trees:
                    trees[build.rev] = extract(build.rev, Path(tmp) / f"tree-{len(trees)}")
                clusters[build.name] = start_build(build, trees[build.rev], Path(tmp))
            times, rates = asyncio.run(measure(args, clusters))
        finally:
            for pair in clusters.values():
                for cluster in pair.values():
                    cluster.stop()
    print(f"TTFT, {args.trials} trials per cell")
    print(
        f"{'build':>14} {'prompt':>6} {'coloc p50':>10} {'PD p50':>10} {'PD p90':>10} "
        f"{'fixed':>9} {'ratio':>6}"
    )
    for n in args.lengths:
        for build in args.builds:
            coloc = statistics.median(times[(n, build.name, "colocated")])
            pd = times[(n, build.name, "pd")]
            p50, p90 = statistics.median(pd), statistics.quantiles(pd, n=10)[-1]
            print(
                f"{build.name:>14} {n:>6} {coloc * 1e3:>7.1f} ms {p50 * 1e3:>7.1f} ms "
                f"{p90 * 1e3:>7.1f} ms {(p50 - coloc) * 1e3:>6.1f} ms {p50 / coloc:>6.2f}"
            )
    print(
        f"\nthroughput, {args.concurrency} clients on the 1P1D router, "
        f"{args.seconds:g} s rounds, median of {args.rounds}"
    )
    for build in args.builds:
        rs = rates[build.name]
        req = statistics.median(r[0] for r in rs)
        tok = statistics.median(r[1] for r in rs)
        each = ", ".join(f"{r[0]:.1f}" for r in rs)
        print(f"{build.name:>14} {req:6.1f} req/s {tok:7.1f} tok/s   (rounds: {each} req/s)")


if __name__ == "__main__":
    main()

"""Autoscaling vs fixed capacity: one bursty trace, three local clusters.

Replays the same seeded open-loop trace (Poisson arrivals whose rate steps
between a low and a burst rate) through `pdcluster up -f` with the tiny
model, three times:

  (a) fixed 1P1D, (b) fixed 2P2D, (c) the built-in planner, min 1 max 2 per
  role (prefill on TTFT p90, decode on TPOT p90; `--interval`, scale-up
  window 0, scale-down window `--down-window`).

Per run: TTFT p90 and TPOT p90 (measured at the client, streaming), SLO
violations (a request over `--ttft-slo` or `--tpot-slo`, or failed), and
instance-seconds (worker instances alive, sampled from the state file that
`pdcluster ps` reads, integrated over the trace). For (c) it writes a PNG of
replicas per role and the offered load over time (matplotlib: `.[plot]`).

    .venv/bin/python bench/autoscale.py [--seed 1] [--plot docs/images/autoscale.png]

Target (issue 14): (c) meets the SLO as often as (b) with <= 0.7x its
instance-seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import tiny_cluster, write_manifest  # noqa: E402

SAMPLE_S = 0.25


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float  # requests per second


def parse_trace(text: str) -> list[Phase]:
    """`30x0.5,15x4` -> 30 s at 0.5 req/s, then 15 s at 4 req/s."""
    out = []
    for part in text.split(","):
        seconds, rate = part.split("x")
        out.append(Phase(float(seconds), float(rate)))
    return out


def arrivals(trace: list[Phase], seed: int) -> list[float]:
    rng = random.Random(seed)
    out, start = [], 0.0
    for phase in trace:
        t = start
        while True:
            t += rng.expovariate(phase.rate)
            if t >= start + phase.seconds:
                break
            out.append(t)
        start += phase.seconds
    return out


def manifest(name: str, replicas: int, autoscale: dict[str, Any] | None) -> dict[str, Any]:
    def role(metric: str, target: float) -> dict[str, Any]:
        spec: dict[str, Any] = {"replicas": replicas}
        if autoscale is not None:
            spec["autoscaling"] = {
                "minReplicas": 1,
                "maxReplicas": 2,
                "intervalSeconds": autoscale["interval"],
                "target": {"metric": metric, "value": target},
                "scaleUp": {"stabilizationSeconds": 0},
                "scaleDown": {"stabilizationSeconds": autoscale["down_window"]},
            }
        return spec

    ttft = autoscale["ttft_target"] if autoscale else 1.0
    tpot = autoscale["tpot_target"] if autoscale else 1.0
    return tiny_cluster(
        name,
        {
            "kvCache": {"pageSize": 16, "numPages": 2048},
            "prefill": role("ttftP90Seconds", ttft),
            "decode": role("tpotP90Seconds", tpot),
            "router": {
                "healthCheckIntervalSeconds": 0.5,
                "policy": {"prefill": "least_outstanding", "decode": "least_outstanding"},
            },
        },
    )


@dataclass
class Result:
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    # (seconds since the trace started, prefill instances, decode instances)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)
    duration: float = 0.0
    log: str = ""


class Cluster:
    """`pdcluster up -f` as a process tree; stopped with SIGINT like a user would."""

    def __init__(self, tmp: Path, doc: dict[str, Any]) -> None:
        self.name = doc["metadata"]["name"]
        self.path = write_manifest(doc, tmp)
        self.state_dir = tmp / "state"
        self.log_path = tmp / f"up-{self.name}.log"
        self.state_file = self.state_dir / self.name / "state.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def __enter__(self) -> Cluster:
        cmd = [sys.executable, "-m", "pdcluster.runtime.cli", "up", "-f", str(self.path)]
        cmd += ["--port", "0", "--state-dir", str(self.state_dir)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdcluster up exited:\n{self.log_path.read_text()[-3000:]}")
            if self.state_file.exists() and "serving on" in self.log_path.read_text():
                self.endpoint = json.loads(self.state_file.read_text())["endpoint"]
                return self
            time.sleep(0.2)
        raise TimeoutError(f"not ready:\n{self.log_path.read_text()[-3000:]}")

    def __exit__(self, *_: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def instances(self) -> tuple[int, int]:
        """Worker instances alive now (any phase: each holds its GPUs), per role."""
        try:
            state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return -1, -1
        roles = [p["role"] for p in state["processes"]]
        return roles.count("prefill"), roles.count("decode")


def one_request(endpoint: str, prompt: str, max_tokens: int) -> Result:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    started = time.monotonic()
    first = last = None
    chunks = 0
    try:
        with httpx.stream(
            "POST", endpoint + "/v1/completions", json=body, timeout=300, trust_env=False
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                return Result(error=f"{resp.status_code}: {resp.text[:200]}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(error=str(data["error"])[:200])
                if data["choices"][0].get("text"):
                    now = time.monotonic()
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except httpx.HTTPError as err:
        return Result(error=f"{type(err).__name__}: {err}")
    if first is None or last is None:
        return Result(error="no token")
    tpot = (last - first) / (chunks - 1) if chunks > 1 else 0.0
    return Result(ttft=first - started, tpot=tpot)


def replay(
    cluster: Cluster, name: str, times: list[float], prompts: list[str], max_tokens: int
) -> Run:
    run = Run(name)
    futures: list[Future[Result]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.is_set():
            p, d = cluster.instances()
            if p >= 0:
                run.replicas.append((time.monotonic() - t0, p, d))
            stop.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(128) as pool:
        for at, prompt in zip(times, prompts, strict=True):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one_request, cluster.endpoint, prompt, max_tokens))
        run.results = [f.result() for f in futures]
    run.duration = time.monotonic() - t0
    stop.set()
    sampler.join()
    run.log = cluster.log_path.read_text(errors="replace")
    return run


def p90(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def instance_seconds(run: Run) -> float:
    total = 0.0
    for (t, p, d), (t_next, _, _) in zip(run.replicas, run.replicas[1:], strict=False):
        total += (p + d) * (t_next - t)
    return total


def violations(run: Run, ttft_slo: float, tpot_slo: float) -> int:
    return sum(
        1
        for r in run.results
        if r.error is not None
        or (r.ttft is not None and r.ttft > ttft_slo)
        or (r.tpot is not None and r.tpot > tpot_slo)
    )


def plot(run: Run, times: list[float], trace: list[Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load_ax, rep_ax) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    edges, rates, start = [], [], 0.0
    for phase in trace:
        edges += [start, start + phase.seconds]
        rates += [phase.rate, phase.rate]
        start += phase.seconds
    load_ax.plot(edges, rates, color="grey", label="offered rate")
    bins = [int(t // 5) for t in times]
    counts = {b: bins.count(b) / 5 for b in set(bins)}
    xs = sorted(counts)
    load_ax.step([x * 5 for x in xs], [counts[x] for x in xs], where="post", label="arrivals (5 s)")
    load_ax.set_ylabel("requests / s")
    load_ax.legend(loc="upper right")
    ts = [t for t, _, _ in run.replicas]
    rep_ax.step(ts, [p for _, p, _ in run.replicas], where="post", label="prefill")
    rep_ax.step(ts, [d + 0.05 for _, _, d in run.replicas], where="post", label="decode")
    rep_ax.set_ylabel("instances")
    rep_ax.set_xlabel("seconds")
    rep_ax.set_yticks([0, 1, 2, 3])
    rep_ax.legend(loc="upper right")
    fig.suptitle("pdcluster up, planner min 1 max 2 per role: replicas vs load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="20x0.3,20x2.5,30x0.3,20x2.5,40x0.3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=200, help="bytes (tiny: one token each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.2)
    ap.add_argument("--ttft-target", type=float, default=1.0, help="(c): prefill TTFT p90")
    ap.add_argument("--tpot-target", type=float, default=0.1, help="(c): decode TPOT p90")
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--down-window", type=float, default=8.0)
    ap.add_argument("--runs", default="a,b,c", help="which of a, b, c to run")
    ap.add_argument("--plot", default="docs/images/autoscale.png")
    args = ap.parse_args()

    trace = parse_trace(args.trace)
    times = arrivals(trace, args.seed)
    rng = random.Random(args.seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(rng.choice(letters) for _ in range(args.prompt_len)) for _ in times]
    autoscale = {
        "interval": args.interval,
        "down_window": args.down_window,
        "ttft_target": args.ttft_target,
        "tpot_target": args.tpot_target,
    }
    setups = {
        "a": ("(a) fixed 1P1D", manifest("bench-fixed-1", 1, None)),
        "b": ("(b) fixed 2P2D", manifest("bench-fixed-2", 2, None)),
        "c": ("(c) planner 1..2", manifest("bench-scaled", 1, autoscale)),
    }
    print(f"trace {args.trace}: {len(times)} requests, seed {args.seed}", flush=True)
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="pdc-autoscale-") as tmp:
        for key in args.runs.split(","):
            label, doc = setups[key]
            with Cluster(Path(tmp), doc) as cluster:
                runs[key] = replay(cluster, label, times, prompts, args.max_tokens)
            print(f"{label}: done in {runs[key].duration:.0f}s", flush=True)

    print()
    print(
        f"SLO: TTFT <= {args.ttft_slo:g} s and TPOT <= {args.tpot_slo:g} s per request; "
        f"{len(times)} requests"
    )
    print()
    print("| run | TTFT p90 (s) | TPOT p90 (s) | SLO violations | failed | instance-seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for run in runs.values():
        ok = [r for r in run.results if r.error is None]
        print(
            f"| {run.name} | {p90([r.ttft for r in ok if r.ttft is not None]):.3f} "
            f"| {p90([r.tpot for r in ok if r.tpot is not None]):.4f} "
            f"| {violations(run, args.ttft_slo, args.tpot_slo)} "
            f"| {sum(r.error is not None for r in run.results)} "
            f"| {instance_seconds(run):.0f} |"
        )
    if "b" in runs and "c" in runs:
        b, c = runs["b"], runs["c"]
        ratio = instance_seconds(c) / instance_seconds(b)
        vb = violations(b, args.ttft_slo, args.tpot_slo)
        vc = violations(c, args.ttft_slo, args.tpot_slo)
        met = vc <= vb and ratio <= 0.7
        print(
            f"\n(c)/(b) instance-seconds {ratio:.2f}; violations (c) {vc} vs (b) {vb}: "
            f"target {'met' if met else 'NOT met'}"
        )
    if "c" in runs:
        decisions = [
            line for line in runs["c"].log.splitlines() if line.startswith(("Normal", "Warning"))
        ]
        print("\n(c) decisions:\n" + "\n".join(decisions))
        if args.plot:
            plot(runs["c"], times, trace, Path(args.plot))
            print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()

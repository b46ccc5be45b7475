"""Stock vLLM behind our router, against vLLM alone, side by side in one run.

Starts two local clusters of real vLLM processes (`--vllm`, default: the
cached environment of e2e/vllmenv) serving the tiny random Llama of the
vLLM tests: a 1P1D cluster (NixlConnector, our router in front) and a
colocated one (one vLLM, our router in front). Three paths serve the same
requests, taking turns (the order rotates every trial, so machine noise hits
each alike):

- `direct`: vLLM colocated, called straight (the floor);
- `router`: the same vLLM through our router (colocated mode): what our
  router adds;
- `pd`: the 1P1D cluster through our router (prefill leg, then decode leg
  reading the KV over NIXL).

Measured:
- TTFT: a streamed `/v1/completions` of `--lengths` prompt tokens (fresh
  random ids every request: no prefix-cache hit), one request at a time,
  p50 per path; the table's ratios are p50 ÷ direct's p50;
- router added latency: router p50 - direct p50 at the shortest length;
- throughput: `--clients` streaming clients sending 16-token prompts for 16
  new tokens back to back for `--seconds` (then the last ones finish):
  requests/s over the round and its drain, a request's p50, our router's
  process CPU per request (user + system, all threads: the steadier number
  on a shared box), and for `pd` the decode's own NIXL read times over the
  round (`vllm:nixl_xfer_time_seconds`, vLLM's metric), which bound it here.

    .venv/bin/python bench/vllm_pd.py [--quick] [--vllm PATH]

Prints a JSON summary (and writes it to `--out` if given). On a busy 2-core
box a vLLM start takes minutes; `--quick` only shortens the measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from router import cpu_seconds  # noqa: E402

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402
from pdcluster.runtime.local.plan import build_local_plan, count_ports  # noqa: E402
from pdcluster.runtime.ports import free_ports  # noqa: E402
from pdcluster.runtime.spec import parse_manifest  # noqa: E402
from tests.vllm.harness import MODEL_NAME, read_metrics, vllm_spec, write_vllm_model  # noqa: E402

READY_S = 1200
NEW_TOKENS = 16
VOCAB = (2, 299)  # the tiny tokenizer's ids, less bos/eos


def start(spec: dict[str, Any], name: str, state: Path, vllm: str) -> LocalCluster:
    doc = {
        "apiVersion": "pdcluster.io/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name},
        "spec": spec,
    }
    path = state / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    manifest = parse_manifest(doc)
    ports = free_ports(count_ports(manifest))
    plan = build_local_plan(manifest, str(path), ports, python=sys.executable, vllm=vllm)
    cluster = LocalCluster(plan, state / name)
    cluster.start()
    return cluster


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(*VOCAB) for _ in range(length)]


def ttft(client: httpx.Client, url: str, ids: list[int], headers: dict[str, str]) -> float:
    body = {
        "model": MODEL_NAME,
        "prompt": ids,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    first = None
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: stream ended without a token")
    return first


async def throughput(
    url: str, headers: dict[str, str], clients: int, seconds: float, seed: int
) -> tuple[float, float]:
    """`clients` streaming clients sending back to back; none starts a request after
    `seconds`. Returns (requests/s over the round and its drain, p50 seconds of one)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:
                body = {
                    "model": MODEL_NAME,
                    "prompt": prompt(rng, 16),
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                }
                t0 = time.perf_counter()
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for _ in resp.aiter_lines():
                        pass
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        took = time.perf_counter() - started
        return len(latencies) / took, statistics.median(latencies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", help="vLLM program (default: the cached e2e/vllmenv interpreter)")
    ap.add_argument("--lengths", default="16,2000")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="4 trials, 10 s of throughput")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.trials, args.seconds = 4, 10.0
    if args.vllm is None:
        from e2e.vllmenv.build import ensure_vllm_env

        args.vllm = str(ensure_vllm_env().python)
    lengths = [int(n) for n in args.lengths.split(",")]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        state = Path(tmp)
        model = write_vllm_model(state / "model")
        pd_spec = vllm_spec(model)
        pd_spec["engine"]["vllm"]["extraArgs"] = ["--max-model-len", "2048", "--enforce-eager"]
        colocated_spec = {k: v for k, v in pd_spec.items() if k not in ("prefill", "decode")}
        colocated_spec = {**colocated_spec, "colocated": {}}
        colocated_spec["router"] = {"policy": {"decode": "round_robin"}}
        clusters = {
            "pd": start(pd_spec, "bench-vllm-pd", state, args.vllm),
            "colocated": start(colocated_spec, "bench-vllm-colocated", state, args.vllm),
        }
        try:
            for cluster in clusters.values():
                cluster.wait_ready(READY_S)
                cluster.wait_admitted(READY_S)
            colocated = clusters["colocated"]
            auth = {"Authorization": f"Bearer {colocated.token}"}
            paths = {
                "direct": (colocated.plan.workers[0].url, auth),
                "router": (colocated.plan.endpoint, {}),
                "pd": (clusters["pd"].plan.endpoint, {}),
            }
            routers = {
                "router": colocated.procs["router"].pid,
                "pd": clusters["pd"].procs["router"].pid,
            }
            decode = next(w.url for w in clusters["pd"].plan.workers if w.role == "decode")
            results = measure(paths, lengths, args, rng, routers, decode)
        finally:
            for cluster in clusters.values():
                cluster.stop()
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def measure(
    paths: dict[str, tuple[str, dict[str, str]]],
    lengths: list[int],
    args: argparse.Namespace,
    rng: random.Random,
    routers: dict[str, int],
    decode: str,
) -> dict[str, Any]:
    names = list(paths)
    samples: dict[int, dict[str, list[float]]] = {n: {p: [] for p in names} for n in lengths}
    with httpx.Client(timeout=600) as client:
        for name in names:  # one request each first: connections, the decode's NIXL handshake
            url, headers = paths[name]
            ttft(client, url, prompt(rng, 16), headers)
        for trial in range(args.trials):
            order = names[trial % len(names) :] + names[: trial % len(names)]
            for length in lengths:
                for name in order:
                    url, headers = paths[name]
                    samples[length][name].append(ttft(client, url, prompt(rng, length), headers))
    out: dict[str, Any] = {"trials": args.trials, "ttft_p50_ms": {}, "ttft_ratio_to_direct": {}}
    for length in lengths:
        p50 = {p: statistics.median(samples[length][p]) * 1000 for p in names}
        out["ttft_p50_ms"][length] = {p: round(v, 1) for p, v in p50.items()}
        out["ttft_ratio_to_direct"][length] = {
            p: round(p50[p] / p50["direct"], 2) for p in names if p != "direct"
        }
    short = min(lengths)
    out["router_added_ms"] = round(
        out["ttft_p50_ms"][short]["router"] - out["ttft_p50_ms"][short]["direct"], 1
    )
    out["throughput_rps"], out["router_cpu_ms_per_request"], out["request_p50_s"] = {}, {}, {}
    for i, name in enumerate(names):
        url, headers = paths[name]
        pid = routers.get(name)
        cpu = cpu_seconds(pid) if pid else 0.0
        before = read_metrics(decode) if name == "pd" else None
        started = time.perf_counter()
        rps, p50 = asyncio.run(throughput(url, headers, args.clients, args.seconds, seed=i))
        took = time.perf_counter() - started
        out["throughput_rps"][name] = round(rps, 2)
        out["request_p50_s"][name] = round(p50, 2)
        if pid and rps > 0:
            per_request = (cpu_seconds(pid) - cpu) / (rps * took)
            out["router_cpu_ms_per_request"][name] = round(per_request * 1000, 2)
        if before is not None:
            after = read_metrics(decode)
            reads = after.kv_reads - before.kv_reads
            spent = after.get("vllm:nixl_xfer_time_seconds_sum") - before.get(
                "vllm:nixl_xfer_time_seconds_sum"
            )
            out["pd_nixl_reads"] = int(reads)
            out["pd_nixl_read_ms_mean"] = round(spent / reads * 1000, 1) if reads else None
    direct = out["throughput_rps"]["direct"]
    out["throughput_ratio_to_direct"] = {
        p: round(out["throughput_rps"][p] / direct, 2) for p in names if p != "direct"
    }
    out["clients"], out["seconds"] = args.clients, args.seconds
    return out


if __name__ == "__main__":
    raise SystemExit(main())

"""TTFT of PD-disaggregated serving vs colocated serving, side by side in one run.

Starts local clusters from the example manifests (colocated, 1P1D over
tcp and, with `--nixl`, 1P1D over nixl: `pd-1p1d-nixl.yaml`; all behind the
router), then alternates requests between them, the order rotating every
trial, so machine noise hits both alike. TTFT = time from sending a
streaming `/generate` through the router to the first SSE event carrying a
token.

    .venv/bin/python bench/pd_overhead.py [--trials 10] [--lengths 16 2000] [--nixl] [--device cuda]
        [--tracing]

Prints median/p90 TTFT per prompt length and the PD / colocated ratio (per backend).
With `--tracing`, a third 1P1D cluster runs with `observability.tracing` on,
exporting to a real OpenTelemetry Collector (`e2e/otelcol`). Its requests
alternate between a sampled `traceparent` (`pd-traced`: spans on the router,
prefill and decode) and an unsampled one (`pd-unsampled`: the same
processes, no spans), so the tracing cost is read on one cluster, free of
the noise between two clusters: the table's last column is `pd-traced`'s p50
minus `pd-unsampled`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, start_doc, ttft  # noqa: E402

from pdcluster.runtime.local.launcher import LocalCluster  # noqa: E402

NEW_TOKENS = 4
# The traced cluster's two kinds of request: a caller's sampled and unsampled trace.
_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
TRACE_HEADERS = {
    "pd-traced": {"traceparent": f"{_TRACE}-01"},
    "pd-unsampled": {"traceparent": f"{_TRACE}-00"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 2000])
    ap.add_argument("--nixl", action="store_true", help="also 1P1D over nixl (the nixl extra)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="every role's engine")
    ap.add_argument("--tracing", action="store_true", help="also 1P1D with tracing on")
    args = ap.parse_args()

    def start_example(
        example: str, state: Path, tracing_endpoint: str | None = None
    ) -> LocalCluster:
        doc = yaml.safe_load((ROOT / "examples" / example).read_text())
        for role in ("colocated", "prefill", "decode"):
            if role in doc["spec"]:
                doc["spec"][role]["device"] = args.device
        if tracing_endpoint is not None:
            doc["metadata"]["name"] += "-traced"
            doc["spec"]["observability"] = {
                "tracing": {"enabled": True, "endpoint": tracing_endpoint, "sampleRatio": 1.0}
            }
        return start_doc(doc, state)

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        clusters = {"colocated": start_example("colocated.yaml", Path(tmp))}
        try:
            clusters["pd"] = start_example("pd-1p1d.yaml", Path(tmp))
            if args.nixl:
                clusters["pd-nixl"] = start_example("pd-1p1d-nixl.yaml", Path(tmp))
            if args.tracing:
                sys.path.insert(0, str(ROOT))
                from e2e.otelcol.receiver import otlp_receiver

                receiver = stack.enter_context(otlp_receiver(Path(tmp) / "otel"))
                traced = start_example("pd-1p1d.yaml", Path(tmp), receiver.endpoint)
                clusters["pd-traced"] = traced
                clusters["pd-unsampled"] = traced
            with httpx.Client(timeout=120) as client:
                rows = []
                for n in args.lengths:
                    times: dict[str, list[float]] = {name: [] for name in clusters}
                    order = list(clusters.items())
                    for trial in range(args.trials + 1):  # trial 0 warms up
                        prompt = [rng.randrange(1, 256) for _ in range(n)]
                        # The order rotates every trial: no cluster always goes right
                        # after another one's request (whose tail may still be running).
                        shift = trial % len(order)
                        for name, cl in order[shift:] + order[:shift]:
                            headers = TRACE_HEADERS.get(name)
                            if name == "pd-unsampled":
                                # The traced cluster's second request of the trial: a prompt
                                # of its own, or it would hit that cluster's prefix cache.
                                own = [rng.randrange(1, 256) for _ in range(n)]
                                t = ttft(client, cl.plan.endpoint, own, NEW_TOKENS, headers)
                            else:
                                t = ttft(client, cl.plan.endpoint, prompt, NEW_TOKENS, headers)
                            if trial:
                                times[name].append(t)
                    rows.append((n, times))
        finally:
            for cl in {id(c): c for c in clusters.values()}.values():
                cl.stop()
    pds = [name for name in clusters if name != "colocated"]
    header = f"{'prompt':>7} {'colocated p50':>14}"
    for name in pds:
        header += f" {name + ' p50':>12} {name + ' p90':>12} {name + ' ratio':>12}"
    if "pd-traced" in clusters:
        header += f" {'tracing cost':>13}"
    print(header)
    for n, times in rows:
        c50 = statistics.median(times["colocated"])
        line = f"{n:>7} {c50 * 1e3:>11.1f} ms"
        for name in pds:
            p50 = statistics.median(times[name])
            p90 = statistics.quantiles(times[name], n=10)[-1]
            line += f" {p50 * 1e3:>9.1f} ms {p90 * 1e3:>9.1f} ms {p50 / c50:>12.2f}"
        if "pd-traced" in times:
            cost = statistics.median(times["pd-traced"]) - statistics.median(times["pd-unsampled"])
            line += f" {cost * 1e3:>+10.2f} ms"
        print(line)


if __name__ == "__main__":
    main()

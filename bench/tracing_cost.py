"""What tracing costs a request on its path, side by side with tracing off.

A request's own thread only decides its trace, mints span ids, stamps times
and queues its finished records (`telemetry/tracing.py`); building the SDK
spans and exporting them (to a real OpenTelemetry Collector, `e2e/otelcol`)
happens on two threads of their own. This measures the first part per
request in the router (request, plan, two legs, each leg's `traceparent`)
and in a decode worker (stamps, span plan, submit), alternating with the
same loop with tracing off, and then how long the background threads take
to build and export what was queued (their CPU competes with requests for
the GIL, it does not wait in front of them).

    .venv/bin/python bench/tracing_cost.py [--requests 20000]

Prints µs per request for each side and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e.otelcol.receiver import otlp_receiver  # noqa: E402
from pdcluster.runtime.router.metrics import RouterMetrics  # noqa: E402
from pdcluster.runtime.router.request_record import RequestRecord  # noqa: E402
from pdcluster.runtime.spec import TracingSpec  # noqa: E402
from pdcluster.runtime.telemetry.span_plan import (  # noqa: E402
    RequestOutcome,
    RequestStamps,
    Stage,
    plan_worker_spans,
)
from pdcluster.runtime.telemetry.tracing import start_tracing  # noqa: E402

USAGE = ': usage {"prompt_tokens":16,"completion_tokens":4,"finish_reason":"stop"}'
HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def router_request(tracing: object, metrics: RouterMetrics, i: int) -> None:
    """The router's tracing work for one request (the record does nothing more when off)."""
    record = RequestRecord.arriving(tracing, HEADERS, "/v1/completions")
    record.planned()
    record.started(f"req-{i:032x}", i + 1)
    record.leg_headers("prefill", "http://p:8000")
    record.leg_headers("decode", "http://d:8000")
    record.end_leg("prefill")
    record.read_usage_comment(USAGE)
    record.finish(metrics)


def worker_request(tracing: object, i: int) -> None:
    """A decode worker's tracing work for one request (none when off)."""
    if tracing is None:
        return
    trace = tracing.request_trace(HEADERS)  # type: ignore[attr-defined]
    stamps = RequestStamps()
    for stage in (Stage.pages_reserved, Stage.kv_received, Stage.first_token):
        stamps.mark(stage)
    outcome = RequestOutcome(time.monotonic_ns(), i + 1, f"req-{i:032x}", 16, 4)
    tracing.submit(trace, plan_worker_spans("decode", stamps, outcome))  # type: ignore[attr-defined]


def per_request_us(fn: object, n: int) -> float:
    """CPU µs per call of the calling thread alone: the builder and exporter threads run
    meanwhile (as in a server) but their CPU is not the request's."""
    t0 = time.thread_time()
    for i in range(n):
        fn(i)  # type: ignore[operator]
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, otlp_receiver(Path(tmp)) as receiver:
        tracing = start_tracing(TracingSpec(enabled=True, endpoint=receiver.endpoint), "bench", {})
        metrics = RouterMetrics(list)
        results: dict[str, list[float]] = {k: [] for k in ("router off", "router on", "worker on")}
        batch = args.requests // args.rounds
        for _ in range(args.rounds):
            results["router off"].append(
                per_request_us(lambda i: router_request(None, metrics, i), batch)
            )
            results["router on"].append(
                per_request_us(lambda i: router_request(tracing, metrics, i), batch)
            )
            results["worker on"].append(per_request_us(lambda i: worker_request(tracing, i), batch))
        assert tracing is not None
        t0 = time.perf_counter()
        tracing.shutdown()  # builds and exports everything still queued
        background = time.perf_counter() - t0
        received = len(receiver.read())
    off, on, worker = (statistics.median(results[k]) for k in results)
    print(f"router, tracing off: {off:8.1f} us/request")
    print(f"router, tracing on:  {on:8.1f} us/request  (+{on - off:.1f} us on the request's path)")
    print(f"worker, tracing on:  {worker:8.1f} us/request  (off: no call at all)")
    print(f"background build + export after the loop: {background:.1f} s (wall)")
    print(f"spans the collector received: {received} (dropped requests: {tracing.num_dropped})")


if __name__ == "__main__":
    main()

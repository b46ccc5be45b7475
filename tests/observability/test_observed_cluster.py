"""A local PD cluster watched by a real Prometheus and a real OTLP receiver.

One scenario, run once for the module: `pdcluster up` with tracing and
JSON logs on, the OpenTelemetry Collector (`e2e/otelcol`) receiving spans,
Debian's Prometheus scraping the router and both workers every second with
the chart's alerting rules loaded. Traffic (plain, streamed, a shared
prompt for the prefix cache, one request carrying a client `traceparent`),
and one fault: one of the prefill engine's first steps hangs for 4 s, so the
request in it outlives decode's 3 s `waitingTimeoutSeconds` and fails.

Then: every dashboard panel that reads the router or the workers returns
data; every metric the panels name is one the processes expose; the rules
evaluate without error against the real series; the client's trace has the
span tree of docs/operations.md, and the failed request's trace carries its
failure reason; the JSON log lines about the failed request name its room,
rid, role, instance and trace id.

With `PDCLUSTER_DASHBOARD_PNG_DIR=<dir>` the panels' query results are also
plotted there (docs/images/dashboard-*.png).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.otelcol.receiver import ReceivedSpans, Span, format_trace_tree, otlp_receiver
from e2e.prometheus_server import PrometheusApi, finite_points, prometheus_server
from pdcluster.operator.observability.generate import RULES_FILE
from pdcluster.operator.observability.panels import DASHBOARDS, Panel, Source, all_panels
from tests.local.cluster import RunningCluster, local_cluster, write_manifest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
HANG_STEP = 5  # counted from the warm-up request's step
HANG_SECONDS = 6
SHARED_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def cluster_spec(otlp_endpoint: str) -> dict[str, Any]:
    return {
        "model": {"name": "tiny"},
        "kvCache": {"pageSize": 16, "dtype": "float32", "numPages": 512},
        "transfer": {
            "backend": "tcp",
            "waitingTimeoutSeconds": 3,
            "waitingPerTokenMilliseconds": 0,
        },
        "prefill": {"replicas": 1, "engine": {"prefixCache": True}},
        "decode": {"replicas": 1, "engine": {"prefixCache": True}},
        "observability": {
            "tracing": {"enabled": True, "endpoint": otlp_endpoint},
            "logFormat": "json",
            "slo": {"ttftP90Seconds": 2},
        },
    }


@dataclass
class Observed:
    cluster: RunningCluster
    prometheus: PrometheusApi
    spans: ReceivedSpans
    started: float
    ended: float
    answers: list[tuple[int, str]]  # (status, x-request-id) per request, in order

    @property
    def failed_rid(self) -> str:
        """The request the hung engine step failed."""
        return next(rid for status, rid in self.answers if status == 502)

    def range_of(self, expr: str) -> list[dict[str, Any]]:
        span = self.ended - self.started
        expr = (
            expr.replace("$__rate_interval", "10s")
            .replace("$__range", f"{int(span) + 1}s")
            .replace("$pdcluster", ".*")
        )
        return self.prometheus.query_range(expr, self.started, self.ended, 2)


def _host_port(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def _send(client: httpx.Client, i: int, headers: dict[str, str]) -> tuple[int, str]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": SHARED_PROMPT if i % 2 == 0 else f"request {i}: tell me something",
        "max_tokens": 8,
        "stream": i % 3 == 1,
    }
    resp = client.post("/v1/completions", json=body, headers=headers)
    resp.read()
    return resp.status_code, resp.headers.get("x-request-id", "")


def _traffic(endpoint: str) -> list[tuple[int, str]]:
    answers = []
    base = endpoint.rsplit("/v1", 1)[0]
    with httpx.Client(base_url=base, timeout=60, trust_env=False) as client:
        _send(client, 1, {})  # warm-up: a cold first request is no fault of ours
        for i in range(8):  # one at a time: the engine's steps are counted
            headers = {}
            if i == 0:
                headers["traceparent"] = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            answers.append(_send(client, i, headers))
        with ThreadPoolExecutor(4) as pool:  # then a burst: queues and legs in flight
            answers += list(pool.map(lambda i: _send(client, i, {}), range(8, 20)))
    return answers


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observed")
    with otlp_receiver(tmp / "otel") as spans, pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDCLUSTER_TEST_HANG_STEP", f"prefill:{HANG_STEP}:{HANG_SECONDS}")
        manifest = write_manifest(tmp, "observed", cluster_spec(spans.endpoint))
        state_dir = tmp / "state"
        state_dir.mkdir()
        with local_cluster(manifest, state_dir) as cluster:
            mp.delenv("PDCLUSTER_TEST_HANG_STEP")
            hosts = [_host_port(p["url"]) for p in cluster.state["processes"]]
            with prometheus_server({"pdcluster": hosts}, tmp / "prom", [ROOT / RULES_FILE]) as prom:
                started = time.time()
                time.sleep(3)  # a few scrapes before the traffic
                answers = _traffic(cluster.endpoint)
                time.sleep(12)  # the rates' windows cover the traffic
                observed = Observed(cluster, prom, spans, started, time.time(), answers)
                png_dir = os.environ.get("PDCLUSTER_DASHBOARD_PNG_DIR")
                if png_dir:
                    from e2e.dashboard_plot import plot_dashboards

                    plot_dashboards(
                        observed.range_of, Path(png_dir), {Source.router, Source.worker}
                    )
                yield observed


def _local_panels() -> list[tuple[str, Panel]]:
    return [(uid, p) for uid, p in all_panels() if p.source is not Source.operator]


def test_the_fault_failed_one_request_and_the_rest_were_served(observed: Observed) -> None:
    sequential = [status for status, _ in observed.answers[:8]]
    assert sorted(sequential) == [200] * 7 + [502], sequential
    assert [status for status, _ in observed.answers[8:]] == [200] * 12


@pytest.mark.parametrize(
    ("uid", "panel"), _local_panels(), ids=[f"{u}:{p.title}" for u, p in _local_panels()]
)
def test_every_router_and_worker_panel_returns_data(
    observed: Observed, uid: str, panel: Panel
) -> None:
    for query in panel.queries:
        result = observed.range_of(query.expr)
        assert finite_points(result) > 0, f"{DASHBOARDS[uid][0]} / {panel.title}: {query.expr}"


def _exposed_names(urls: list[str]) -> set[str]:
    names: set[str] = set()
    for url in urls:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=10, trust_env=False).text
        names |= {line.split("{")[0].split()[0] for line in text.splitlines() if line[:1] != "#"}
    return names


def test_every_metric_a_panel_reads_is_one_the_processes_expose(observed: Observed) -> None:
    exposed = _exposed_names([p["url"] for p in observed.cluster.state["processes"]])
    named = {
        name
        for _, panel in _local_panels()
        for query in panel.queries
        for name in re.findall(r"\b(pdcluster_[a-z0-9_]+)\b", query.expr)
    }
    named -= {"pdcluster_instance"}  # a label of pdcluster_worker_info, not a metric
    assert named and named <= exposed, sorted(named - exposed)


def test_the_alert_rules_evaluate_against_the_real_series(observed: Observed) -> None:
    rules = observed.prometheus.rules()
    assert len(rules) == 7
    assert {r["name"]: r["health"] for r in rules} == {r["name"]: "ok" for r in rules}
    firing = {r["name"] for r in rules if r.get("state") == "firing"}
    assert "PDClusterRoleUnavailable" not in firing and "PDClusterScrapeGap" not in firing


def _trace(spans: ReceivedSpans, trace_id: str, names: set[str]) -> dict[str, Span]:
    deadline = time.monotonic() + 20
    while True:
        found = {s.name: s for s in spans.read() if s.trace_id == trace_id}
        if names <= found.keys() or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


ROUTER_SPANS = {"router.request", "router.plan", "router.prefill_leg", "router.decode_leg"}
PREFILL_SPANS = {"prefill.request", "prefill.compute", "kv.transfer"}
DECODE_SPANS = {"decode.request", "decode.wait_kv", "decode.first_token", "decode.stream"}


def test_one_request_is_one_trace_across_router_prefill_and_decode(observed: Observed) -> None:
    wanted = ROUTER_SPANS | PREFILL_SPANS | DECODE_SPANS
    spans = _trace(observed.spans, CLIENT_TRACE, wanted)
    tree = format_trace_tree(list(spans.values()))
    assert wanted <= spans.keys(), f"missing {sorted(wanted - spans.keys())} in\n{tree}"
    parent = {name: spans[name].parent_id for name in wanted}
    ids = {name: spans[name].span_id for name in wanted}
    assert parent["router.request"] == CLIENT_SPAN  # the client's traceparent honoured
    for child in ("router.plan", "router.prefill_leg", "router.decode_leg"):
        assert parent[child] == ids["router.request"]
    assert parent["prefill.request"] == ids["router.prefill_leg"]
    assert parent["decode.request"] == ids["router.decode_leg"]
    for child in PREFILL_SPANS - {"prefill.request"}:
        assert parent[child] == ids["prefill.request"]
    for child in DECODE_SPANS - {"decode.request"}:
        assert parent[child] == ids["decode.request"]
    _, rid = observed.answers[0]
    room = spans["prefill.request"].attributes["pdcluster.room"]
    for name in wanted - {"router.plan"}:
        assert spans[name].attributes["pdcluster.rid"] == rid, name
        assert spans[name].attributes["pdcluster.room"] == room, name
    transfer = spans["kv.transfer"].attributes
    assert transfer["pdcluster.kv.backend"] == "tcp" and transfer["pdcluster.kv.bytes"] > 0
    assert {s.service for s in spans.values()} == {
        "pdcluster-router",
        "pdcluster-prefill",
        "pdcluster-decode",
    }
    assert not any(s.is_error for s in spans.values())


def test_a_failed_rooms_trace_carries_the_failure_reason(observed: Observed) -> None:
    rid = observed.failed_rid
    deadline = time.monotonic() + 20
    while True:
        decode = [
            s
            for s in observed.spans.read()
            if s.name == "decode.request" and s.attributes.get("pdcluster.rid") == rid
        ]
        if decode or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert decode, f"no decode.request span for {rid}"
    spans = _trace(observed.spans, decode[0].trace_id, {"router.request", "decode.wait_kv"})
    reason = str(spans["decode.request"].attributes.get("pdcluster.failure_reason", ""))
    # Whichever deadline fires first: decode's wait for KV, or prefill's own transfer
    # phase (decode then hears prefill's Failed status); both bound the hung step.
    assert spans["decode.request"].is_error, reason
    assert re.search(r"\b(waiting_timeout|transfer_timeout)\b", reason), reason
    assert spans["decode.wait_kv"].status_message == reason  # the stage it failed in
    assert spans["router.request"].is_error
    assert spans["router.request"].attributes["pdcluster.failure_reason"]


def test_json_log_lines_about_a_request_name_its_room_rid_role_instance_and_trace(
    observed: Observed,
) -> None:
    rid = observed.failed_rid
    logs = observed.cluster.state_dir / observed.cluster.state["cluster"] / "logs"
    lines = [
        json.loads(line)
        for line in (logs / "decode-0.log").read_text().splitlines()
        if line.startswith("{")
    ]
    about = [doc for doc in lines if doc.get("rid") == rid]
    assert about, f"no JSON line names {rid}"
    trace_ids = {
        s.trace_id for s in observed.spans.read() if s.attributes.get("pdcluster.rid") == rid
    }
    for doc in about:
        assert doc["role"] == "decode" and doc["instance"] == "decode-0"
        assert isinstance(doc["room"], int)
        assert doc["trace_id"] in trace_ids

"""Prefill's TTFT target read from the router's own /metrics: real router metrics
text in, the interval step's decision and status.prefill.autoscaling out."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

from pdcluster.operator.api import PDClusterStatus, RoleStatus
from pdcluster.operator.autoscale.router_metrics import (
    as_prefill_scrape,
    is_read_from_router,
    router_scrape_targets,
    with_router_hold_notes,
)
from pdcluster.operator.autoscale.step import (
    FIRST_INTERVAL,
    AutoscaleHistory,
    AutoscaleStep,
    PodScrape,
    compute_autoscale_step,
)
from pdcluster.operator.autoscale.wiring import status_patch
from pdcluster.runtime.autoscale.samples import parse_worker_metrics
from pdcluster.runtime.router.metrics import LATENCY_BUCKETS, RouterMetrics
from pdcluster.runtime.router.workers import Worker
from pdcluster.runtime.spec import Role

from .helpers import make_cluster

P, D = Role.prefill, Role.decode
INTERVAL = 15.0


def spec(metric: str = "ttftP90Seconds", target: float = 0.5) -> dict[str, Any]:
    auto = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "intervalSeconds": INTERVAL,
        "target": {"metric": metric, "value": target},
        "scaleUp": {"stabilizationSeconds": 0},
    }
    return {"prefill": {"replicas": 1, "autoscaling": auto}, "decode": {"replicas": 1}}


class Router:
    """One router replica: its real metrics registry and the legs it has in flight."""

    def __init__(self) -> None:
        self.prefill = Worker(url="http://10.0.0.1:8000", role=P)
        self.decode = Worker(url="http://10.0.0.2:8000", role=D)
        self.metrics = RouterMetrics(lambda: [self.prefill, self.decode])

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


def step(
    routers: dict[str, Router | str], history: AutoscaleHistory, now: float, **kw: Any
) -> AutoscaleStep:
    cluster = make_cluster(kw.get("spec_", spec()))
    status = PDClusterStatus(prefill=RoleStatus(desired=1, ready=1), decode=RoleStatus(ready=1))
    scrapes = {
        P: {
            name: PodScrape(as_prefill_scrape(r if isinstance(r, str) else r.text()), now)
            for name, r in routers.items()
        }
    }
    return compute_autoscale_step(cluster, status, scrapes, history, now)


def test_the_router_body_reads_as_the_series_the_step_uses() -> None:
    router = Router()
    for seconds in (0.02, 0.2, 2.0):
        router.metrics.time_to_first_token.observe(seconds)
    router.prefill.outstanding, router.decode.outstanding = 2, 5
    scrape = parse_worker_metrics(as_prefill_scrape(router.text()))
    assert scrape.ttft is not None
    assert scrape.ttft.bounds == (*map(float, LATENCY_BUCKETS), float("inf"))
    assert scrape.ttft.count == 3
    assert scrape.ttft.counts[LATENCY_BUCKETS.index(0.025)] == 1
    # Requests waiting for their first token: the prefill legs, not the decode's.
    assert scrape.gauge("pdcluster_requests_in_flight") == 2
    assert scrape.tpot is None


def test_two_router_replicas_add_up_and_the_p90_drives_prefill_up() -> None:
    a, b = Router(), Router()
    first = step({"router-a": a, "router-b": b}, AutoscaleHistory(), 0.0)
    assert first.statuses[P] is not None and first.statuses[P].reason == FIRST_INTERVAL
    for _ in range(9):
        a.metrics.time_to_first_token.observe(0.03)
    for _ in range(11):
        b.metrics.time_to_first_token.observe(4.0)  # b's requests are the slow ones
    up = step({"router-a": a, "router-b": b}, first.history, INTERVAL)
    decided = up.statuses[P]
    assert decided is not None and decided.reason == "ScaleUp"
    # 20 requests, 11 of them in (2.5, 5]: the p90 lies in that bucket.
    assert decided.last_value is not None and 2.5 < decided.last_value <= 5.0
    assert [(p.role, p.replicas) for p in up.patches] == [(P, 2)]
    (event,) = up.events
    assert event.reason == "ScaledUp" and "ttftP90Seconds" in event.message


def test_an_idle_router_reads_zero_and_a_stuck_one_is_no_sample() -> None:
    router = Router()
    history = step({"router-0": router}, AutoscaleHistory(), 0.0).history
    idle = step({"router-0": router}, history, INTERVAL)
    decided = idle.statuses[P]
    assert decided is not None and decided.last_value == 0.0  # at minReplicas: held there
    assert not idle.patches and not idle.events
    router.prefill.outstanding = 1  # a request waits for its first token, none finished
    stuck = step({"router-0": router}, history, INTERVAL)
    assert stuck.statuses[P] is not None and stuck.statuses[P].reason == "MetricMissing"
    (event,) = stuck.events
    assert (event.type, event.reason) == ("Warning", "MetricMissing")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        # A router that predates the histogram: no sample, the planner holds.
        ("# TYPE pdcluster_router_requests_total counter\npdcluster_router_requests_total 3\n", ""),
        # Not metrics text: passed on as is, and named.
        ("<html>502 Bad Gateway</html>\n", "unreadable /metrics: router-0"),
    ],
    ids=["no-histogram", "not-prometheus"],
)
def test_a_router_body_without_the_histogram_holds_with_a_warning(body: str, reason: str) -> None:
    history = step({"router-0": body}, AutoscaleHistory(), 0.0).history
    held = step({"router-0": body}, history, INTERVAL)
    status = held.statuses[P]
    assert status is not None and status.reason == "MetricMissing" and not held.patches
    (event,) = held.events
    assert (event.type, event.reason) == ("Warning", "MetricMissing")
    assert reason in event.message


def test_no_router_pod_answering_holds_with_a_warning_that_says_so() -> None:
    history = step({"router-0": Router()}, AutoscaleHistory(), 0.0).history
    held = with_router_hold_notes(make_cluster(spec()), step({}, history, INTERVAL), {P: 0})
    status = held.statuses[P]
    note = "; read from the router's /metrics: 0 router pod(s) answered"
    assert status is not None and status.reason == "MetricMissing"
    assert status.message.endswith(note)
    (event,) = held.events
    assert (event.type, event.reason) == ("Warning", "MetricMissing")
    assert event.message.startswith("prefill: no ttftP90Seconds sample: holding")
    assert event.message.endswith(note)


def test_only_a_hold_of_a_role_read_from_the_router_gets_the_note() -> None:
    router = Router()
    first = step({"router-0": router}, AutoscaleHistory(), 0.0)
    router.metrics.time_to_first_token.observe(4.0)
    up = step({"router-0": router}, first.history, INTERVAL)
    for decided in (first, up):  # FirstInterval, ScaleUp: no hold
        assert with_router_hold_notes(make_cluster(spec()), decided, {P: 1}) == decided
    queued = spec("queuedPrefillTokensPerInstance", 100)
    cluster = make_cluster(queued)
    status = PDClusterStatus(prefill=RoleStatus(desired=1, ready=1), decode=RoleStatus(ready=1))
    held = compute_autoscale_step(cluster, status, {}, AutoscaleHistory(), 0.0)
    assert held.statuses[P] is not None and held.statuses[P].reason == "MetricMissing"
    assert with_router_hold_notes(cluster, held, {P: 0}) == held  # the workers' metric


@pytest.mark.parametrize(
    ("role", "metric", "expected"),
    [
        (P, "ttftP90Seconds", True),
        (P, "queuedPrefillTokensPerInstance", False),
        (D, "tpotP90Seconds", False),
    ],
)
def test_only_prefill_ttft_is_read_from_the_router(role: Role, metric: str, expected: bool) -> None:
    manifest = spec(metric)
    if role is D:
        manifest = {"prefill": {"replicas": 1}, "decode": {**manifest["prefill"]}}
    assert is_read_from_router(make_cluster(manifest), role) is expected
    assert not is_read_from_router(make_cluster(manifest), D if role is P else P)


def test_a_colocated_cluster_reads_nothing_from_the_router() -> None:
    assert not is_read_from_router(make_cluster({"colocated": {"replicas": 1}}), P)


def router_pod(name: str, ip: str | None = "10.1.0.9", ready: bool = True, **meta: Any) -> Any:
    return {
        "metadata": {
            "name": name,
            "labels": {"pdcluster.io/cluster": "demo", "pdcluster.io/role": "router"},
            **meta,
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_the_router_targets_are_its_ready_pods_by_ip() -> None:
    other = router_pod("other-router-1")
    other["metadata"]["labels"]["pdcluster.io/cluster"] = "other"
    worker = router_pod("demo-prefill-0")
    worker["metadata"]["labels"]["pdcluster.io/role"] = "prefill"
    pods = [
        router_pod("demo-router-a"),
        router_pod("demo-router-b", ready=False),
        router_pod("demo-router-c", ip=None),
        router_pod("demo-router-d", deletionTimestamp="2026-01-01T00:00:00Z"),
        other,
        worker,
        {"metadata": None},
    ]
    assert router_scrape_targets(pods, "demo") == {"demo-router-a": "http://10.1.0.9:8000/metrics"}


def test_the_status_says_where_the_metric_was_read() -> None:
    router = Router()
    first = step({"router-0": router}, AutoscaleHistory(), 0.0)
    wire = status_patch(make_cluster(spec()), first)["status"]["prefill"]["autoscaling"]
    assert wire["source"] == "router" and wire["reason"] == FIRST_INTERVAL
    assert wire["recommendations"] == [{"time": "1970-01-01T00:00:00.000Z", "replicas": 1}]
    decode_spec = {"prefill": {"replicas": 1}, "decode": {**spec("tpotP90Seconds")["prefill"]}}
    cluster = make_cluster(decode_spec)
    status = PDClusterStatus(prefill=RoleStatus(ready=1), decode=RoleStatus(desired=1, ready=1))
    decided = compute_autoscale_step(cluster, status, {}, AutoscaleHistory(), 0.0)
    assert status_patch(cluster, decided)["status"]["decode"]["autoscaling"]["source"] == "workers"

"""The operator's part of observability: defaults it fills in, pods' log format, its metrics."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.operator.api import PDClusterStatus, RoleStatus, format_time
from pdcluster.operator.builders import build_instance, build_router_deployment
from pdcluster.operator.metrics import OperatorMetrics
from pdcluster.operator.reconcile.cluster import with_operator_defaults
from pdcluster.operator.settings import OperatorSettings
from pdcluster.runtime.spec import Role

from .helpers import PD, make_cluster

COLLECTOR = "http://otel.monitoring:4318"


def tracing(**fields: Any) -> dict[str, Any]:
    return {**PD, "observability": {"tracing": fields}}


def test_a_cluster_tracing_without_an_endpoint_gets_the_chart_s_collector() -> None:
    cluster = with_operator_defaults(make_cluster(tracing(enabled=True)), COLLECTOR)
    assert cluster.spec.observability.tracing.endpoint == COLLECTOR


@pytest.mark.parametrize(
    ("spec", "default"),
    [
        (tracing(enabled=False), COLLECTOR),  # tracing off: nothing to fill
        (tracing(enabled=True, endpoint="http://mine:4318"), COLLECTOR),  # its own wins
        (tracing(enabled=True), ""),  # no chart default
    ],
)
def test_otherwise_the_cluster_is_left_as_written(spec: dict[str, Any], default: str) -> None:
    cluster = make_cluster(spec)
    assert with_operator_defaults(cluster, default) is cluster


def test_the_operator_reads_its_collector_from_the_environment_and_checks_it() -> None:
    env = {"PDCLUSTER_OPERATOR_OTLP_ENDPOINT": COLLECTOR}
    assert OperatorSettings.from_env(env).otlp_endpoint == COLLECTOR
    with pytest.raises(ValueError, match="PDCLUSTER_OPERATOR_OTLP_ENDPOINT: must be an http"):
        OperatorSettings.from_env({"PDCLUSTER_OPERATOR_OTLP_ENDPOINT": "otel:4318"})


def env_of(container_owner: dict[str, Any]) -> dict[str, str]:
    spec = container_owner["spec"]
    pod = spec["template"]["spec"] if "template" in spec else spec
    return {e["name"]: e.get("value", "") for e in pod["containers"][0]["env"]}


@pytest.mark.parametrize(
    ("stated", "expected"), [(None, "json"), ("text", "text"), ("json", "json")]
)
def test_pods_log_json_unless_the_manifest_says_text(stated: str | None, expected: str) -> None:
    spec: dict[str, Any] = dict(PD)
    if stated is not None:
        spec["observability"] = {"logFormat": stated}
    cluster = make_cluster(spec)
    (pod, *_) = build_instance(cluster, Role.decode, 0).pods
    assert env_of(pod)["PDCLUSTER_LOG_FORMAT"] == expected
    assert env_of(build_router_deployment(cluster))["PDCLUSTER_LOG_FORMAT"] == expected


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_status_becomes_replicas_and_restart_budget_use_per_role() -> None:
    spec = {"prefill": {"replicas": 2, "restart": {"budget": 4}}, "decode": {}}
    cluster = make_cluster(spec)
    now = 10_000.0
    status = PDClusterStatus(
        prefill=RoleStatus(
            desired=2, ready=1, restarts_in_window=3, budget_window_start=format_time(now - 60)
        ),
        decode=RoleStatus(desired=1, ready=1),
    )
    metrics = OperatorMetrics()
    metrics.observe_status(cluster, status, now)
    labels = {"namespace": cluster.namespace, "pdcluster": cluster.name}
    replicas = "pdcluster_operator_role_replicas"
    assert sample(metrics, replicas, **labels, role="prefill", state="desired") == 2
    assert sample(metrics, replicas, **labels, role="prefill", state="ready") == 1
    used = "pdcluster_operator_restart_budget_used_ratio"
    assert sample(metrics, used, **labels, role="prefill") == 0.75
    assert sample(metrics, used, **labels, role="decode") == 0
    # An hour later the window has closed: nothing is used.
    metrics.observe_status(cluster, status, now + 3600)
    assert sample(metrics, used, **labels, role="prefill") == 0
    metrics.forget_cluster(cluster.namespace, cluster.name)
    assert sample(metrics, used, **labels, role="prefill") is None

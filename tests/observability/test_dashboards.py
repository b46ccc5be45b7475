"""The dashboards: generated from the panel tables, well formed, shipped by the chart.

Whether each panel's queries return data is asserted against a real
Prometheus (test_observed_cluster.py for the router and the workers,
e2e/test_operator.py for the operator).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from pdcluster.operator.observability.dashboards import build_dashboard
from pdcluster.operator.observability.panels import DASHBOARDS, Source, all_panels
from tests.operator.helpers import need
from tests.operator.test_chart import CHART, HELM, needs_helm, values_schema


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_a_dashboard_lays_its_panels_out_without_overlap(uid: str) -> None:
    board = build_dashboard(uid)
    panels = board["panels"]
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    cells = set()
    for p in panels:
        g = p["gridPos"]
        cell = (g["x"], g["y"])
        assert cell not in cells and g["x"] + g["w"] <= 24
        cells.add(cell)
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables.keys() == {"datasource", "pdcluster"}
    assert board["uid"] == uid and "pdcluster" in board["tags"]


def test_the_issue_s_four_dashboards_cover_their_subjects() -> None:
    titles = {uid: {p.title for p in panels} for uid, (_, panels) in DASHBOARDS.items()}
    assert set(titles) == {
        "pdcluster-overview",
        "pdcluster-pd",
        "pdcluster-capacity",
        "pdcluster-operator",
    }
    assert "Time to first token (router)" in titles["pdcluster-overview"]
    assert "Negotiated KV transport" in titles["pdcluster-pd"]
    assert "Autoscaler decisions" in titles["pdcluster-capacity"]
    assert "Events by reason" in titles["pdcluster-operator"]


def test_every_panel_filters_by_cluster_unless_it_reads_the_operator() -> None:
    for _, panel in all_panels():
        for query in panel.queries:
            if panel.source is not Source.operator:
                assert '$pdcluster"' in query.expr, (panel.title, query.expr)


def render(*sets: str) -> list[dict[str, Any]]:
    assert HELM is not None
    args = [HELM, "template", "t", str(CHART), *(f"--set={s}" for s in sets)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@needs_helm
def test_the_chart_ships_each_dashboard_as_a_configmap_grafana_s_sidecar_loads() -> None:
    maps = [
        d for d in render() if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    ]
    assert len(maps) == len(DASHBOARDS)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == build_dashboard(name.removesuffix(".json"))
    moved = render(
        "dashboards.namespace=grafana", "dashboards.label=dash", "dashboards.labelValue=on"
    )
    maps = [d for d in moved if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert {m["metadata"]["namespace"] for m in maps} == {"grafana"}
    assert all(m["metadata"]["labels"]["dash"] == "on" for m in maps)
    off = render("dashboards.enabled=false")
    assert not [d for d in off if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]


@needs_helm
def test_the_chart_ships_the_rules_as_a_prometheus_rule_when_asked() -> None:
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]
    (rule,) = [
        d
        for d in render("prometheusRule.enabled=true", "prometheusRule.labels.release=kps")
        if d["kind"] == "PrometheusRule"
    ]
    assert rule["metadata"]["labels"]["release"] == "kps"
    rules_file = yaml.safe_load((CHART / "rules" / "pdcluster.rules.yaml").read_text())
    assert rule["spec"] == rules_file


@needs_helm
def test_the_chart_s_tracing_endpoint_reaches_the_operator() -> None:
    (deployment,) = [
        d
        for d in render("tracing.endpoint=http://otel.monitoring:4318")
        if d["kind"] == "Deployment"
    ]
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PDCLUSTER_OPERATOR_OTLP_ENDPOINT"] == "http://otel.monitoring:4318"
    (plain,) = [d for d in render() if d["kind"] == "Deployment"]
    names = {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "PDCLUSTER_OPERATOR_OTLP_ENDPOINT" not in names


@pytest.mark.parametrize(
    "patch",
    [
        {"tracing": {"endpoint": "otel:4318"}},
        {"dashboards": {"label": "not a label"}},
        {"prometheusRule": {"enabled": "yes"}},
    ],
)
def test_the_values_schema_refuses_bad_observability_values(patch: dict[str, Any]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in patch.items():
        values[key] = {**values[key], **value}
    validator = need("jsonschema").Draft7Validator(values_schema())
    assert list(validator.iter_errors(values))

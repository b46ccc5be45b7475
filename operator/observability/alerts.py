"""The PDCluster alerting rules, as a Prometheus rule file.

Each alert names the PDCluster (and the role or instance) it is about,
links its runbook (docs/operations.md, "Alerts"), and reads only metrics
our processes export. The chart ships the file as a `PrometheusRule`;
`promtool check rules` and `promtool test rules` (tests/observability)
check it, with a firing and a quiet case for every alert.

| alert | fires when |
| --- | --- |
| `PDClusterRoleUnavailable` | a router has no ready prefill, decode (or colocated) worker for 1 m |
| `PDClusterTTFTOverSLO` | a router's p90 time to first token exceeds its cluster's SLO for 10 m |
| `PDClusterRoomsFailing` | over 5 % of a role's requests fail their room for 5 m |
| `PDClusterKVTransportFallback` | RDMA / GPU-direct asked for, UCX negotiated only TCP, 5 m |
| `PDClusterEngineStalled` | a worker's engine made no step with work pending, 1 m |
| `PDClusterRestartBudgetNearlySpent` | a role used 80 % of its hourly restart budget |
| `PDClusterScrapeGap` | a router, worker or operator target stopped answering scrapes for 2 m |

Pure module.
"""

from __future__ import annotations

from typing import Any

import yaml

# Relative to the repository (docs/operations.md, "Alerts"), one anchor per alert.
RUNBOOK = "docs/operations.md#alert-{}"
GROUP = "pdcluster"
# The labels a worker's or a router's series get from their info series.
WORKER_JOIN = (
    "* on(instance, job) group_left(pdcluster, role, pdcluster_instance) pdcluster_worker_info"
)
ROUTER_JOIN = "* on(instance, job) group_left(pdcluster) pdcluster_router_info"
# Client-visible error classes and `recomputed` count beside a room's own reason.
NOT_ROOM_REASONS = 'reason!~"recomputed|kv_transfer_failed|prefill_failed"'


def _alert(
    name: str, expr: str, for_: str, severity: str, summary: str, description: str
) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": RUNBOOK.format(name.lower()),
    }
    return rule


def build_rules() -> list[dict[str, Any]]:
    return [
        _alert(
            "PDClusterRoleUnavailable",
            f"max by (pdcluster, role) (pdcluster_router_ready_workers {ROUTER_JOIN}) == 0",
            "1m",
            "critical",
            "{{ $labels.pdcluster }}: no ready {{ $labels.role }} worker",
            "The router of PDCluster {{ $labels.pdcluster }} has had no ready "
            "{{ $labels.role }} worker for a minute: every request fails with 503.",
        ),
        _alert(
            "PDClusterTTFTOverSLO",
            "histogram_quantile(0.9, sum by (instance, job, le) "
            "(rate(pdcluster_router_time_to_first_token_seconds_bucket[5m])))\n"
            "> on(instance, job) group_left(pdcluster)\n"
            f"(pdcluster_router_slo_ttft_p90_seconds {ROUTER_JOIN})",
            "10m",
            "warning",
            "{{ $labels.pdcluster }}: p90 time to first token over its SLO",
            "The p90 time to first token seen by router {{ $labels.instance }} is "
            "{{ $value | humanizeDuration }}, over the SLO the manifest states "
            "(spec.observability.slo.ttftP90Seconds).",
        ),
        _alert(
            "PDClusterRoomsFailing",
            f"sum by (pdcluster, role) (rate(pdcluster_failures_total{{{NOT_ROOM_REASONS}}}[5m]) "
            f"{WORKER_JOIN})\n/ sum by (pdcluster, role) "
            f"(rate(pdcluster_requests_total[5m]) {WORKER_JOIN})\n> 0.05",
            "5m",
            "warning",
            "{{ $labels.pdcluster }}: {{ $labels.role }} rooms failing",
            "{{ $value | humanizePercentage }} of the {{ $labels.role }} requests of "
            "{{ $labels.pdcluster }} failed their room over 5 minutes; "
            "pdcluster_failures_total says why.",
        ),
        _alert(
            "PDClusterKVTransportFallback",
            "max by (pdcluster, role, pdcluster_instance) "
            f"(pdcluster_kv_rdma_missing {WORKER_JOIN}) == 1",
            "5m",
            "warning",
            "{{ $labels.pdcluster }}: KV moves over TCP although RDMA was asked for",
            "{{ $labels.pdcluster_instance }} asks for RDMA or GPU-direct "
            "(spec.transfer.ucx) but UCX negotiated only TCP lanes.",
        ),
        _alert(
            "PDClusterEngineStalled",
            "max by (pdcluster, role, pdcluster_instance) "
            f"(pdcluster_engine_stalled {WORKER_JOIN}) == 1",
            "1m",
            "critical",
            "{{ $labels.pdcluster }}: engine of {{ $labels.pdcluster_instance }} stalled",
            "{{ $labels.pdcluster_instance }} has had work pending and no engine step "
            "finished for a minute past its stall timeout; its liveness probe restarts it.",
        ),
        _alert(
            "PDClusterRestartBudgetNearlySpent",
            "max by (namespace, pdcluster, role) (pdcluster_operator_restart_budget_used_ratio)"
            " >= 0.8",
            "",
            "warning",
            "{{ $labels.namespace }}/{{ $labels.pdcluster }}: {{ $labels.role }} restart "
            "budget nearly spent",
            "{{ $labels.role }} used {{ $value | humanizePercentage }} of its hourly restart "
            "budget (spec.<role>.restart.budget); once spent, broken instances stay down.",
        ),
        _alert(
            "PDClusterScrapeGap",
            "up == 0 and on(instance, job) (\n"
            "  group by (instance, job) (last_over_time(pdcluster_worker_info[10m]))\n"
            "  or group by (instance, job) (last_over_time(pdcluster_router_info[10m]))\n"
            "  or group by (instance, job) "
            "(last_over_time(pdcluster_operator_reconciles_total[10m]))\n)",
            "2m",
            "warning",
            "{{ $labels.instance }} stopped answering scrapes",
            "The PDCluster target {{ $labels.instance }} ({{ $labels.job }}) has failed "
            "every scrape for 2 minutes: its dashboards and alerts are blind.",
        ),
    ]


def build_rule_file() -> dict[str, Any]:
    return {"groups": [{"name": GROUP, "rules": build_rules()}]}


class _RuleDumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as a person writes a rule file."""


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_RuleDumper.add_representer(str, _text)


def render_rule_file() -> str:
    header = "# Generated by `make crds` from operator/observability/alerts.py.\n"
    return header + yaml.dump(build_rule_file(), Dumper=_RuleDumper, sort_keys=False, width=100)

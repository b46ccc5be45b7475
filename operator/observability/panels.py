"""The panels of the PDCluster dashboards: title, queries, and whose metrics they read.

One table per dashboard, each panel a few PromQL expressions over the
metrics our processes export (docs/operations.md, Metrics). Every
expression is written once here; `dashboards.py` turns the tables into
Grafana JSON, and the tests run each expression against a real Prometheus
scraping real processes (`Panel.source` says which: the router and the
workers of a local cluster, or the operator), so no panel reads a metric
nobody exports.

Selectors: a worker's series join `pdcluster_worker_info` (its cluster,
role and instance), a router's `pdcluster_router_info` (its cluster), on
the scrape target (`instance`, `job`). The `$pdcluster` variable filters
by cluster; `$__rate_interval` is Grafana's rate window.

Pure module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Source(enum.StrEnum):
    """Whose /metrics a panel reads."""

    router = "router"
    worker = "worker"
    operator = "operator"


class Unit(enum.StrEnum):
    """Grafana unit ids the panels use."""

    seconds = "s"
    bytes_per_second = "Bps"
    per_second = "reqps"
    ratio = "percentunit"
    number = "short"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    source: Source
    queries: tuple[Query, ...]
    unit: Unit = Unit.number
    description: str = ""
    stacked: bool = False


RATE = "$__rate_interval"
ROUTER = '* on(instance, job) group_left() pdcluster_router_info{pdcluster=~"$pdcluster"}'


def worker(role: str = ".+", labels: str = "") -> str:
    """Join a worker series with its cluster/role/instance labels (`labels`: to copy)."""
    return (
        f"* on(instance, job) group_left({labels}) "
        f'pdcluster_worker_info{{pdcluster=~"$pdcluster", role=~"{role}"}}'
    )


def quantiles(bucket_expr: str, by: str = "") -> tuple[Query, ...]:
    """p50, p90, p99 of a `rate(..._bucket)` expression (already joined)."""
    by_labels = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({by_labels}) ({bucket_expr}))",
            f"{legend}p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


OVERVIEW: tuple[Panel, ...] = (
    Panel(
        "Requests per second by HTTP status",
        Source.router,
        (
            Query(
                "sum by (code) (rate(pdcluster_router_requests_total"
                f'{{route=~"/v1/.*|/generate"}}[{RATE}]) {ROUTER})',
                "{{code}}",
            ),
        ),
        Unit.per_second,
        stacked=True,
    ),
    Panel(
        "Time to first token (router)",
        Source.router,
        quantiles(f"rate(pdcluster_router_time_to_first_token_seconds_bucket[{RATE}]) {ROUTER}"),
        Unit.seconds,
        "From the leg plan to the prefill leg's answer, which carries the first token",
    ),
    Panel(
        "Time per output token (decode)",
        Source.worker,
        quantiles(
            f"rate(pdcluster_time_per_output_token_seconds_bucket[{RATE}]) "
            f"{worker('decode|colocated')}"
        ),
        Unit.seconds,
    ),
    Panel(
        "End-to-end latency (router)",
        Source.router,
        quantiles(
            "rate(pdcluster_router_request_duration_seconds_bucket"
            f'{{route=~"/v1/.*|/generate"}}[{RATE}]) {ROUTER}'
        ),
        Unit.seconds,
        "From the request to the end of its response, streams included",
    ),
    Panel(
        "Tokens per second",
        Source.router,
        (
            Query(f"sum(rate(pdcluster_router_prompt_tokens_total[{RATE}]) {ROUTER})", "prompt"),
            Query(
                f"sum(rate(pdcluster_router_generation_tokens_total[{RATE}]) {ROUTER})",
                "generated",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Requests answered, by finish reason",
        Source.router,
        (
            Query(
                f"sum by (reason) (rate(pdcluster_router_request_success_total[{RATE}]) {ROUTER})",
                "{{reason}}",
            ),
        ),
        Unit.per_second,
        stacked=True,
    ),
    Panel(
        "Errors by reason (router)",
        Source.router,
        (
            Query(
                f"sum by (reason) (rate(pdcluster_router_request_failure_total[{RATE}]) {ROUTER})",
                "{{reason}}",
            ),
        ),
        Unit.per_second,
        "Requests that ended in an error or were abandoned (client gone, deadline)",
        stacked=True,
    ),
    Panel(
        "Errors by reason (workers)",
        Source.worker,
        (
            Query(
                f"sum by (role, reason) (rate(pdcluster_request_failure_total[{RATE}]) {worker()})",
                "{{role}} {{reason}}",
            ),
        ),
        Unit.per_second,
        stacked=True,
    ),
    Panel(
        "Ready workers per role",
        Source.router,
        (
            Query(
                f"max by (role) (pdcluster_router_ready_workers {ROUTER})",
                "{{role}}",
            ),
        ),
        Unit.number,
    ),
)

PD: tuple[Panel, ...] = (
    Panel(
        "Rooms by phase",
        Source.worker,
        (
            Query(
                f"sum by (role, state) (pdcluster_rooms {worker('prefill|decode', 'role')})",
                "{{role}} {{state}}",
            ),
        ),
        Unit.number,
        stacked=True,
    ),
    Panel(
        "KV bytes per second by backend",
        Source.worker,
        (
            Query(
                "sum by (backend, direction) "
                f"(rate(pdcluster_transfer_bytes_total[{RATE}]) "
                "* on(instance, job) group_left(backend) pdcluster_kv_transport_info "
                f"{worker('prefill|decode')})",
                "{{backend}} {{direction}}",
            ),
        ),
        Unit.bytes_per_second,
    ),
    Panel(
        "KV transfer seconds by backend",
        Source.worker,
        quantiles(
            f"rate(pdcluster_transfer_seconds_bucket[{RATE}]) "
            "* on(instance, job) group_left(backend) pdcluster_kv_transport_info "
            f"{worker('prefill|decode')}",
            "backend",
        ),
        Unit.seconds,
        "Metadata sent to transfer concluded (decode), room open to KV sent (prefill)",
    ),
    Panel(
        "Negotiated KV transport",
        Source.worker,
        (
            Query(
                "max by (role, backend, transports, tcp_fallback) "
                f"(pdcluster_kv_transport_info {worker('prefill|decode', 'role')})",
                "{{role}} {{backend}} [{{transports}}] tcp_fallback={{tcp_fallback}}",
            ),
        ),
        Unit.number,
        "1 per negotiated backend and UCX transport set; tcp_fallback=true: no RDMA lane",
    ),
    Panel(
        "Failed rooms by reason",
        Source.worker,
        (
            Query(
                "sum by (role, reason) "
                f"(rate(pdcluster_failures_total[{RATE}]) {worker('prefill|decode', 'role')})",
                "{{role}} {{reason}}",
            ),
        ),
        Unit.per_second,
        "Transfer and room failures as each worker counts them (plus recomputed)",
        stacked=True,
    ),
    Panel(
        "Prefix cache hit rate",
        Source.worker,
        (
            Query(
                "sum by (role) (rate(pdcluster_prefix_cache_hit_tokens_total[$__rate_interval]) "
                f"{worker(labels='role')}) / sum by (role) "
                "(rate(pdcluster_prefix_cache_lookup_tokens_total[$__rate_interval]) "
                f"{worker(labels='role')})",
                "{{role}}",
            ),
        ),
        Unit.ratio,
    ),
    Panel(
        "Decode prefix reuse",
        Source.worker,
        (
            Query(
                f"sum(rate(pdcluster_decode_reuse_bytes_total[{RATE}]) {worker('decode')})",
                "reused",
            ),
            Query(
                'sum(rate(pdcluster_transfer_bytes_total{direction="in"}[$__rate_interval]) '
                f"{worker('decode')})",
                "received",
            ),
        ),
        Unit.bytes_per_second,
        "KV bytes decode already held and did not receive, beside the bytes it received",
    ),
)

CAPACITY: tuple[Panel, ...] = (
    Panel(
        "Queue depth by stage",
        Source.worker,
        (
            Query(
                f"sum by (role, stage) (pdcluster_queue_size {worker(labels='role')})",
                "{{role}} {{stage}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Requests in flight",
        Source.worker,
        (
            Query(
                f"sum by (role) (pdcluster_requests_in_flight {worker(labels='role')})", "{{role}}"
            ),
        ),
        Unit.number,
    ),
    Panel(
        "KV pages in use",
        Source.worker,
        (
            Query(
                "max by (pdcluster_instance) (1 - pdcluster_kv_free_pages / "
                f"pdcluster_kv_total_pages {worker(labels='pdcluster_instance')})",
                "{{pdcluster_instance}}",
            ),
        ),
        Unit.ratio,
    ),
    Panel(
        "Queued prefill tokens",
        Source.worker,
        (
            Query(
                "sum by (pdcluster_instance) (pdcluster_queued_prefill_tokens "
                f"{worker('prefill', 'pdcluster_instance')})",
                "{{pdcluster_instance}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Legs in flight per worker (router)",
        Source.router,
        (
            Query(
                f"max by (role, worker) (pdcluster_router_worker_outstanding {ROUTER})",
                "{{role}} {{worker}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Replicas per role",
        Source.operator,
        (
            Query(
                'max by (role, state) (pdcluster_operator_role_replicas{pdcluster=~"$pdcluster"})',
                "{{role}} {{state}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Autoscaler decisions",
        Source.operator,
        (
            Query(
                "sum by (role, direction) "
                "(increase(pdcluster_operator_autoscaler_decisions_total[$__range]))",
                "{{role}} {{direction}}",
            ),
        ),
        Unit.number,
        "Replica changes the autoscaler applied over the shown range",
    ),
)

OPERATOR: tuple[Panel, ...] = (
    Panel(
        "Reconciles by result",
        Source.operator,
        (
            Query(
                f"sum by (result) (rate(pdcluster_operator_reconciles_total[{RATE}]))",
                "{{result}}",
            ),
        ),
        Unit.per_second,
        stacked=True,
    ),
    Panel(
        "Reconcile duration",
        Source.operator,
        quantiles(f"rate(pdcluster_operator_reconcile_seconds_bucket[{RATE}])"),
        Unit.seconds,
    ),
    Panel(
        "Failovers by role and cause",
        Source.operator,
        (
            Query(
                "sum by (role, cause) (increase(pdcluster_operator_failovers_total[$__range]))",
                "{{role}} {{cause}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Failure detection and failover time",
        Source.operator,
        (
            Query(
                "histogram_quantile(0.9, sum by (le) "
                f"(rate(pdcluster_operator_failure_detection_seconds_bucket[{RATE}])))",
                "detection p90",
            ),
            Query(
                "histogram_quantile(0.9, sum by (le) "
                f"(rate(pdcluster_operator_failover_seconds_bucket[{RATE}])))",
                "failover p90",
            ),
        ),
        Unit.seconds,
    ),
    Panel(
        "Instance restarts",
        Source.operator,
        (
            Query(
                "sum by (role, cause) "
                "(increase(pdcluster_operator_instance_restarts_total[$__range]))",
                "{{role}} {{cause}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Restart budget used",
        Source.operator,
        (
            Query(
                "max by (namespace, pdcluster, role) "
                '(pdcluster_operator_restart_budget_used_ratio{pdcluster=~"$pdcluster"})',
                "{{namespace}}/{{pdcluster}} {{role}}",
            ),
        ),
        Unit.ratio,
    ),
    Panel(
        "Events by reason",
        Source.operator,
        (
            Query(
                "sum by (type, reason) (increase(pdcluster_operator_events_total[$__range]))",
                "{{type}} {{reason}}",
            ),
        ),
        Unit.number,
    ),
    Panel(
        "Failed rooms the workers report",
        Source.operator,
        (
            Query(
                "sum by (role, reason) (increase(pdcluster_operator_rooms_failed_total[$__range]))",
                "{{role}} {{reason}}",
            ),
        ),
        Unit.number,
    ),
)

# uid → (title, panels): the dashboards the chart ships.
DASHBOARDS: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "pdcluster-overview": ("PDCluster / Overview", OVERVIEW),
    "pdcluster-pd": ("PDCluster / Prefill-decode", PD),
    "pdcluster-capacity": ("PDCluster / Capacity", CAPACITY),
    "pdcluster-operator": ("PDCluster / Operator", OPERATOR),
}


def all_panels() -> list[tuple[str, Panel]]:
    """(dashboard uid, panel) of every panel."""
    return [(uid, panel) for uid, (_, panels) in DASHBOARDS.items() for panel in panels]

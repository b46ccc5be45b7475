"""What the router's own `/metrics` gives the autoscaler.

Prefill's `ttftP90Seconds` is read from the router, not the prefill workers:
the router's `pdcluster_router_time_to_first_token_seconds` runs from a
request's leg plan to its prefill leg's answer (the prefill computes the
first token), so it holds what a worker's own histogram cannot see — the
router's time, the network, and a request that waited in no worker's queue
yet. Every other target comes from the workers (`samples.py`).

The interval step (`step.py`) reads worker-shaped scrapes. So that the
router needs nothing of its own there, `as_prefill_scrape(text)` restates
one router pod's body under the series names the step reads:

- `pdcluster_time_to_first_token_seconds` ← the router's histogram, bucket
  for bucket (the step takes each scrape's difference from the previous
  one and sums the scrapes, so several router replicas add up: each sees
  its own requests);
- `pdcluster_requests_in_flight` ← the prefill legs in flight
  (`pdcluster_router_worker_outstanding{role="prefill"}`, summed): requests
  still waiting for their first token. The step counts an interval without
  an observation as 0 only when none is in flight (idle), never while some
  are stuck.

Missing or unreadable: a router pod that is not Ready or does not answer is
not scraped; a body without the histogram (a router that predates it)
becomes a scrape without it. Either way no sample is left and the planner
holds with a `MetricMissing` Warning, as for the workers; a body that is
not Prometheus text is passed on as is, so the step names it as unreadable.

`status.prefill.autoscaling.source` says which it was (`router` or
`workers`), and `with_router_hold_notes` adds to a hold's Event and status
message that the metric is the router's and how many router pods answered.

Pure module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdcluster.operator import names
from pdcluster.operator.autoscale.step import AutoscaleStep
from pdcluster.operator.builders.meta import HTTP_PORT
from pdcluster.operator.builders.router import ROUTER_ROLE
from pdcluster.operator.reconcile.cluster import Cluster
from pdcluster.runtime.autoscale.planner import DecisionReason
from pdcluster.runtime.autoscale.samples import IN_FLIGHT, TTFT
from pdcluster.runtime.spec import AutoscalingMetric, Role

ROUTER_TTFT = "pdcluster_router_time_to_first_token_seconds"
ROUTER_OUTSTANDING = "pdcluster_router_worker_outstanding"

SOURCE_ROUTER = "router"
SOURCE_WORKERS = "workers"


def is_read_from_router(cluster: Cluster, role: Role) -> bool:
    """Whether `role`'s autoscaling target is read from the router's /metrics."""
    spec = cluster.spec.role_spec(role)
    cfg = spec.autoscaling if spec is not None else None
    return (
        cluster.spec.is_disaggregated
        and role is Role.prefill
        and cfg is not None
        and cfg.target.metric is AutoscalingMetric.ttft_p90_seconds
    )


def _is_ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in (conditions if isinstance(conditions, list) else [])
    )


def router_scrape_targets(pods: Iterable[Mapping[str, Any]], cluster: str) -> dict[str, str]:
    """Pod name -> /metrics URL of each Ready router pod of `cluster` not being deleted."""
    out: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = pod.get("status") or {}
        if labels.get(names.LABEL_ROLE) != ROUTER_ROLE:
            continue
        if labels.get(names.LABEL_CLUSTER) != cluster or meta.get("deletionTimestamp"):
            continue
        name, ip = meta.get("name"), status.get("podIP")
        if isinstance(name, str) and name and isinstance(ip, str) and ip and _is_ready(status):
            out[name] = f"http://{ip}:{HTTP_PORT}/metrics"
    return out


def _bound(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(le)


def as_prefill_scrape(text: str) -> str:
    """One router pod's /metrics body as the worker series the step reads (see above)."""
    buckets: list[tuple[float, float]] = []
    total = 0.0
    in_flight = 0.0
    try:
        for family in text_string_to_metric_families(text):
            if family.name == ROUTER_TTFT and family.type == "histogram":
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        buckets.append((float(s.labels["le"]), s.value))
                    elif s.name.endswith("_sum"):
                        total = s.value
            elif family.name == ROUTER_OUTSTANDING:
                in_flight += sum(
                    s.value for s in family.samples if s.labels.get("role") == Role.prefill.value
                )
    except (ValueError, KeyError, IndexError):
        return text  # the step parses it again and names it as unreadable
    lines = [f"# TYPE {IN_FLIGHT} gauge", f"{IN_FLIGHT} {in_flight!r}"]
    if buckets:
        buckets.sort()
        lines.append(f"# TYPE {TTFT} histogram")
        lines += [f'{TTFT}_bucket{{le="{_bound(le)}"}} {count!r}' for le, count in buckets]
        lines += [f"{TTFT}_count {buckets[-1][1]!r}", f"{TTFT}_sum {total!r}"]
    return "\n".join(lines) + "\n"


def status_patch_with_sources(
    patch: Mapping[str, Any], sources: Mapping[Role, str]
) -> dict[str, Any]:
    """A status patch with `source` set in each written role's autoscaling status."""
    roles = {k: dict(v) for k, v in patch["status"].items()}
    for role, source in sources.items():
        body = roles.get(role.value)
        if body is not None and body.get("autoscaling") is not None:
            body["autoscaling"] = {**body["autoscaling"], "source": source}
    return {"status": roles}


_HOLDS = frozenset({DecisionReason.metric_missing.value, DecisionReason.metric_stale.value})


def with_router_hold_notes(
    cluster: Cluster, step: AutoscaleStep, answered: Mapping[Role, int]
) -> AutoscaleStep:
    """`step` with its MetricMissing/MetricStale messages of roles read from the router
    naming the router's /metrics and the router pods that answered (`answered`)."""
    events = list(step.events)
    statuses = dict(step.statuses)
    for role, status in step.statuses.items():
        if status is None or status.reason not in _HOLDS or not is_read_from_router(cluster, role):
            continue
        note = f"; read from the router's /metrics: {answered.get(role, 0)} router pod(s) answered"
        statuses[role] = status.model_copy(update={"message": (status.message + note)[:1024]})
        prefix = f"{role.value}: "
        events = [
            replace(e, message=e.message + note)
            if e.reason in _HOLDS and e.message.startswith(prefix)
            else e
            for e in events
        ]
    return replace(step, events=tuple(events), statuses=statuses)

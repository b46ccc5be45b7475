"""The planner's samples from the workers' own `/metrics` text.

`parse_worker_metrics(text)` reads one worker's Prometheus exposition into
a `WorkerScrape`; `compute_sample(metric, previous, current, at)` turns the
scrapes of one role's Ready instances into the one `Sample` the planner
reads for that role:

- `ttftP90Seconds` / `tpotP90Seconds`: p90 of
  `pdcluster_time_to_first_token_seconds` / `pdcluster_time_per_output_token_seconds`
  over the last interval: each instance's bucket counts minus its previous
  scrape's (a count that went down means the worker restarted: its counts
  start from zero), summed over instances, then the quantile interpolated
  linearly inside its bucket as Prometheus' `histogram_quantile` does.
  An instance without a previous scrape has no interval yet and is left
  out. No observation in the interval: 0 when no request is in flight (idle),
  no sample when some are (requests stuck before their first token must not
  read as "fast").
- `queuedPrefillTokensPerInstance`: mean of `pdcluster_queued_prefill_tokens`.
- `runningRequestsPerInstance`: mean of `pdcluster_requests_in_flight`.
- `kvPageUsage`: mean of 1 - `pdcluster_kv_free_pages` / `pdcluster_kv_total_pages`.

An instance whose text lacks the series is left out of the mean; no
instance left → no sample (the planner then holds: `MetricMissing`).

A vLLM worker (`spec.engine.kind: vllm`) exports its own names
(runtime/vllm/metric_names.py): a body with `vllm:` series is read into the
same `WorkerScrape`, summing over its `engine` label sets (dp ranks) —
`vllm:time_to_first_token_seconds`, `vllm:request_time_per_output_token_seconds`,
running + waiting requests as in flight, and `vllm:kv_cache_usage_perc`
(averaged) as the KV usage.

Pure module: the caller fetches the text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.runtime.autoscale.planner import Sample
from pdcluster.runtime.spec import AutoscalingMetric
from pdcluster.runtime.vllm import metric_names as vllm

TTFT = "pdcluster_time_to_first_token_seconds"
TPOT = "pdcluster_time_per_output_token_seconds"
QUEUED_PREFILL_TOKENS = "pdcluster_queued_prefill_tokens"
IN_FLIGHT = "pdcluster_requests_in_flight"
FREE_PAGES = "pdcluster_kv_free_pages"
TOTAL_PAGES = "pdcluster_kv_total_pages"
# A vLLM worker's KV usage, a fraction (it has no page counts).
KV_USAGE = "kv_usage"

QUANTILE = 0.9


class MetricsParseError(ValueError):
    """A /metrics body is not Prometheus text; the message says where."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (ascending, the last is +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0


@dataclass(frozen=True)
class WorkerScrape:
    ttft: Histogram | None = None
    tpot: Histogram | None = None
    gauges: Mapping[str, float] | None = None

    def gauge(self, name: str) -> float | None:
        return None if self.gauges is None else self.gauges.get(name)


_GAUGES = (QUEUED_PREFILL_TOKENS, IN_FLIGHT, FREE_PAGES, TOTAL_PAGES)


def parse_worker_metrics(text: str) -> WorkerScrape:
    """The series the planner reads from one worker's /metrics body (ours or vLLM's)."""
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, KeyError, IndexError) as err:
        raise MetricsParseError(f"not Prometheus text: {err}") from None
    if any(f.name.startswith(vllm.PREFIX) for f in families):
        return _vllm_scrape(families)
    histograms: dict[str, Histogram] = {}
    gauges: dict[str, float] = {}
    try:
        for family in families:
            if family.name in (TTFT, TPOT) and family.type == "histogram":
                histograms[family.name] = _histogram(family)
            elif family.name in _GAUGES:
                unlabelled = [s.value for s in family.samples if not s.labels]
                if unlabelled:
                    gauges[family.name] = unlabelled[0]
    except (ValueError, KeyError, IndexError) as err:
        raise MetricsParseError(f"not Prometheus text: {err}") from None
    return WorkerScrape(histograms.get(TTFT), histograms.get(TPOT), gauges)


def _histogram(family: Metric) -> Histogram:
    """A histogram family's buckets, summed over its label sets (a vLLM worker's dp ranks)."""
    counts: dict[float, float] = {}
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            bound = float(sample.labels["le"])
            counts[bound] = counts.get(bound, 0.0) + sample.value
    buckets = sorted(counts.items())
    return Histogram(tuple(b for b, _ in buckets), tuple(c for _, c in buckets))


def _vllm_scrape(families: list[Metric]) -> WorkerScrape:
    by_name = {f.name: f for f in families}
    try:
        ttft, tpot = (
            _histogram(by_name[name])
            if name in by_name and by_name[name].type == "histogram"
            else None
            for name in (vllm.TTFT, vllm.TPOT)
        )

        def values(name: str) -> list[float]:
            family = by_name.get(name)
            return [] if family is None else [s.value for s in family.samples]

        gauges: dict[str, float] = {}
        running, waiting = values(vllm.RUNNING), values(vllm.WAITING)
        if running or waiting:
            gauges[IN_FLIGHT] = sum(running) + sum(waiting)
        usage = values(vllm.KV_USAGE)
        if usage:
            gauges[KV_USAGE] = sum(usage) / len(usage)
    except (ValueError, KeyError) as err:
        raise MetricsParseError(f"not vLLM metrics: {err}") from None
    return WorkerScrape(ttft, tpot, gauges)


def histogram_delta(previous: Histogram | None, current: Histogram) -> Histogram:
    """Observations between two scrapes of one worker (a reset counts from zero)."""
    if previous is None or previous.bounds != current.bounds:
        return current
    if any(c < p for p, c in zip(previous.counts, current.counts, strict=True)):
        return current
    counts = tuple(c - p for p, c in zip(previous.counts, current.counts, strict=True))
    return Histogram(current.bounds, counts)


def histogram_quantile(q: float, hist: Histogram) -> float | None:
    """The q-quantile, linear inside its bucket; None without observations.

    In the +Inf bucket the answer is the highest finite bound (as Prometheus).
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    total = hist.count
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(hist.bounds, hist.counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


LATENCY_METRICS = (AutoscalingMetric.ttft_p90_seconds, AutoscalingMetric.tpot_p90_seconds)

# An instance's key: a pod name (the operator) or an instance number (local mode).
K = TypeVar("K", str, int)


@dataclass(frozen=True)
class MetricsText:
    text: str  # an instance's /metrics body
    at: float  # when it was fetched, on the clock of `now`


@dataclass(frozen=True)
class RoleReading(Generic[K]):
    """What one interval's scrapes of a role say (`read_role`)."""

    scrapes: dict[K, WorkerScrape]  # the bodies that parsed: the next interval's `previous`
    unreadable: tuple[tuple[K, str], ...]  # (instance, why) of bodies not metrics text
    sample: Sample | None
    # A p90 metric and no scraped instance has a previous scrape (the first
    # interval, or every instance replaced): no sample is expected.
    is_first_interval: bool


def read_role(
    metric: AutoscalingMetric,
    previous: Mapping[K, WorkerScrape],
    bodies: Mapping[K, MetricsText],
) -> RoleReading[K]:
    """Parse a role's scraped bodies and compute its sample against `previous`."""
    parsed: dict[K, WorkerScrape] = {}
    unreadable: list[tuple[K, str]] = []
    times: list[float] = []
    for key, body in sorted(bodies.items()):
        try:
            parsed[key] = parse_worker_metrics(body.text)
        except MetricsParseError as err:
            unreadable.append((key, str(err)))
            continue
        times.append(body.at)
    sample = None
    if times:
        # A sample is as fresh as its oldest scrape.
        by_name = {str(k): v for k, v in parsed.items()}
        sample = compute_sample(
            metric, {str(k): v for k, v in previous.items()}, by_name, min(times)
        )
    is_first = metric in LATENCY_METRICS and bool(parsed) and not previous.keys() & parsed.keys()
    return RoleReading(parsed, tuple(unreadable), sample, is_first)


def compute_sample(
    metric: AutoscalingMetric,
    previous: Mapping[str, WorkerScrape],
    current: Mapping[str, WorkerScrape],
    at: float,
) -> Sample | None:
    """One role's sample from its Ready instances' scrapes (keyed by instance name)."""
    if metric in LATENCY_METRICS:
        return _latency_sample(metric, previous, current, at)
    values: list[float] = []
    for scrape in current.values():
        value = _per_instance(metric, scrape)
        if value is not None:
            values.append(value)
    return Sample(sum(values) / len(values), at) if values else None


def _per_instance(metric: AutoscalingMetric, scrape: WorkerScrape) -> float | None:
    if metric is AutoscalingMetric.queued_prefill_tokens_per_instance:
        return scrape.gauge(QUEUED_PREFILL_TOKENS)
    if metric is AutoscalingMetric.running_requests_per_instance:
        return scrape.gauge(IN_FLIGHT)
    if metric is AutoscalingMetric.kv_page_usage:
        usage = scrape.gauge(KV_USAGE)
        if usage is not None:
            return usage
        free, total = scrape.gauge(FREE_PAGES), scrape.gauge(TOTAL_PAGES)
        if free is None or not total:
            return None
        return 1.0 - free / total
    raise ValueError(f"{metric.value} is not a per-instance metric")


def _latency_sample(
    metric: AutoscalingMetric,
    previous: Mapping[str, WorkerScrape],
    current: Mapping[str, WorkerScrape],
    at: float,
) -> Sample | None:
    ttft = metric is AutoscalingMetric.ttft_p90_seconds
    merged: Histogram | None = None
    in_flight = 0.0
    for name, scrape in current.items():
        before = previous.get(name)
        now_hist = scrape.ttft if ttft else scrape.tpot
        if before is None or now_hist is None:
            continue
        delta = histogram_delta(before.ttft if ttft else before.tpot, now_hist)
        if merged is None:
            merged = delta
        elif merged.bounds == delta.bounds:
            merged = Histogram(
                merged.bounds,
                tuple(a + b for a, b in zip(merged.counts, delta.counts, strict=True)),
            )
        else:  # another bucket layout (a different version): left out
            continue
        in_flight += scrape.gauge(IN_FLIGHT) or 0.0
    if merged is None:
        return None
    value = histogram_quantile(QUANTILE, merged)
    if value is None:
        return None if in_flight > 0 else Sample(0.0, at)
    return Sample(value, at)

"""The planner's samples from real worker /metrics text."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pdcluster.runtime.autoscale.planner import Sample
from pdcluster.runtime.autoscale.samples import (
    Histogram,
    MetricsParseError,
    WorkerScrape,
    compute_sample,
    histogram_delta,
    histogram_quantile,
    parse_worker_metrics,
)
from pdcluster.runtime.metrics import LATENCY_BUCKETS, WorkerMetrics
from pdcluster.runtime.spec import AutoscalingMetric as M


def scrape(metrics: WorkerMetrics) -> WorkerScrape:
    return parse_worker_metrics(generate_latest(metrics.registry).decode())


def worker(
    ttfts: tuple[float, ...] = (), in_flight: int = 0, free: int = 10, total: int = 10
) -> WorkerMetrics:
    m = WorkerMetrics("prefill")
    for value in ttfts:
        m.ttft_seconds.observe(value)
    m.requests_in_flight.set(in_flight)
    m.watch_pages(lambda: free, lambda: total)
    return m


def test_a_worker_scrape_reads_its_gauges_and_histograms() -> None:
    m = worker((0.02, 0.3), in_flight=3, free=25, total=100)
    m.queued_prefill_tokens.set(480)
    m.tpot_seconds.observe(0.004)
    got = scrape(m)
    assert (got.gauge("pdcluster_requests_in_flight"), got.gauge("pdcluster_kv_free_pages")) == (
        3,
        25,
    )
    assert got.gauge("pdcluster_queued_prefill_tokens") == 480
    assert got.ttft is not None and got.ttft.count == 2
    assert got.ttft.bounds == (*map(float, LATENCY_BUCKETS), float("inf"))
    assert got.tpot is not None and got.tpot.count == 1


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        (M.running_requests_per_instance, 4.0),  # (2 + 6) / 2
        (M.queued_prefill_tokens_per_instance, 150.0),  # (100 + 200) / 2
        (M.kv_page_usage, 0.5),  # (0.25 + 0.75) / 2
    ],
)
def test_per_instance_metrics_are_means_over_instances(metric: M, expected: float) -> None:
    a, b = worker(in_flight=2, free=75, total=100), worker(in_flight=6, free=25, total=100)
    a.queued_prefill_tokens.set(100)
    b.queued_prefill_tokens.set(200)
    current = {"prefill-0": scrape(a), "prefill-1": scrape(b)}
    assert compute_sample(metric, {}, current, at=7.0) == Sample(expected, 7.0)


def test_an_instance_without_the_series_is_left_out_and_none_left_is_no_sample() -> None:
    current = {"a": scrape(worker(in_flight=4)), "b": parse_worker_metrics("")}
    assert compute_sample(M.running_requests_per_instance, {}, current, 1.0) == Sample(4.0, 1.0)
    only_empty = {"b": parse_worker_metrics("")}
    assert compute_sample(M.running_requests_per_instance, {}, only_empty, 1.0) is None
    assert compute_sample(M.kv_page_usage, {}, {}, 1.0) is None


def test_ttft_p90_is_over_the_last_interval_across_instances() -> None:
    a, b = worker((5.0,) * 50), worker()  # a's slow past is before the interval
    previous = {"a": scrape(a), "b": scrape(b)}
    for _ in range(9):
        a.ttft_seconds.observe(0.03)  # bucket (0.025, 0.05]
    b.ttft_seconds.observe(0.2)  # bucket (0.1, 0.25]
    current = {"a": scrape(a), "b": scrape(b)}
    sample = compute_sample(M.ttft_p90_seconds, previous, current, 3.0)
    # 10 observations: rank 9 is the last of the 9 in (0.025, 0.05] -> its upper bound.
    assert sample == Sample(pytest.approx(0.05), 3.0)


def test_latency_without_observations_is_zero_when_idle_and_missing_when_stuck() -> None:
    idle = worker((0.1,))
    before = {"p": scrape(idle)}
    assert compute_sample(M.ttft_p90_seconds, before, {"p": scrape(idle)}, 2.0) == Sample(0.0, 2.0)
    stuck = worker((0.1,), in_flight=5)
    before = {"p": scrape(stuck)}
    assert compute_sample(M.ttft_p90_seconds, before, {"p": scrape(stuck)}, 2.0) is None
    # The first scrape of an instance has no interval yet.
    assert compute_sample(M.ttft_p90_seconds, {}, {"p": scrape(stuck)}, 2.0) is None


def test_tpot_p90_reads_the_tpot_histogram() -> None:
    m = WorkerMetrics("decode")
    previous = {"d": scrape(m)}
    for _ in range(10):
        m.tpot_seconds.observe(0.003)  # bucket (0.0025, 0.005]
    sample = compute_sample(M.tpot_p90_seconds, previous, {"d": scrape(m)}, 1.0)
    assert sample is not None and 0.0025 < sample.value <= 0.005


def test_a_restarted_worker_counts_from_zero() -> None:
    old = Histogram((0.1, 1.0, float("inf")), (50.0, 60.0, 60.0))
    new = Histogram((0.1, 1.0, float("inf")), (1.0, 3.0, 3.0))
    assert histogram_delta(old, new) == new
    later = Histogram((0.1, 1.0, float("inf")), (51.0, 64.0, 64.0))
    assert histogram_delta(old, later).counts == (1.0, 4.0, 4.0)


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [
        ((10.0, 10.0, 10.0), 0.9, 0.09),  # all in the first bucket: linear from 0
        ((0.0, 10.0, 10.0), 0.5, 0.55),  # halfway through (0.1, 1.0]
        ((0.0, 0.0, 10.0), 0.9, 1.0),  # +Inf bucket: the highest finite bound
        ((0.0, 0.0, 0.0), 0.9, None),
    ],
)
def test_histogram_quantile_interpolates_like_prometheus(
    counts: tuple[float, ...], q: float, expected: float | None
) -> None:
    hist = Histogram((0.1, 1.0, float("inf")), counts)
    got = histogram_quantile(q, hist)
    assert got == (None if expected is None else pytest.approx(expected))


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_worker_metrics("pdcluster_requests_in_flight not-a-number\n")
    with pytest.raises(ValueError, match="quantile must be within"):
        histogram_quantile(1.5, Histogram((1.0,), (1.0,)))

"""The autoscaler's samples from a vLLM worker's own /metrics names
(runtime/autoscale/samples.py, runtime/vllm/metric_names.py).

`data/vllm-0.32-decode-metrics.txt` is a decode worker's /metrics body from
vLLM 0.32 (the families read here, as exported), after three requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcluster.runtime.autoscale.samples import (
    IN_FLIGHT,
    KV_USAGE,
    Histogram,
    MetricsParseError,
    compute_sample,
    parse_worker_metrics,
)
from pdcluster.runtime.spec import AutoscalingMetric

CAPTURED = (Path(__file__).parent / "data" / "vllm-0.32-decode-metrics.txt").read_text()


def two_engines(text: str, replace: dict[str, str]) -> str:
    """The captured body as a worker with two dp ranks exports it: each series
    also for `engine="1"` (in its family), with `replace` applied to those."""
    out = []
    for line in text.splitlines():
        out.append(line)
        if not line.startswith("#"):
            second = line.replace('engine="0"', 'engine="1"')
            out.append(replace.get(second, second))
    return "\n".join(out) + "\n"


def test_a_vllm_body_is_read_into_the_planners_series() -> None:
    scrape = parse_worker_metrics(CAPTURED)
    assert scrape.ttft is not None and scrape.ttft.count == 3
    assert scrape.tpot is not None and scrape.tpot.count == 3
    assert scrape.ttft.bounds[-1] == float("inf")
    assert scrape.gauge(IN_FLIGHT) == 0
    assert scrape.gauge(KV_USAGE) == 0


def test_dp_ranks_sum_their_requests_and_histograms_and_average_kv_usage() -> None:
    running = 'vllm:num_requests_running{engine="1",model_name="/tmp/i33/model"} 0.0'
    usage = 'vllm:kv_cache_usage_perc{engine="1",model_name="/tmp/i33/model"} 0.0'
    body = two_engines(CAPTURED, {running: running[:-3] + "3.0", usage: usage[:-3] + "0.5"})
    scrape = parse_worker_metrics(body)
    assert scrape.ttft is not None and scrape.ttft.count == 6
    assert scrape.gauge(IN_FLIGHT) == 3
    assert scrape.gauge(KV_USAGE) == pytest.approx(0.25)


def test_samples_of_vllm_workers() -> None:
    before = {"d0": parse_worker_metrics(CAPTURED)}
    usage = 'vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/i33/model"} 0.0'
    busy = parse_worker_metrics(CAPTURED.replace(usage, usage[:-3] + "0.8"))
    sample = compute_sample(AutoscalingMetric.kv_page_usage, {}, {"d0": busy}, at=1.0)
    assert sample is not None and sample.value == pytest.approx(0.8)
    # No request in the interval and none in flight: the p90 reads as idle (0).
    sample = compute_sample(AutoscalingMetric.ttft_p90_seconds, before, before, at=2.0)
    assert sample is not None and sample.value == 0
    # Three first tokens in the interval: the p90 falls in the (10, 20] bucket.
    empty = {"d0": parse_worker_metrics(CAPTURED)}
    first = empty["d0"].ttft
    assert first is not None
    empty["d0"] = type(empty["d0"])(
        Histogram(first.bounds, tuple(0.0 for _ in first.counts)), None, {}
    )
    sample = compute_sample(AutoscalingMetric.ttft_p90_seconds, empty, before, at=3.0)
    assert sample is not None and 10 < sample.value <= 20


def test_a_vllm_body_with_a_broken_series_is_refused() -> None:
    with pytest.raises(MetricsParseError):
        parse_worker_metrics('vllm:num_requests_running{engine="0"} not-a-number\n')

"""`spec.observability` and the tracer it starts: fields checked, spans parented, sampling.

What a real receiver gets is in test_observed_cluster.py; here the SDK's
in-memory exporter stands behind `Tracing` to check its own logic.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdcluster.runtime.spec import SpecError, TracingSpec, parse_spec
from pdcluster.runtime.telemetry.span_plan import SpanKind, SpanRecord
from pdcluster.runtime.telemetry.tracing import Tracing, start_tracing

PD: dict[str, Any] = {"prefill": {}, "decode": {}}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    ("observability", "message"),
    [
        ({"tracing": {"endpoint": "otel:4318"}}, "observability.tracing.endpoint"),
        ({"tracing": {"sampleRatio": 1.5}}, "observability.tracing.sampleRatio"),
        ({"logFormat": "xml"}, "observability.logFormat"),
        ({"slo": {"ttftP90Seconds": 0}}, "observability.slo.ttftP90Seconds"),
        ({"tracing": {"enabld": True}}, "observability.tracing.enabld"),
    ],
)
def test_a_bad_observability_field_is_refused_by_name(
    observability: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.")):
        parse_spec({**PD, "observability": observability})


def test_tracing_is_off_by_default_and_starts_nothing() -> None:
    spec = parse_spec(PD)
    assert spec.observability.tracing.enabled is False
    assert start_tracing(spec.observability.tracing, "x", {}) is None


def test_the_ttft_slo_is_the_stated_one_else_the_prefill_autoscaling_target() -> None:
    assert parse_spec(PD).ttft_slo_seconds is None
    stated = parse_spec({**PD, "observability": {"slo": {"ttftP90Seconds": 0.8}}})
    assert stated.ttft_slo_seconds == 0.8
    target = {"metric": "ttftP90Seconds", "value": 1.2}
    scaled = parse_spec(
        {"prefill": {"autoscaling": {"maxReplicas": 3, "target": target}}, "decode": {}}
    )
    assert scaled.ttft_slo_seconds == 1.2


def test_the_traces_url_of_an_endpoint() -> None:
    assert TracingSpec(endpoint="http://c:4318").traces_url == "http://c:4318/v1/traces"
    assert TracingSpec(endpoint="http://c:4318/v1/traces").traces_url == "http://c:4318/v1/traces"
    assert TracingSpec().traces_url == "http://localhost:4318/v1/traces"


def tracer(ratio: float = 1.0) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = start_tracing(TracingSpec(enabled=True, sample_ratio=ratio), "svc", {}, exporter)
    assert tracing is not None
    return tracing, exporter


RECORDS = [
    SpanRecord("decode.request", 1_000, 9_000, {"pdcluster.rid": "r"}, kind=SpanKind.server),
    SpanRecord("decode.wait_kv", 2_000, 5_000, {}, "waiting_timeout"),
]
CALLER = {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}


def test_submitted_records_become_one_parent_and_its_children_at_their_own_times() -> None:
    tracing, exporter = tracer()
    request = tracing.request_trace(CALLER)
    tracing.submit(request, RECORDS)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    head, child = spans["decode.request"], spans["decode.wait_kv"]
    assert format(head.context.trace_id, "032x") == TRACE
    assert head.parent is not None and format(head.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert child.parent is not None and child.parent.span_id == head.context.span_id
    assert head.kind is trace.SpanKind.SERVER
    assert head.end_time - head.start_time == 8_000  # monotonic gaps kept exactly
    assert child.start_time - head.start_time == 1_000
    assert child.status.description == "waiting_timeout"


def test_spans_keep_the_ids_the_request_chose_on_arrival() -> None:
    tracing, exporter = tracer()
    request = tracing.request_trace({})  # a new trace
    records = [
        SpanRecord("router.request", 0, 10, {}, kind=SpanKind.server, span_id=0xAB),
        SpanRecord("router.prefill_leg", 1, 5, {}, kind=SpanKind.client, span_id=0xCD),
    ]
    tracing.submit(request, records)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["router.request"].context.span_id == 0xAB
    assert spans["router.request"].context.trace_id == request.trace_id
    assert spans["router.request"].parent is None
    leg = spans["router.prefill_leg"]
    assert leg.context.span_id == 0xCD and leg.parent is not None and leg.parent.span_id == 0xAB
    # What the leg's request carried names that span:
    assert request.child_header(0xCD)["traceparent"] == f"00-{request.trace_id_hex}-{0xCD:016x}-01"


def test_only_sampled_requests_are_built() -> None:
    tracing, exporter = tracer(ratio=0.0)
    assert not tracing.request_trace({}).sampled  # new trace at ratio 0
    for headers in ({}, CALLER, {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-00"}):
        tracing.submit(tracing.request_trace(headers), RECORDS)
    tracing.shutdown()
    assert len(exporter.get_finished_spans()) == 2  # only the sampled caller's request

"""OpenTelemetry tracing of requests: the SDK, OTLP/HTTP export, W3C trace context.

One `Tracing` per process that has `spec.observability.tracing.enabled`;
everything else holds None and never imports OpenTelemetry (the import is
here, and only `start_tracing` reaches it). Each `Tracing` owns its tracer
provider (no global provider is set), so several servers fit in one test
process, and a batch processor exports on a thread of its own: a request
only queues its spans.

Sampling: `ParentBased(TraceIdRatioBased(sampleRatio))` — a request that
arrives with a `traceparent` follows its caller's decision, a new trace is
kept with probability `sampleRatio`. The router's leg spans travel to the
workers as `traceparent` headers, so the router's decision holds for the
whole request.

The router holds live spans (`start_span`, `end_span`): it must know a
leg's span id before it sends the leg. A worker exports its part once the
request ended (`emit`, from `span_plan.plan_worker_spans`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdcluster.runtime.spec import TracingSpec
from pdcluster.runtime.telemetry.span_plan import AttributeValue, SpanRecord

# Where spans go when neither the manifest nor the environment names a collector.
DEFAULT_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "/v1/traces"
# A span queue that is full drops spans rather than slowing requests down.
MAX_QUEUE_SIZE = 8192
EXPORT_INTERVAL_MS = 1000

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """A process's tracer: spans of requests, exported over OTLP/HTTP."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("pdcluster")

    # -------------------------------------------------------------- context
    @staticmethod
    def incoming(headers: Mapping[str, str]) -> Context:
        """The caller's trace context from `traceparent`/`tracestate` (empty: a new trace)."""
        return _PROPAGATOR.extract(
            {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        )

    @staticmethod
    def headers_for(span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span` as the parent of a call."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def context_of(span: Span) -> Context:
        return trace.set_span_in_context(span)

    @staticmethod
    def trace_id(span: Span) -> str | None:
        """The span's trace id as 32 hex digits (None: the span is not recorded)."""
        ctx = span.get_span_context()
        return format(ctx.trace_id, "032x") if ctx.is_valid and ctx.trace_flags.sampled else None

    # ----------------------------------------------------------- live spans
    def start_span(
        self,
        name: str,
        parent: Context | None,
        kind: SpanKind,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> Span:
        return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes)

    @staticmethod
    def end_span(
        span: Span, error: str | None = None, attributes: Mapping[str, AttributeValue] = {}
    ) -> None:
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_attribute("pdcluster.failure_reason", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    # ------------------------------------------------------- finished spans
    def emit(self, records: Sequence[SpanRecord], parent: Context, kind: SpanKind) -> None:
        """Export records (monotonic times) as spans: the first under `parent`
        with `kind`, the rest as its children."""
        if not records:
            return
        offset = time.time_ns() - time.monotonic_ns()  # monotonic → epoch
        head, *children = records
        span = self._tracer.start_span(
            head.name,
            context=parent,
            kind=kind,
            attributes=head.attributes,
            start_time=head.start_ns + offset,
        )
        if not span.is_recording():
            return  # not sampled: no child would be either
        inner = trace.set_span_in_context(span)
        for record in children:
            child = self._tracer.start_span(
                record.name,
                context=inner,
                kind=SpanKind.INTERNAL,
                attributes=record.attributes,
                start_time=record.start_ns + offset,
            )
            _finish(child, record.error, record.end_ns + offset)
        _finish(span, head.error, head.end_ns + offset)

    def shutdown(self) -> None:
        """Export what is queued and stop the export thread."""
        self._provider.shutdown()


def _finish(span: Span, error: str | None, end_ns: int) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def traces_url(endpoint: str | None) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL."""
    base = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def start_tracing(
    spec: TracingSpec,
    service_name: str,
    attributes: Mapping[str, AttributeValue],
    exporter: SpanExporter | None = None,
) -> Tracing | None:
    """A `Tracing` exporting to `spec.endpoint`, or None when tracing is off."""
    if not spec.enabled:
        return None
    resource: dict[str, Any] = {"service.name": service_name, **attributes}
    provider = TracerProvider(
        resource=Resource.create(resource),
        sampler=ParentBased(TraceIdRatioBased(spec.sample_ratio)),
    )
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter or OTLPSpanExporter(endpoint=traces_url(spec.endpoint)),
            max_queue_size=MAX_QUEUE_SIZE,
            schedule_delay_millis=EXPORT_INTERVAL_MS,
        )
    )
    return Tracing(provider)

"""OpenTelemetry export of request spans: the SDK, OTLP/HTTP, a thread of its own.

One `Tracing` per process that has `spec.observability.tracing.enabled`;
everything else holds None and never imports OpenTelemetry (only
`start_tracing` reaches this module). Each `Tracing` owns its tracer
provider (no global provider is set), so several servers fit in one test
process.

Nothing here runs on a request's path but `submit`, one queue put: the
request decided its ids and its sampling when it arrived
(`trace_context.py`) and stamped its stages as it went (`span_plan.py`);
once it ended, its finished `SpanRecord`s are queued, and this module's
thread builds the SDK spans with those ids and times and hands them to the
SDK's batch processor, which exports them over OTLP/HTTP from its own
thread. The spans' ids are the request's own because the provider's id
generator hands out the ids the thread sets just before each span starts
(only that thread starts spans). A full queue drops a request's spans
rather than slowing a request down.

Sampling: the provider's `ParentBased(TraceIdRatioBased(sampleRatio))`
agrees with `trace_context.decide`; only sampled requests are submitted.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, Status, StatusCode, TraceFlags

from pdcluster.runtime.spec import TracingSpec
from pdcluster.runtime.telemetry.span_plan import AttributeValue, SpanKind, SpanRecord
from pdcluster.runtime.telemetry.trace_context import RequestTrace, decide, parse_traceparent

log = logging.getLogger(__name__)

# Requests whose spans may wait for the builder thread; beyond, they are dropped.
MAX_QUEUED_REQUESTS = 4096
MAX_EXPORT_QUEUE = 16384
EXPORT_INTERVAL_MS = 1000

_KINDS = {
    SpanKind.server: trace.SpanKind.SERVER,
    SpanKind.client: trace.SpanKind.CLIENT,
    SpanKind.internal: trace.SpanKind.INTERNAL,
}


class _ChosenIds(IdGenerator):
    """Hands out the ids the builder thread set for the next span (else random ones)."""

    def __init__(self) -> None:
        self.span_id = 0
        self.trace_id = 0
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        chosen, self.span_id = self.span_id, 0
        return chosen or self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        chosen, self.trace_id = self.trace_id, 0
        return chosen or self._random.generate_trace_id()


class Tracing:
    """A process's tracing: request decisions at the edge, spans built on a thread."""

    def __init__(self, provider: TracerProvider, ids: _ChosenIds, sample_ratio: float) -> None:
        self._provider = provider
        self._ids = ids
        self._tracer = provider.get_tracer("pdcluster")
        self.sample_ratio = sample_ratio
        self.rng = random.Random(os.urandom(16))
        self._queue: queue.Queue[tuple[RequestTrace, Sequence[SpanRecord]] | None] = queue.Queue(
            MAX_QUEUED_REQUESTS
        )
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="span-builder", daemon=True)
        self._thread.start()

    # --------------------------------------------------- on the request path
    def request_trace(self, headers: Mapping[str, str]) -> RequestTrace:
        """The caller's trace (`traceparent`/`tracestate`) continued, or a new one."""
        incoming = parse_traceparent(headers.get("traceparent"), headers.get("tracestate"))
        return decide(incoming, self.sample_ratio, self.rng)

    def submit(self, request: RequestTrace, records: Sequence[SpanRecord]) -> None:
        """Queue a finished request's spans (nothing when it is not sampled)."""
        if not request.sampled or not records:
            return
        try:
            self._queue.put_nowait((request, records))
        except queue.Full:
            self.num_dropped += 1

    # ------------------------------------------------------ the builder thread
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._build(*job)
            except Exception:  # noqa: BLE001 - a bad record must not stop tracing
                log.exception("tracing: building a request's spans failed")

    def _build(self, request: RequestTrace, records: Sequence[SpanRecord]) -> None:
        offset = time.time_ns() - time.monotonic_ns()  # monotonic → epoch
        head_id = records[0].span_id or self.rng.getrandbits(64) or 1
        for i, record in enumerate(records):
            span_id = head_id if i == 0 else record.span_id
            parent_id = request.parent_id if i == 0 else (record.parent_id or head_id)
            context = None
            if parent_id is not None:
                parent = SpanContext(
                    request.trace_id,
                    parent_id,
                    is_remote=i == 0,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
                context = trace.set_span_in_context(NonRecordingSpan(parent))
            self._ids.span_id, self._ids.trace_id = span_id, request.trace_id
            span = self._tracer.start_span(
                record.name,
                context=context,
                kind=_KINDS[record.kind],
                attributes=record.attributes,
                start_time=record.start_ns + offset,
            )
            _finish(span, record.error, max(record.end_ns, record.start_ns) + offset)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Build what is queued and export it (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Build and export what is queued, then stop both threads."""
        self._queue.put(None)
        self._thread.join(timeout=10)
        self._provider.shutdown()


def _finish(span: Span, error: str | None, end_ns: int) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


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
    ids = _ChosenIds()
    provider = TracerProvider(
        resource=Resource.create(resource),
        sampler=ParentBased(TraceIdRatioBased(spec.sample_ratio)),
        id_generator=ids,
    )
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter or OTLPSpanExporter(endpoint=spec.traces_url),
            max_queue_size=MAX_EXPORT_QUEUE,
            schedule_delay_millis=EXPORT_INTERVAL_MS,
        )
    )
    return Tracing(provider, ids, spec.sample_ratio)

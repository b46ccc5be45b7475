"""A worker's request counters, its stream's closing usage comment, and its spans."""

from __future__ import annotations

from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService
from pdcluster.runtime.serving.request import BootstrapFields
from pdcluster.runtime.spec import TracingSpec
from pdcluster.runtime.telemetry.tracing import start_tracing

from .conftest import MAX_PROMPT

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def sample(text: str, line_start: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


def test_finished_requests_count_their_tokens_and_outcome(
    worker: tuple[TestClient, EngineService],
) -> None:
    client, _ = worker
    before = client.get("/metrics").text
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert client.post("/generate", json=body).status_code == 200
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-2].startswith(": usage ") and lines[-1] == "data: [DONE]"
    assert '"prompt_tokens":4,"completion_tokens":3' in lines[-2]
    after = client.get("/metrics").text
    for name, delta in (
        ("pdcluster_prompt_tokens_total{", 8),
        ("pdcluster_generation_tokens_total{", 6),
        ('pdcluster_request_success_total{reason="length"', 2),
    ):
        assert sample(after, name) - sample(before, name) == delta, name
    assert 'pdcluster_worker_info{pdcluster=""' in after


def test_with_tracing_a_request_becomes_a_span_under_the_callers_traceparent(
    worker: tuple[TestClient, EngineService],
) -> None:
    _, service = worker
    exporter = InMemorySpanExporter()
    tracing = start_tracing(TracingSpec(enabled=True), "pdcluster-colocated", {}, exporter)
    assert tracing is not None
    tok = load_tokenizer("tiny", service.engine.model_config.eos_token_id)
    info = WorkerInfo("tiny", "tiny", MAX_PROMPT, 64, service.engine.model_config.vocab_size)
    app = create_worker_app(
        ColocatedBackend(service), tok, info, WorkerMetrics("colocated"), tracing=tracing
    )
    with TestClient(app) as client:
        resp = client.post(
            "/generate",
            json={
                "input_ids": [1, 2, 3],
                "rid": "req-traced",
                "sampling_params": {"max_new_tokens": 2},
            },
            headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
        )
        assert resp.status_code == 200
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.name == "colocated.request"
    assert format(span.context.trace_id, "032x") == TRACE
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT
    assert span.attributes is not None and span.attributes["pdcluster.rid"] == "req-traced"
    assert span.attributes["pdcluster.prompt_tokens"] == 3


def test_without_tracing_a_request_carries_no_stamps(
    worker: tuple[TestClient, EngineService],
) -> None:
    client, _ = worker
    state = client.app.state.worker  # type: ignore[attr-defined]
    assert state.tracing is None
    sampling = state.sampling_of(None, None, None, 2, None, False)
    headers = {"traceparent": f"00-{TRACE}-{PARENT}-01"}
    req = state.prepare(None, [1, 2], sampling, None, BootstrapFields(), headers=headers)
    assert req.stamps is None and req.traceparent is not None

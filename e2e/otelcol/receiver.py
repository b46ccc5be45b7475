"""The pinned OpenTelemetry Collector as an OTLP/HTTP receiver, and the spans it got.

`otlp_receiver(workdir)` runs the collector (`build.py`) with its OTLP
receiver on a free loopback port and the file exporter writing every span
it receives, as OTLP JSON, to a file; `ReceivedSpans.read()` parses that
file into `Span`s. So a test sees exactly what a real receiver accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.otelcol.build import ensure_collector
from e2e.processes import spawn, stop, tail, wait_until
from pdcluster.runtime.ports import free_port


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: str = ""
    status_message: str = ""

    @property
    def is_error(self) -> bool:
        return self.status_code == "STATUS_CODE_ERROR" or self.status_code == "2"


def _value(raw: dict[str, Any]) -> Any:
    (kind, value), *_ = raw.items()
    return int(value) if kind == "intValue" else value


def parse_export(line: str) -> list[Span]:
    """One line of the file exporter: an OTLP JSON `ExportTraceServiceRequest`."""
    spans = []
    for resource_spans in json.loads(line).get("resourceSpans", []):
        resource = {a["key"]: _value(a["value"]) for a in resource_spans["resource"]["attributes"]}
        for scope in resource_spans.get("scopeSpans", []):
            for raw in scope.get("spans", []):
                status = raw.get("status", {})
                code = status.get("code", "")
                spans.append(
                    Span(
                        service=str(resource.get("service.name", "")),
                        name=raw["name"],
                        trace_id=raw["traceId"],
                        span_id=raw["spanId"],
                        parent_id=raw.get("parentSpanId", ""),
                        kind=str(raw.get("kind", "")),
                        start_ns=int(raw["startTimeUnixNano"]),
                        end_ns=int(raw["endTimeUnixNano"]),
                        attributes={
                            a["key"]: _value(a["value"]) for a in raw.get("attributes", [])
                        },
                        status_code=str(code),
                        status_message=status.get("message", ""),
                    )
                )
    return spans


@dataclass(frozen=True)
class ReceivedSpans:
    endpoint: str  # the OTLP/HTTP base URL to export to
    path: Path

    def read(self) -> list[Span]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [span for line in lines if line.strip() for span in parse_export(line)]


@contextmanager
def otlp_receiver(workdir: Path) -> Iterator[ReceivedSpans]:
    binary = ensure_collector()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    out = workdir / "spans.jsonl"
    config = {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{port}"}}}},
        "exporters": {"file": {"path": str(out)}},
        "service": {
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
        },
    }
    config_path = workdir / "otelcol.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = workdir / "otelcol.log"
    _, record = spawn("otelcol", [str(binary), "--config", str(config_path)], log)
    endpoint = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        import socket

        with socket.socket() as sock:
            sock.settimeout(0.5)
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, 60, f"the OTLP receiver ({tail(log)})")
        yield ReceivedSpans(endpoint, out)
    finally:
        stop(record, grace_s=10)


def format_trace_tree(spans: list[Span]) -> str:
    """One trace as an indented tree: service, span name, duration, status, room/rid."""
    by_parent: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_ns):
        parent = span.parent_id if span.parent_id in ids else ""
        by_parent.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in by_parent.get(parent, []):
            ms = (span.end_ns - span.start_ns) / 1e6
            status = f" ERROR({span.status_message})" if span.is_error else ""
            facts = {
                k.removeprefix("pdcluster."): v
                for k, v in span.attributes.items()
                if k in ("pdcluster.room", "pdcluster.kv.bytes", "pdcluster.kv.backend")
            }
            lines.append(
                f"{'  ' * depth}{span.name} [{span.service}] {ms:.1f} ms{status} {facts or ''}"
            )
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(line.rstrip() for line in lines)

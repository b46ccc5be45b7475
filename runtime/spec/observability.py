"""`spec.observability`: request tracing, the log format and the SLO alerts read.

- `tracing`: OpenTelemetry traces of every request across router, prefill and
  decode, exported over OTLP/HTTP. Off unless `enabled`; `endpoint` is the
  collector's base URL (the operator fills in its chart's default when the
  manifest names none); `sampleRatio` is the share of new traces kept (a
  request arriving with a sampled W3C `traceparent` is always kept).
- `logFormat`: `json` (one object per line, with room, rid, role, instance
  and trace id) or `text`. Unset: `json` in pods the operator builds, `text`
  in local mode.
- `slo.ttftP90Seconds`: the p90 time to first token the cluster promises;
  the router exports it (`pdcluster_router_slo_ttft_p90_seconds`) so the
  `PDClusterTTFTOverSLO` alert compares each cluster with its own number.
  Unset, a prefill `ttftP90Seconds` autoscaling target stands in.

Pure module.
"""

from __future__ import annotations

import enum
import re

from pydantic import Field, field_validator

from pdcluster.runtime.spec.base import SpecModel

# Set by the operator in every pod it builds: the manifest's logFormat, json if unset.
LOG_FORMAT_ENV = "PDCLUSTER_LOG_FORMAT"
# Where spans go when neither the manifest nor the operator names a collector.
DEFAULT_OTLP_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "/v1/traces"
# scheme://host[:port][/path]: what the OTLP/HTTP exporter accepts as a base URL.
_ENDPOINT = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")


def check_endpoint(value: str) -> str:
    """`value` if it is an OTLP/HTTP base URL; else ValueError saying what one looks like."""
    if not _ENDPOINT.match(value):
        raise ValueError(f"must be an http(s):// URL without query or fragment, got {value!r}")
    return value


class LogFormat(enum.StrEnum):
    text = "text"
    json = "json"


class TracingSpec(SpecModel):
    enabled: bool = Field(default=False, description="export OpenTelemetry traces of requests")
    endpoint: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description=(
            "OTLP/HTTP base URL of the collector, e.g. http://otel-collector.monitoring:4318 "
            "(spans go to <endpoint>/v1/traces); unset: the operator's default"
        ),
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of new traces recorded; a sampled incoming traceparent is kept",
    )

    @property
    def traces_url(self) -> str:
        """The OTLP/HTTP traces URL of `endpoint` (the default collector when unset)."""
        base = (self.endpoint or DEFAULT_OTLP_ENDPOINT).rstrip("/")
        return base if base.endswith(TRACES_PATH) else base + TRACES_PATH

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_a_url(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


class SloSpec(SpecModel):
    ttft_p90_seconds: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        description="p90 time to first token the cluster promises (the TTFT alert's threshold)",
    )


class ObservabilitySpec(SpecModel):
    tracing: TracingSpec = TracingSpec()
    log_format: LogFormat | None = Field(
        default=None, description="json or text; unset: json in pods, text in local mode"
    )
    slo: SloSpec = SloSpec()

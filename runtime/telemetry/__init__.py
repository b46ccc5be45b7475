"""Telemetry of requests: OpenTelemetry traces (`tracing`, `span_plan`) and
structured logs (`request_log`)."""

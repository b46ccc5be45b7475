"""An OpenTelemetry Collector (OTLP receiver, file exporter) for the tracing tests."""

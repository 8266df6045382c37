"""Which span exporters the standard OTEL_* variables select, checked before a service
starts (TracingConfigError names the variable), and the span processors that feed them."""

from __future__ import annotations

import os

from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)


class TracingConfigError(ValueError):
    """An OTEL_* variable asks for something this build cannot do."""


def trace_exporters() -> list[str]:
    """The span exporters the standard OTEL_* variables ask for (none by default); raises
    TracingConfigError for what this build cannot do (checked before a service starts)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        names = "otlp" if endpoint else "none"
    exporters = [n.strip().lower() for n in names.split(",") if n.strip().lower() != "none"]
    for name in exporters:
        if name not in ("otlp", "console"):
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console or none)"
            )
    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if "otlp" in exporters and protocol != "grpc":
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: specdec exports OTLP over gRPC only "
            "(set it to 'grpc' and point the endpoint at the collector's gRPC port, 4317)"
        )
    return exporters


def span_processors() -> list:
    processors = []
    for name in trace_exporters():
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            processors.append(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            processors.append(SimpleSpanProcessor(ConsoleSpanExporter()))
    return processors

"""OpenTelemetry set-up and traces of the three services: the process-wide meter and tracer
providers (`setup`, with /metrics for Prometheus), and the spans of a request.

The instruments are in specdec.serving.metrics; which span exporters the OTEL_* variables
select is in specdec.serving.trace_export.

Traces: off by default (a span costs tens of microseconds on the hot path). They are exported
over OTLP/gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, or as
`OTEL_TRACES_EXPORTER` says (`otlp`, `console`, `none`); the exporter and the SDK read the
other standard variables themselves (headers, certificates, sampler, batch delays,
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SDK_DISABLED`). W3C trace context
(`traceparent`) crosses every gRPC hop in the metadata, so one request is one trace from the
client through the coordinator into both worker tiers; a server answers with a W3C
`traceresponse` in its initial metadata.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from specdec.serving.trace_export import span_processors

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
COUNT_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
GAMMA_BUCKETS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16]

_configured = False
_tracing = False


def setup(service_name: str, metrics_port: int, host: str = "127.0.0.1") -> None:
    """Install the meter and tracer providers once per process; serve /metrics when port > 0."""
    global _configured, _tracing
    if _configured:
        return
    _configured = True
    # OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES) win over the default name
    named = os.environ.get("OTEL_SERVICE_NAME")
    resource = Resource.create({} if named else {"service.name": service_name})
    readers = []
    if metrics_port > 0:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=host)  # the service's own bind address
        readers.append(PrometheusMetricReader())
    views = [
        View(
            instrument_name="*_seconds",
            aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS),
        ),
        View(
            instrument_name="*_size", aggregation=ExplicitBucketHistogramAggregation(COUNT_BUCKETS)
        ),
        View(
            instrument_name="*_length",
            aggregation=ExplicitBucketHistogramAggregation(COUNT_BUCKETS),
        ),
        View(
            instrument_name="specdec_num_speculative_tokens",
            aggregation=ExplicitBucketHistogramAggregation(GAMMA_BUCKETS),
        ),
    ]
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=readers, views=views)
    )
    processors = span_processors()
    if processors:
        provider = TracerProvider(resource=resource)
        for processor in processors:
            provider.add_span_processor(processor)
        trace.set_tracer_provider(provider)
        _tracing = True


def tracing() -> bool:
    return _tracing


def shutdown() -> None:
    """Flush spans still waiting in the batch processor (at exit)."""
    if _tracing:
        trace.get_tracer_provider().shutdown()


_flush_state = threading.Lock()  # guards the two flags below
_flushing = False  # a flush thread runs
_flush_again = False  # asked for while it ran: it runs once more


def flush_soon() -> None:
    """Export the spans the batch processor holds now, in a thread, not at its next scheduled
    batch: called after a failover or a takeover, whose record must reach the collector even
    when this process is the next thing to die (faults come in pairs). Calls made while a
    flush runs make it run once more, so a burst of failovers costs two exports, not one
    each."""
    global _flushing, _flush_again
    if not _tracing:
        return
    with _flush_state:
        if _flushing:
            _flush_again = True
            return
        _flushing = True
    threading.Thread(target=_flush, name="span-flush", daemon=True).start()


def _flush() -> None:
    global _flushing, _flush_again
    while True:
        try:
            trace.get_tracer_provider().force_flush(5000)
        except Exception:  # noqa: BLE001 - the batch processor exports them later anyway
            log.debug("flushing spans failed", exc_info=True)
        with _flush_state:
            if not _flush_again:
                _flushing = False
                return
            _flush_again = False


def meter():
    return metrics.get_meter("specdec")


def _tracer():
    return trace.get_tracer("specdec")


def span(name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL, **attributes):
    """A child span of the current one when tracing is on; a free no-op (None) otherwise."""
    if not _tracing:
        return contextlib.nullcontext()
    return _tracer().start_as_current_span(name, kind=kind, attributes=attributes)


def client_span(name: str, **attributes):
    """The span of an outgoing RPC (its context goes out in `trace_metadata()`)."""
    return span(name, trace.SpanKind.CLIENT, **attributes)


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current trace context (W3C traceparent), or None."""
    if not _tracing:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


@contextlib.contextmanager
def server_span(name: str, context):
    """The span of an incoming RPC, the child of the caller's span when its metadata carries
    one; yields the metadata of a W3C `traceresponse` for the reply (None when tracing is off)."""
    if not _tracing:
        yield None
        return
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    parent = propagate.extract(carrier)
    with _tracer().start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER) as s:
        ctx = s.get_span_context()
        flags = f"{int(ctx.trace_flags):02x}"
        yield (("traceresponse", f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags}"),)


def record_span(name: str, start_ns: int, end_ns: int, **attributes) -> None:
    """A finished child span of the current one with explicit times (wall clock, ns): the
    queue wait and the forward pass of a batched call, measured by the batcher."""
    if _tracing:
        s = _tracer().start_span(name, start_time=start_ns, attributes=attributes)
        s.end(end_time=end_ns)


def wall_ns() -> int:
    return time.time_ns()

"""OpenTelemetry metrics (exported for Prometheus) and traces for the three services.

Metric names are prefixed `specdec_`; see README "Metrics" for each with the PromQL that
reads it. Traces: one span per session round in the coordinator and one per RPC in every service,
recorded when SPECDEC_TRACE_CONSOLE=1 (printed by the console exporter); off otherwise,
because each span costs tens of microseconds on the hot path. Metrics are recorded only
when the service has a --metrics-port.
"""

from __future__ import annotations

import contextlib
import os

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

LATENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
COUNT_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]

_configured = False
_tracing = False


def setup(service_name: str, metrics_port: int, host: str = "127.0.0.1") -> None:
    """Install the meter and tracer providers once per process; serve /metrics when port > 0."""
    global _configured, _tracing
    if _configured:
        return
    _configured = True
    resource = Resource.create({"service.name": service_name})
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
    ]
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=readers, views=views)
    )
    if os.environ.get("SPECDEC_TRACE_CONSOLE") == "1":
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
        _tracing = True


def meter():
    return metrics.get_meter("specdec")


def span(name: str, **attributes):
    """A trace span when tracing is on; a free no-op otherwise (spans cost ~50 µs each)."""
    if not _tracing:
        return contextlib.nullcontext()
    return trace.get_tracer("specdec").start_as_current_span(name, attributes=attributes)


class WorkerMetrics:
    """Metrics of a draft or target worker (label `role`)."""

    def __init__(self, role: str, sessions_fn, kv_bytes_fn, in_flight_fn, evictions_fn):
        m = meter()
        self.attrs = {"role": role}
        self.requests = m.create_counter(
            "specdec_worker_requests", description="worker RPCs by method and status code"
        )
        self.batch_size = m.create_histogram(
            "specdec_worker_batch_size", description="sessions per batched forward"
        )
        self.forward_seconds = m.create_histogram(
            "specdec_worker_forward_seconds", unit="s", description="batched forward time"
        )
        self.queue_seconds = m.create_histogram(
            "specdec_worker_queue_seconds", unit="s", description="wait for a batch"
        )
        self.tokens = m.create_counter(
            "specdec_worker_tokens", description="tokens computed (prefix + candidates)"
        )
        m.create_observable_counter(
            "specdec_worker_kv_evictions",
            callbacks=[lambda _o: [metrics.Observation(evictions_fn(), self.attrs)]],
            description="sessions evicted from the KV cache (LRU)",
        )
        self.resyncs = m.create_counter(
            "specdec_worker_resyncs", description="requests refused for a stale base"
        )
        m.create_observable_gauge(
            "specdec_worker_sessions",
            callbacks=[lambda _o: [metrics.Observation(sessions_fn(), self.attrs)]],
            description="sessions with cached KV",
        )
        m.create_observable_gauge(
            "specdec_worker_kv_bytes",
            callbacks=[lambda _o: [metrics.Observation(kv_bytes_fn(), self.attrs)]],
            description="bytes held by KV caches",
        )
        m.create_observable_gauge(
            "specdec_worker_in_flight",
            callbacks=[lambda _o: [metrics.Observation(in_flight_fn(), self.attrs)]],
            description="calls waiting or running",
        )

    def observe_call(self, method: str, code: str) -> None:
        self.requests.add(1, {**self.attrs, "method": method, "code": code})


class CoordinatorMetrics:
    def __init__(self, active_fn):
        m = meter()
        self.requests = m.create_counter(
            "specdec_requests", description="finished sessions by finish_reason"
        )
        self.generated = m.create_counter(
            "specdec_generated_tokens", description="committed generated tokens"
        )
        self.draft_tokens = m.create_counter(
            "specdec_draft_tokens", description="candidates verified"
        )
        self.accepted = m.create_counter(
            "specdec_accepted_tokens", description="candidates accepted"
        )
        self.rounds = m.create_counter("specdec_rounds", description="verify rounds")
        self.round_seconds = m.create_histogram(
            "specdec_round_seconds", unit="s", description="propose+verify+commit"
        )
        self.acceptance_length = m.create_histogram(
            "specdec_acceptance_length", description="accepted + 1 per round"
        )
        self.ttft = m.create_histogram(
            "specdec_time_to_first_token_seconds", unit="s", description="request to first commit"
        )
        self.failovers = m.create_counter(
            "specdec_failovers", description="sessions moved off a failed worker, by tier"
        )
        self.takeovers = m.create_counter(
            "specdec_takeovers", description="sessions resumed from another coordinator"
        )
        self.lost = m.create_counter(
            "specdec_lost_sessions", description="loops stopped by a lost lease or CAS"
        )
        self.backpressure = m.create_counter(
            "specdec_backpressure",
            description="worker calls answered RESOURCE_EXHAUSTED (full worker), by tier",
        )
        self.bad_answers = m.create_counter(
            "specdec_worker_bad_answers",
            description="worker answers the coordinator refused as inconsistent, by tier",
        )
        self.shed = m.create_counter(
            "specdec_shed_requests",
            description="new sessions refused because the target tier was saturated",
        )
        self.rejected = m.create_counter(
            "specdec_rejected_requests", description="requests refused, by status code"
        )
        m.create_observable_gauge(
            "specdec_active_sessions",
            callbacks=[lambda _o: [metrics.Observation(active_fn())]],
            description="sessions this coordinator runs",
        )

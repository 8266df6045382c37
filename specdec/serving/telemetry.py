"""OpenTelemetry metrics (exported for Prometheus) and traces for the three services.

Metric names are prefixed `specdec_`; see README "Metrics" for each with the PromQL that
reads it. Metrics are recorded only when the service has a --metrics-port.

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
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)

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


class WorkerMetrics:
    """Metrics of a draft or target worker (label `role`)."""

    def __init__(
        self,
        role: str,
        sessions_fn,
        kv_bytes_fn,
        in_flight_fn,
        evictions_fn,
        kv_capacity: int,
        graphs=None,
    ):
        m = meter()
        self.attrs = {"role": role}
        if graphs is not None:  # --sampling-graphs: a specdec.core.graphs.SamplingGraphs
            self._sampling_graphs(m, graphs)
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
            "specdec_worker_kv_capacity_bytes",
            callbacks=[lambda _o: [metrics.Observation(kv_capacity, self.attrs)]],
            description="the KV cache budget (--max-kv-mb); beyond it sessions are evicted",
        )
        m.create_observable_gauge(
            "specdec_worker_in_flight",
            callbacks=[lambda _o: [metrics.Observation(in_flight_fn(), self.attrs)]],
            description="calls waiting or running",
        )

    def observe_call(self, method: str, code: str) -> None:
        self.requests.add(1, {**self.attrs, "method": method, "code": code})

    def _sampling_graphs(self, m, graphs) -> None:
        m.create_observable_counter(
            "specdec_worker_sampling_graph_calls",
            callbacks=[
                lambda _o: [
                    metrics.Observation(n, {**self.attrs, "path": path})
                    for path, n in sampling_graph_calls(graphs.counts).items()
                ]
            ],
            description="sampling verifies / draft steps by how they ran (--sampling-graphs)",
        )
        m.create_observable_gauge(
            "specdec_worker_sampling_graphs",
            callbacks=[lambda _o: [metrics.Observation(len(graphs._graphs), self.attrs)]],
            description="CUDA graphs of the sampling math held",
        )
        m.create_observable_gauge(
            "specdec_worker_sampling_graph_bytes",
            callbacks=[lambda _o: [metrics.Observation(graphs.held_mb() * 2**20, self.attrs)]],
            description="their estimated GPU memory (--sampling-graphs-mb)",
        )


def sampling_graph_calls(counts: dict) -> dict[str, int]:
    """`specdec_worker_sampling_graph_calls` by path from `SamplingGraphs.counts`: `graph`
    (served by a replay), `eager_redo` (replayed, then verified again on the eager path),
    `eager_too_large` (a shape over the memory budget), `eager_off` (after a failed capture)."""
    return {
        "graph": counts["calls"] - counts["eager"],
        "eager_redo": counts["eager"],
        "eager_too_large": counts["too_large"],
        "eager_off": counts["off"],
    }


class CoordinatorMetrics:
    """The coordinator's metrics. The four `specdec_spec_decode_*` counters have vLLM's names
    (`vllm:spec_decode_*`) and meanings, so a vLLM dashboard carries over by its prefix:
    drafts = rounds that verified candidates, draft tokens = candidates verified, accepted
    tokens = candidates accepted, accepted per position = rounds whose candidate at that
    0-based position was accepted."""

    def __init__(self, active_fn):
        m = meter()
        self.requests = m.create_counter(
            "specdec_requests", description="finished sessions by finish_reason"
        )
        self.prompt_tokens = m.create_counter(
            "specdec_prompt_tokens", description="prompt tokens of new sessions"
        )
        self.generated = m.create_counter(
            "specdec_generated_tokens", description="committed generated tokens"
        )
        self.drafts = m.create_counter(
            "specdec_spec_decode_num_drafts", description="rounds that verified candidates"
        )
        self.draft_tokens = m.create_counter(
            "specdec_spec_decode_num_draft_tokens", description="candidates verified"
        )
        self.accepted = m.create_counter(
            "specdec_spec_decode_num_accepted_tokens", description="candidates accepted"
        )
        self.accepted_per_pos = m.create_counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            description="rounds whose candidate at `position` (0-based) was accepted",
        )
        self.speculative_tokens = m.create_histogram(
            "specdec_num_speculative_tokens", description="γ chosen per round (0 = target-only)"
        )
        self.tpot = m.create_histogram(
            "specdec_time_per_output_token_seconds",
            unit="s",
            description="per finished request: (total - time to first token) / (tokens - 1)",
        )
        self.e2e = m.create_histogram(
            "specdec_e2e_request_latency_seconds",
            unit="s",
            description="per finished request: request to last commit",
        )
        self.redis_seconds = m.create_histogram(
            "specdec_redis_seconds", unit="s", description="session-store calls by op"
        )
        self.resyncs = m.create_counter(
            "specdec_resyncs",
            description="worker calls repeated with the full prefix (a refused base), by tier",
        )
        self.drafts_ahead = m.create_counter(
            "specdec_drafts_ahead",
            description="next blocks drafted during a verify (--pipeline), by outcome: hit "
            "(used), miss (a rejection or a wrong guess), failed (the draft call failed)",
        )
        self.rounds = m.create_counter(
            "specdec_rounds", description="verify rounds (target-only ones included)"
        )
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

    def observe_redis(self, op: str, seconds: float) -> None:
        self.redis_seconds.record(seconds, {"op": op})

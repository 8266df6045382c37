"""The specdec_* metrics of the workers and the coordinator, as OpenTelemetry instruments
(exported for Prometheus).

Metric names are prefixed `specdec_`; see README "Metrics" for each with the PromQL that
reads it. Metrics are recorded only when the service has a --metrics-port (the instruments
are built then, after `telemetry.setup`).
"""

from __future__ import annotations

from opentelemetry import metrics

from specdec.serving.telemetry import meter


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

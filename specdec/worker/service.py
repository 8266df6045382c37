"""What the draft and target gRPC services share: Info, Release, load and metrics hooks."""

from __future__ import annotations

import asyncio

from specdec.errors import Exhausted
from specdec.serving import telemetry
from specdec.serving.rpc import rpc
from specdec.serving.wire import check_session_id
from specdec.v1 import common_pb2
from specdec.worker.batcher import Batcher, BatchRun
from specdec.worker.session_table import SessionTable


class WorkerService:
    """What the draft and target services share: Info, Release, load and metrics hooks.

    `model` describes what the worker serves (a ModelRuntime or a proposer): model_name,
    vocab_size, vocab_fingerprint, max_context, eos_token_ids, device, optional `kind`.
    """

    role = ""
    metrics = None  # specdec.serving.metrics.WorkerMetrics, set by serve_worker

    def __init__(self, model, settings, table: SessionTable, batcher: Batcher, address: str):
        self.model = model
        self.settings = settings
        self.table = table
        self.batcher = batcher
        self.address = address
        self.closing = asyncio.Event()  # set when the worker drains: call streams end

    def info(self) -> common_pb2.WorkerInfo:
        m = self.model
        return common_pb2.WorkerInfo(
            role=self.role,
            model_name=m.model_name,
            vocab_size=m.vocab_size,
            vocab_fingerprint=m.vocab_fingerprint,
            max_context=m.max_context,
            max_sessions=self.settings.max_sessions,
            max_speculative_tokens=self.settings.max_speculative_tokens,
            proposer=getattr(m, "kind", ""),
            device=str(m.device),
            threads=self.settings.threads,
            active_sessions=len(self.table),
            address=self.address,
            eos_token_ids=m.eos_token_ids,
            call_streams=True,  # both tiers serve their call stream (serve_calls)
            call_batches=True,  # and its batched form
        )

    def admit_call(self) -> None:
        """Back-pressure before any work: RESOURCE_EXHAUSTED past --max-in-flight (the caller
        retries, here later or on another worker; it is not a failed worker)."""
        if self.batcher.in_flight >= self.settings.max_in_flight:
            raise Exhausted(
                f"{self.batcher.in_flight} calls in flight (--max-in-flight "
                f"{self.settings.max_in_flight})"
            )

    def load(self) -> float:
        """In-flight calls per batch slot, for least-load placement."""
        return self.batcher.in_flight / max(1, self.settings.max_batch_size)

    def record_call(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_call(method, code)
            if code == "FAILED_PRECONDITION":
                self.metrics.resyncs.add(1, self.metrics.attrs)

    def record_batch(self, run: BatchRun, tokens: int) -> None:
        """Metrics and trace spans of one call's part in a batched pass: its wait for the pass
        (`queue`) and the pass itself (`forward`, shared with the batch's other calls)."""
        telemetry.record_span("queue", run.started_ns - run.queue_ns, run.started_ns)
        telemetry.record_span(
            "forward",
            run.started_ns,
            run.started_ns + run.forward_ns,
            batch_size=run.batch_size,
            batch_seq=run.batch_seq,
            batch_positions=run.positions,
            tokens=tokens,
        )
        if self.metrics is not None:
            m = self.metrics
            m.batch_size.record(run.batch_size, m.attrs)
            m.forward_seconds.record(run.forward_ns / 1e9, m.attrs)
            m.queue_seconds.record(run.queue_ns / 1e9, m.attrs)
            m.tokens.add(tokens, m.attrs)

    @rpc
    async def Release(self, request, context):
        check_session_id(request.session_id)
        async with self.table.hold(request.session_id):
            released = self.table.release(request.session_id, request.epoch)
        self.batcher.forget(request.session_id)
        return common_pb2.ReleaseResponse(released_tokens=released)

    @rpc
    async def Info(self, request, context):
        return self.info()

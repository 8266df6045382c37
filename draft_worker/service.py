"""DraftWorker gRPC service: thin adapters around the session table and a proposer."""

from __future__ import annotations

import time

from draft_worker.engine import ProposeItem
from specdec.errors import InvalidArgument
from specdec.grpc_util import rpc
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.worker import Batcher, SessionTable, sampling_from_proto


class DraftService(draft_pb2_grpc.DraftWorkerServicer):
    def __init__(self, proposer, settings, address: str):
        self.proposer = proposer
        self.settings = settings
        self.address = address
        self.table = SessionTable(
            settings.max_sessions,
            settings.max_kv_mb << 20,
            proposer.vocab_size,
            proposer.max_context,
        )
        self.batcher = Batcher(
            proposer.process, settings.max_batch_size, 1 << 30, settings.max_wait_ms
        )

    def info(self) -> common_pb2.WorkerInfo:
        p = self.proposer
        return common_pb2.WorkerInfo(
            role="draft",
            model_name=p.model_name,
            vocab_size=p.vocab_size,
            vocab_fingerprint=p.vocab_fingerprint,
            max_context=p.max_context,
            max_sessions=self.settings.max_sessions,
            max_speculative_tokens=self.settings.max_speculative_tokens,
            proposer=p.kind,
            device=p.device,
            threads=self.settings.threads,
            active_sessions=len(self.table),
            address=self.address,
            eos_token_ids=p.eos_token_ids,
        )

    metrics = None  # specdec.telemetry.WorkerMetrics, set by serve_worker

    def record_call(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_call(method, code)
            if code == "FAILED_PRECONDITION":
                self.metrics.resyncs.add(1, self.metrics.attrs)

    def record_batch(self, queue_ns: int, forward_ns: int, batch: int, tokens: int) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.batch_size.record(batch, m.attrs)
            m.forward_seconds.record(forward_ns / 1e9, m.attrs)
            m.queue_seconds.record(queue_ns / 1e9, m.attrs)
            m.tokens.add(tokens, m.attrs)

    def load(self) -> float:
        return self.batcher.in_flight / max(1, self.settings.max_batch_size)

    @rpc
    async def Propose(self, request, context):
        start = time.perf_counter_ns()
        gamma = request.num_speculative_tokens
        if not 1 <= gamma <= self.settings.max_speculative_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [1, {self.settings.max_speculative_tokens}], got {gamma}"
            )
        params = sampling_from_proto(request.sampling)
        gamma = min(gamma, self.proposer.max_context - request.base.base_len)
        token_only = request.token_only or params.greedy or self.proposer.kind == "ngram"
        async with self.table.hold(request.base.session_id):
            session = self.table.resolve(request.base, request.delta)
            if gamma <= 0:
                return draft_pb2.ProposeResponse(
                    token_only=token_only, total_ns=time.perf_counter_ns() - start
                )
            item = ProposeItem(
                session, request.base.base_len, gamma, params, request.seed, token_only
            )
            outcome, queue_ns, forward_ns, batch_size = await self.batcher.submit(item, gamma)
            # the session holds all its candidates (the last has no KV yet), so after a round
            # with n accepted the caller sends the delta from base_len + n whatever n is
            session.tokens[request.base.base_len :] = outcome.candidates
        self.table.enforce_memory()
        self.record_batch(queue_ns, forward_ns, batch_size, outcome.computed_tokens + gamma)
        dists = [
            common_pb2.SparseDist(token_ids=ids, weights=weights)
            for ids, weights in zip(outcome.dist_ids, outcome.dist_weights)
        ]
        return draft_pb2.ProposeResponse(
            candidate_ids=outcome.candidates,
            draft_dists=dists,
            token_only=outcome.token_only,
            queue_ns=queue_ns,
            forward_ns=forward_ns,
            total_ns=time.perf_counter_ns() - start,
            computed_tokens=outcome.computed_tokens,
        )

    @rpc
    async def Release(self, request, context):
        async with self.table.hold(request.session_id):
            released = self.table.release(request.session_id)
        return common_pb2.ReleaseResponse(released_tokens=released)

    @rpc
    async def Info(self, request, context):
        return self.info()

"""DraftWorker gRPC service: thin adapters around the session table and a proposer."""

from __future__ import annotations

import time

from draft_worker.engine import ProposeItem
from specdec.errors import InvalidArgument
from specdec.serving.callstream import serve_calls
from specdec.serving.rpc import rpc
from specdec.serving.wire import sampling_from_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.worker.batcher import Batcher
from specdec.worker.service import WorkerService
from specdec.worker.session_table import SessionTable


class DraftService(WorkerService, draft_pb2_grpc.DraftWorkerServicer):
    role = "draft"

    def __init__(self, proposer, settings, address: str):
        super().__init__(
            proposer,
            settings,
            SessionTable(
                settings.max_sessions,
                settings.max_kv_mb << 20,
                proposer.vocab_size,
                proposer.max_context,
                lambda: getattr(getattr(proposer, "runtime", None), "batch_kv_bytes", 0),
            ),
            Batcher(
                proposer.process,
                settings.max_batch_size,
                1 << 30,
                settings.max_wait_ms,
                threads=settings.threads,
            ),
            address,
        )
        self.proposer = proposer

    @rpc
    async def Propose(self, request, context):
        start = time.perf_counter_ns()
        self.admit_call()
        gamma = request.num_speculative_tokens
        if not 1 <= gamma <= self.settings.max_speculative_tokens:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [1, {self.settings.max_speculative_tokens}], got {gamma}"
            )
        if not 0.0 <= request.min_confidence < 1.0:
            raise InvalidArgument(f"min_confidence must be in [0, 1), got {request.min_confidence}")
        params = sampling_from_proto(request.sampling)
        gamma = min(gamma, self.proposer.max_context - request.base.base_len)
        token_only = params.greedy or self.proposer.kind == "ngram"
        async with self.table.hold(request.base.session_id):
            session = self.table.resolve(request.base, request.delta)
            if gamma <= 0:
                return draft_pb2.ProposeResponse(
                    token_only=token_only, total_ns=time.perf_counter_ns() - start
                )
            item = ProposeItem(
                session,
                request.base.base_len,
                gamma,
                params,
                request.seed,
                token_only,
                request.min_confidence,
            )
            self.table.enforce_memory()  # before the pass, not only after it
            run = await self.batcher.submit(item, gamma)
            outcome = run.result
            # the session holds all its candidates (the last has no KV yet), so after a round
            # with n accepted the caller sends the delta from base_len + n whatever n is
            session.tokens[request.base.base_len :] = outcome.candidates
        self.table.enforce_memory()
        self.record_batch(run, outcome.computed_tokens + len(outcome.candidates))
        dists = [
            common_pb2.SparseDist(token_ids=ids, weights=weights)
            for ids, weights in zip(outcome.dist_ids, outcome.dist_weights)
        ]
        return draft_pb2.ProposeResponse(
            candidate_ids=outcome.candidates,
            draft_dists=dists,
            token_only=outcome.token_only,
            queue_ns=run.queue_ns,
            forward_ns=run.forward_ns,
            total_ns=time.perf_counter_ns() - start,
            computed_tokens=outcome.computed_tokens,
            batch_size=run.batch_size if outcome.pass_longest else 0,
            batch_positions=run.batch_size * outcome.pass_longest,
        )

    async def ProposeStream(self, requests, context):
        """Calls of Propose on one stream (specdec/serving/callstream.py); it ends when the
        worker drains."""
        await serve_calls(requests, context, self.Propose, draft_pb2.ProposeReply, self.closing)

    async def ProposeBatches(self, requests, context):
        """ProposeStream with several calls in a message each way."""
        await serve_calls(
            requests,
            context,
            self.Propose,
            draft_pb2.ProposeReply,
            self.closing,
            draft_pb2.ProposeReplies,
        )

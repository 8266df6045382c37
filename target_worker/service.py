"""TargetWorker gRPC service: thin adapters around the session table and TargetEngine."""

from __future__ import annotations

import time

from specdec.errors import InvalidArgument
from specdec.serving.callstream import serve_calls
from specdec.serving.rpc import rpc
from specdec.serving.wire import (
    check_draft_dists,
    check_tokens,
    check_top_logprobs,
    sampling_from_proto,
)
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.worker.batcher import Batcher
from specdec.worker.service import WorkerService
from specdec.worker.session_table import SessionTable
from target_worker.engine import PrefillItem, TargetEngine, VerifyItem


class TargetService(WorkerService, target_pb2_grpc.TargetWorkerServicer):
    role = "target"

    def __init__(self, engine: TargetEngine, settings, address: str):
        runtime = engine.runtime
        super().__init__(
            runtime,
            settings,
            SessionTable(
                settings.max_sessions,
                settings.max_kv_mb << 20,
                runtime.vocab_size,
                runtime.max_context,
                lambda: runtime.batch_kv_bytes,
            ),
            Batcher(
                engine.process,
                settings.max_batch_size,
                settings.max_batch_tokens,
                settings.max_wait_ms,
                threads=settings.threads,
            ),
            address,
        )
        self.engine = engine

    @rpc
    async def Verify(self, request, context):
        start = time.perf_counter_ns()
        self.admit_call()
        runtime = self.engine.runtime
        candidates = check_tokens(request.candidate_ids, runtime.vocab_size, "candidate_ids")
        if len(candidates) > self.settings.max_speculative_tokens:
            raise InvalidArgument(
                f"candidate_ids: {len(candidates)} candidates exceed the limit of {self.settings.max_speculative_tokens}"
            )
        dist_ids, dist_weights = check_draft_dists(
            candidates, request.draft_dists, runtime.vocab_size
        )
        check_top_logprobs(request.top_logprobs)
        params = sampling_from_proto(request.sampling)
        if request.max_output_tokens:
            candidates = candidates[: request.max_output_tokens - 1]
            dist_ids, dist_weights = dist_ids[: len(candidates)], dist_weights[: len(candidates)]
        if request.base.base_len + len(candidates) > runtime.max_context:
            raise InvalidArgument(
                f"base.base_len + candidates exceeds the model context {runtime.max_context}"
            )
        async with self.table.hold(request.base.session_id):
            session = self.table.resolve(request.base, request.delta)
            item = VerifyItem(
                session=session,
                base_len=request.base.base_len,
                candidates=candidates,
                dist_ids=dist_ids or None,
                dist_weights=dist_weights or None,
                params=params,
                seed=request.seed,
                return_logprobs=request.return_logprobs,
                top_logprobs=request.top_logprobs if request.return_logprobs else 0,
            )
            tokens = len(session.pending()) + len(candidates)
            self.table.enforce_memory()  # before the pass, not only after it
            run = await self.batcher.submit(item, tokens)
            outcome = run.result
        self.table.enforce_memory()
        self.record_batch(run, outcome.computed_tokens)
        return target_pb2.VerifyResponse(
            num_accepted=outcome.num_accepted,
            output_ids=outcome.output_ids,
            output_logprobs=outcome.logprobs,
            output_top_logprobs=[
                common_pb2.TopLogprobs(token_ids=ids, logprobs=lps)
                for ids, lps in outcome.top_logprobs or []
            ],
            queue_ns=run.queue_ns,
            forward_ns=run.forward_ns,
            total_ns=time.perf_counter_ns() - start,
            batch_size=run.batch_size,
            computed_tokens=outcome.computed_tokens,
            batch_positions=run.positions,
            batch_seq=run.batch_seq,
        )

    async def VerifyStream(self, requests, context):
        """Calls of Verify on one stream (specdec/serving/callstream.py); it ends when the
        worker drains."""
        await serve_calls(requests, context, self.Verify, target_pb2.VerifyReply, self.closing)

    async def VerifyBatches(self, requests, context):
        """VerifyStream with several calls in a message each way."""
        await serve_calls(
            requests,
            context,
            self.Verify,
            target_pb2.VerifyReply,
            self.closing,
            target_pb2.VerifyReplies,
        )

    @rpc
    async def Prefill(self, request, context):
        start = time.perf_counter_ns()
        self.admit_call()
        async with self.table.hold(request.base.session_id):
            session = self.table.resolve(request.base, request.delta)
            chunk = self.settings.prefill_chunk
            while len(session.pending()) > 1:
                piece = session.pending()[:-1][:chunk]  # the last token is fed by Verify
                await self.batcher.submit(PrefillItem(session, piece), len(piece))
        self.table.enforce_memory()
        return target_pb2.PrefillResponse(
            kv_len=session.kv_len, forward_ns=time.perf_counter_ns() - start
        )

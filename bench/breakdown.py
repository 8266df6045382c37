"""Where a round's time goes: the stack's workers driven directly, one session, greedy.

The benchmark's draft and target workers are called the way the coordinator calls them
(Propose, then Verify with the accepted prefix as the next delta), without the coordinator,
Redis or streaming. Each round splits into: draft forward (the worker's own forward_ns),
draft RPC + handling (client time − forward), target forward, verify RPC + handling. The
coordinator's share is the stack's round time at concurrency 1 minus this direct round time.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import grpc

from specdec.core.prefix import fingerprint
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TIMEOUT_S = 60.0


def _base(session_id: str, history: list[int]) -> common_pb2.Base:
    return common_pb2.Base(
        session_id=session_id, epoch=1, base_len=len(history), base_fingerprint=fingerprint(history)
    )


def direct_rounds(
    draft_addr: str,
    target_addr: str,
    prompt: list[int],
    gamma: int,
    new_tokens: int,
    sampling: common_pb2.SamplingParams | None = None,
) -> dict:
    """Median ms per round of each part, over the rounds after the first (prefill) one;
    greedy unless `sampling` is given (seed 0 on both workers)."""
    session_id = f"bench-breakdown-g{gamma}-{time.monotonic_ns()}"
    params = sampling if sampling is not None else common_pb2.SamplingParams()
    parts: dict[str, list[float]] = {
        k: [] for k in ("draft_forward", "draft_rpc", "target_forward", "target_rpc", "round")
    }
    with (
        grpc.insecure_channel(draft_addr) as draft_channel,
        grpc.insecure_channel(target_addr) as target_channel,
    ):
        draft = draft_pb2_grpc.DraftWorkerStub(draft_channel)
        target = target_pb2_grpc.TargetWorkerStub(target_channel)
        history, held, rounds = list(prompt), 0, 0
        try:
            while len(history) - len(prompt) < new_tokens:
                left = new_tokens - (len(history) - len(prompt))
                g = min(gamma, left - 1)
                t0 = time.perf_counter()
                candidates, dists, draft_ns = [], [], 0
                if g > 0:
                    proposal = draft.Propose(
                        draft_pb2.ProposeRequest(
                            base=_base(session_id, history),
                            delta=common_pb2.TokenDelta(start=held, token_ids=history[held:]),
                            num_speculative_tokens=g,
                            sampling=params,
                            seed=0,
                        ),
                        timeout=TIMEOUT_S,
                    )
                    candidates, dists = list(proposal.candidate_ids), list(proposal.draft_dists)
                    draft_ns = proposal.forward_ns
                t1 = time.perf_counter()
                result = target.Verify(
                    target_pb2.VerifyRequest(
                        base=_base(session_id, history),
                        delta=common_pb2.TokenDelta(start=held, token_ids=history[held:]),
                        candidate_ids=candidates,
                        draft_dists=dists,
                        sampling=params,
                        seed=0,
                        max_output_tokens=left,
                    ),
                    timeout=TIMEOUT_S,
                )
                t2 = time.perf_counter()
                held = len(history) + result.num_accepted
                history += list(result.output_ids)
                rounds += 1
                if rounds > 1 and g == gamma:
                    parts["draft_forward"].append(draft_ns / 1e6)
                    parts["draft_rpc"].append((t1 - t0) * 1e3 - draft_ns / 1e6)
                    parts["target_forward"].append(result.forward_ns / 1e6)
                    parts["target_rpc"].append((t2 - t1) * 1e3 - result.forward_ns / 1e6)
                    parts["round"].append((t2 - t0) * 1e3)
        finally:
            release = common_pb2.ReleaseRequest(session_id=session_id, epoch=1)
            for stub in (draft, target):
                with contextlib.suppress(grpc.RpcError):
                    stub.Release(release, timeout=5.0)
    return {
        "gamma": gamma,
        "rounds": len(parts["round"]),
        **{f"{k}_ms": statistics.median(v) if v else None for k, v in parts.items()},
    }


def breakdown(
    draft_addr: str,
    target_addr: str,
    prompt: list[int],
    gammas: list[int],
    new_tokens: int,
    costs: dict,
) -> list[dict]:
    """Direct round timings per γ next to the in-process costs of the same work."""
    out = []
    step = costs["target_step_ms"]
    for gamma in gammas:
        row = direct_rounds(draft_addr, target_addr, prompt, gamma, new_tokens)
        row["inprocess_draft_ms"] = gamma * costs["draft_step_ms"]
        row["inprocess_verify_ms"] = costs["verify_ms"][str(gamma)] if gamma else step
        out.append(row)
    return out

"""Bad input gets a clear gRPC status naming the field (docs/architecture.md, invariant 7), and
never disturbs a session: after every refused request the worker serves the session the
request named (the "victim") exactly as before, from its cache."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from rounds import RPC_TIMEOUT_S, delta, propose_request, rpc_error, verify_request

from specdec.core.prefix import fingerprint
from specdec.v1 import common_pb2, draft_pb2, target_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
STALE = grpc.StatusCode.FAILED_PRECONDITION
SAMPLING = common_pb2.SamplingParams(temperature=0.8, top_k=40)
GAMMA = 3
EPOCH = 2
VOCAB = 320  # tests/tiny_models.py's tokenizer; checked in the fixture


@dataclass
class Victim:
    """A session both workers hold, and one idempotent request per worker that re-sends only
    its last committed token (so the answer proves the cached prefix is intact)."""

    history: list[int]
    propose: draft_pb2.ProposeRequest
    proposed: draft_pb2.ProposeResponse
    verify: target_pb2.VerifyRequest
    verified: target_pb2.VerifyResponse


@pytest.fixture(scope="module")
def victim(draft, target) -> Victim:
    assert target.service.table.vocab_size == VOCAB
    prompt = [(17 * i + 5) % VOCAB for i in range(20)]
    sid = "victim"
    first = draft.stub.Propose(
        propose_request(sid, prompt, GAMMA, 0, SAMPLING, seed=3, epoch=EPOCH),
        timeout=RPC_TIMEOUT_S,
    )
    result = target.stub.Verify(
        verify_request(sid, prompt, first, 0, SAMPLING, seed=3, epoch=EPOCH),
        timeout=RPC_TIMEOUT_S,
    )
    history = prompt + list(result.output_ids)
    held = len(prompt) + result.num_accepted
    propose = propose_request(sid, history, GAMMA, held, SAMPLING, seed=3, epoch=EPOCH)
    proposed = draft.stub.Propose(propose, timeout=RPC_TIMEOUT_S)
    verify = verify_request(sid, history, proposed, held, SAMPLING, seed=3, epoch=EPOCH)
    verified = target.stub.Verify(verify, timeout=RPC_TIMEOUT_S)
    # what fresh sessions given the full prefix answer
    fresh_proposed = draft.stub.Propose(
        propose_request("fresh", history, GAMMA, 0, SAMPLING, seed=3), timeout=RPC_TIMEOUT_S
    )
    assert list(fresh_proposed.candidate_ids) == list(proposed.candidate_ids)
    fresh_verified = target.stub.Verify(
        verify_request("fresh", history, proposed, 0, SAMPLING, seed=3), timeout=RPC_TIMEOUT_S
    )
    assert list(fresh_verified.output_ids) == list(verified.output_ids)
    for request in (propose, verify):
        request.delta.CopyFrom(delta(history, len(history) - 1))
    return Victim(history, propose, proposed, verify, verified)


def assert_intact(draft, target, victim: Victim) -> None:
    proposed = draft.stub.Propose(victim.propose, timeout=RPC_TIMEOUT_S)
    assert proposed.computed_tokens == 1  # the cached prefix was reused, not recomputed
    assert list(proposed.candidate_ids) == list(victim.proposed.candidate_ids)
    for ours, want in zip(proposed.draft_dists, victim.proposed.draft_dists, strict=True):
        assert list(ours.token_ids) == list(want.token_ids)
        assert max(abs(a - b) for a, b in zip(ours.weights, want.weights)) <= 2
    verified = target.stub.Verify(victim.verify, timeout=RPC_TIMEOUT_S)
    assert verified.computed_tokens == 1 + GAMMA
    assert list(verified.output_ids) == list(victim.verified.output_ids)
    assert list(verified.output_logprobs) == pytest.approx(
        list(victim.verified.output_logprobs), abs=1e-4
    )


def set_sampling(**values):
    def mutate(request, victim):
        for name, value in values.items():
            setattr(request.sampling, name, value)

    return mutate


def out_of_vocab_delta(request, victim):
    request.delta.token_ids[-1] = VOCAB


def delta_length_mismatch(request, victim):
    request.delta.start -= 1  # start + len(token_ids) = base_len - 1


def empty_base(request, victim):
    request.base.base_len = 0
    request.base.base_fingerprint = fingerprint([])
    request.delta.Clear()


def empty_session_id(request, victim):
    request.base.session_id = ""


def huge_session_id(request, victim):
    request.base.session_id = "v" * 5000


def session_id_with_spaces(request, victim):
    request.base.session_id = "victim and more"


def wrong_fingerprint(request, victim):
    request.base.base_fingerprint = fingerprint(victim.history[:-1] + [victim.history[-1] ^ 1])


def stale_epoch(request, victim):
    request.base.epoch = EPOCH - 1


def missing_fingerprint(request, victim):
    request.base.base_fingerprint = b""


def beyond_what_the_worker_holds(request, victim):
    longer = victim.history + list(range(1, 11))  # the worker holds history + γ at most
    request.base.base_len = len(longer)
    request.base.base_fingerprint = fingerprint(longer)
    request.delta.CopyFrom(delta(longer, len(longer) - 1))


def beyond_the_context(request, victim):
    long = [(i % 300) + 1 for i in range(600)]  # the tiny models' context is 512
    request.base.base_len = len(long)
    request.base.base_fingerprint = fingerprint(long)
    request.delta.CopyFrom(delta(long, 0))


COMMON = {
    "temperature<0": (set_sampling(temperature=-0.5), INVALID, "sampling.temperature"),
    "temperature=nan": (set_sampling(temperature=math.nan), INVALID, "sampling.temperature"),
    "temperature=inf": (set_sampling(temperature=math.inf), INVALID, "sampling.temperature"),
    "top_p>1": (set_sampling(top_p=1.5), INVALID, "sampling.top_p"),
    "top_p<0": (set_sampling(top_p=-0.1), INVALID, "sampling.top_p"),
    "top_p=nan": (set_sampling(top_p=math.nan), INVALID, "sampling.top_p"),
    "min_p>1": (set_sampling(min_p=2.0), INVALID, "sampling.min_p"),
    "min_p=nan": (set_sampling(min_p=math.nan), INVALID, "sampling.min_p"),
    "delta-token-outside-vocab": (out_of_vocab_delta, INVALID, "delta.token_ids"),
    "delta-start+len!=base_len": (delta_length_mismatch, INVALID, "delta"),
    "base_len=0": (empty_base, INVALID, "base.base_len"),
    "empty-session-id": (empty_session_id, INVALID, "base.session_id"),
    "huge-session-id": (huge_session_id, INVALID, "base.session_id must be 1 to 128"),
    "session-id-charset": (session_id_with_spaces, INVALID, "base.session_id must be 1 to 128"),
    "base_len-beyond-context": (beyond_the_context, INVALID, "base.base_len"),
    "no-fingerprint-with-delta": (missing_fingerprint, INVALID, "base.base_fingerprint"),
    "wrong-fingerprint": (wrong_fingerprint, STALE, "base.base_fingerprint"),
    "stale-epoch": (stale_epoch, STALE, "base.epoch"),
    "prefix-not-held": (beyond_what_the_worker_holds, STALE, "full prefix"),
}


def candidate_outside_vocab(request, victim):
    request.candidate_ids[0] = VOCAB


def too_many_candidates(request, victim):
    request.candidate_ids.extend([5] * 14)  # 17 > max_speculative_tokens = 16
    request.ClearField("draft_dists")


def dists_length_mismatch(request, victim):
    del request.draft_dists[-1]


def dist_gives_candidate_zero_weight(request, victim):
    dist = request.draft_dists[0]
    index = list(dist.token_ids).index(request.candidate_ids[0])
    dist.weights[index] = 0


def dist_leaves_the_candidate_out(request, victim):
    dist = request.draft_dists[0]
    index = list(dist.token_ids).index(request.candidate_ids[0])
    unused = next(t for t in range(VOCAB) if t not in dist.token_ids)
    dist.token_ids[index] = unused


def dist_token_outside_vocab(request, victim):
    request.draft_dists[1].token_ids.append(VOCAB)
    request.draft_dists[1].weights.append(1)


def dist_weights_shorter(request, victim):
    del request.draft_dists[2].weights[-1]


VERIFY = {
    **COMMON,
    "candidate-outside-vocab": (candidate_outside_vocab, INVALID, "candidate_ids[0]"),
    "gamma-above-limit": (too_many_candidates, INVALID, "candidate_ids"),
    "draft_dists-length": (dists_length_mismatch, INVALID, "draft_dists"),
    "candidate-zero-weight": (dist_gives_candidate_zero_weight, INVALID, "draft_dists[0]"),
    "candidate-not-in-dist": (dist_leaves_the_candidate_out, INVALID, "draft_dists[0]"),
    "dist-token-outside-vocab": (dist_token_outside_vocab, INVALID, "draft_dists[1].token_ids"),
    "dist-weights-length": (dist_weights_shorter, INVALID, "draft_dists[2]"),
}


def gamma_of(value: int):
    def mutate(request, victim):
        request.num_speculative_tokens = value

    return mutate


def confidence_of(value: float):
    def mutate(request, victim):
        request.min_confidence = value

    return mutate


PROPOSE = {
    **COMMON,
    "gamma-above-limit": (gamma_of(17), INVALID, "num_speculative_tokens"),
    "gamma=0": (gamma_of(0), INVALID, "num_speculative_tokens"),
    "min_confidence=1": (confidence_of(1.0), INVALID, "min_confidence"),
    "min_confidence<0": (confidence_of(-0.1), INVALID, "min_confidence"),
    "min_confidence=nan": (confidence_of(math.nan), INVALID, "min_confidence"),
}


@pytest.mark.parametrize("case", list(VERIFY))
def test_bad_verify_is_refused_and_changes_nothing(case, draft, target, victim):
    mutate, code, field = VERIFY[case]
    request = target_pb2.VerifyRequest()
    request.CopyFrom(victim.verify)
    mutate(request, victim)
    err = rpc_error(target.stub.Verify, request)
    assert (err.code(), field in err.details()) == (code, True), err.details()
    assert_intact(draft, target, victim)


@pytest.mark.parametrize("case", list(PROPOSE))
def test_bad_propose_is_refused_and_changes_nothing(case, draft, target, victim):
    mutate, code, field = PROPOSE[case]
    request = draft_pb2.ProposeRequest()
    request.CopyFrom(victim.propose)
    mutate(request, victim)
    err = rpc_error(draft.stub.Propose, request)
    assert (err.code(), field in err.details()) == (code, True), err.details()
    assert_intact(draft, target, victim)


def test_release_of_an_unknown_session_is_not_found(draft, target, victim):
    for worker in (draft, target):
        err = rpc_error(worker.stub.Release, common_pb2.ReleaseRequest(session_id="nobody"))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "session_id" in err.details()
    assert_intact(draft, target, victim)


def test_release_checks_the_session_id(draft, target, victim):
    for worker in (draft, target):
        for bad in ("", "x" * 5000, "victim extra"):
            err = rpc_error(worker.stub.Release, common_pb2.ReleaseRequest(session_id=bad))
            assert err.code() == INVALID and "session_id must be 1 to 128" in err.details()
            assert len(err.details()) < 200  # the id is not echoed back
    assert_intact(draft, target, victim)


def round_call(role: str, worker, sid: str, history: list[int], start: int = 0):
    """(rpc, request) of one Propose or Verify on `history` for a worker of `role`."""
    if role == "draft":
        return worker.stub.Propose, propose_request(sid, history, GAMMA, start, SAMPLING, 1)
    return worker.stub.Verify, verify_request(sid, history, [11, 12], start, SAMPLING, 1)


def answer(role: str, worker, sid: str, history: list[int], start: int = 0) -> list[int]:
    rpc, request = round_call(role, worker, sid, history, start)
    response = rpc(request, timeout=RPC_TIMEOUT_S)
    return list(response.candidate_ids if role == "draft" else response.output_ids)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_full_worker_is_resource_exhausted_only_while_every_session_is_busy(
    role, start_worker, model_dirs, draft, target
):
    """max_sessions=1: while session a's call waits for the (blocked) model thread it cannot
    be evicted, so session b is refused; once a is idle, b evicts it (LRU) and a resyncs."""
    worker = start_worker(role, model_dirs[role], max_sessions=1)
    reference = draft if role == "draft" else target
    prompt_a, prompt_b = [5, 6, 7, 8, 9], [9, 8, 7, 6]
    worker.service.batcher.occupy(time.sleep, 1.0)  # keep the model (thread) busy

    answers = {}
    busy = threading.Thread(target=lambda: answers.update(a=answer(role, worker, "a", prompt_a)))
    busy.start()
    deadline = time.monotonic() + 10
    while worker.service.batcher.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.service.batcher.in_flight == 1, "session a never reached the batcher"
    err = rpc_error(*round_call(role, worker, "b", prompt_b))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-sessions" in err.details()
    busy.join(timeout=RPC_TIMEOUT_S)
    assert answers["a"] == answer(role, reference, f"{role}-a", prompt_a)

    # a is idle now: b evicts it, and a later comes back with its full prefix
    assert answer(role, worker, "b", prompt_b) == answer(role, reference, f"{role}-b", prompt_b)
    err = rpc_error(worker.stub.Release, common_pb2.ReleaseRequest(session_id="a"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    again = prompt_a + [13]
    err = rpc_error(*round_call(role, worker, "a", again, start=len(prompt_a)))
    assert err.code() == STALE
    assert answer(role, worker, "a", again) == answer(role, reference, f"{role}-a2", again)


def test_max_in_flight_is_back_pressure_before_any_work(loop_thread, model_dirs):
    """Past --max-in-flight a worker answers RESOURCE_EXHAUSTED before touching the session
    (no KV, no batch); with room again the same call is served."""
    from inproc_workers import start_draft, start_target

    for start, role in ((start_target, "target"), (start_draft, "draft")):
        worker = start(loop_thread, model_dirs[role], max_in_flight=0)
        try:
            call, request = round_call(role, worker, "pressed", [5, 6, 7, 8])
            err = rpc_error(call, request)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-in-flight 0" in err.details()
            assert len(worker.service.table) == 0 and worker.service.batcher.batches_run == 0
            worker.service.settings = dataclasses.replace(worker.service.settings, max_in_flight=4)
            call(request, timeout=RPC_TIMEOUT_S)
            assert len(worker.service.table) == 1
        finally:
            worker.stop()


def test_out_of_memory_in_a_pass_fails_that_pass_not_the_worker(loop_thread, model_dirs):
    """A pass that runs out of memory fails its calls (INTERNAL, generic: the coordinator
    fails them over); the worker keeps serving and its next pass is exact."""
    import torch
    from inproc_workers import start_target

    worker = start_target(loop_thread, model_dirs["target"])
    try:
        call, request = round_call("target", worker, "oom", [5, 6, 7, 8])
        expected = call(request, timeout=RPC_TIMEOUT_S)
        engine = worker.service.engine
        real = engine.process

        def out_of_memory(items):
            engine.process = real
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        worker.service.batcher.process = out_of_memory
        err = rpc_error(call, request)
        assert err.code() == grpc.StatusCode.INTERNAL
        assert (
            err.details().startswith("internal error (request id ") and "GiB" not in err.details()
        )
        worker.service.batcher.process = real
        again = call(request, timeout=RPC_TIMEOUT_S)
        assert list(again.output_ids) == list(expected.output_ids)
    finally:
        worker.stop()


def test_a_message_past_max_message_mb_is_resource_exhausted(loop_thread, model_dirs):
    """A worker refuses a request larger than --max-message-mb before parsing it."""
    from inproc_workers import start_target

    worker = start_target(loop_thread, model_dirs["target"], max_message_mb=1)
    try:
        call, request = round_call("target", worker, "big", [5, 6, 7, 8])
        request.draft_dists.add(token_ids=list(range(100_000, 700_000)))  # ~1.8 MB on the wire
        err = rpc_error(call, request)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(worker.service.table) == 0
    finally:
        worker.stop()

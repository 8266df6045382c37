"""Draft and target workers over gRPC: rollback, resync, batching and concurrency.

Every check compares a worker's answer with an independent reference: a fresh uncached
forward of the same Hugging Face model, a fresh session given the full prefix, the same
request served one at a time, or the target model's own greedy decoding.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from rounds import (
    GREEDY,
    RPC_TIMEOUT_S,
    fresh_logits,
    generate,
    greedy_reference,
    propose_request,
    recorded_forwards,
    rpc_error,
    verify_request,
)
from transformers import AutoModelForCausalLM

from specdec.v1 import common_pb2

ATOL = 1e-4
GAMMA = 4
T1 = common_pb2.SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def target_model(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()


@pytest.fixture(scope="module")
def draft_model(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs["draft"]).eval()


@pytest.fixture(scope="module")
def batching_target(start_worker, model_dirs):
    """A target whose batches wait 50 ms, so concurrent calls share one forward pass."""
    return start_worker("target", model_dirs["target"], max_wait_ms=50.0)


@pytest.fixture(scope="module")
def ngram(start_worker, model_dirs):
    return start_worker("draft", model_dirs["target"], proposer="ngram", max_wait_ms=1.0)


def prompts(count: int, vocab: int, lengths=range(3, 41), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = list(lengths)
    return [
        torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=gen).tolist()
        for i in range(count)
    ]


def vocab_of(worker) -> int:
    return worker.service.table.vocab_size


def first_round(draft, target, name: str, wanted) -> tuple:
    """The first greedy round (over fixed prompts) whose num_accepted satisfies `wanted`."""
    for i, prompt in enumerate(prompts(40, vocab_of(target), range(6, 30), seed=1)):
        sid = f"{name}-{i}"
        proposal = draft.stub.Propose(propose_request(sid, prompt, GAMMA), timeout=RPC_TIMEOUT_S)
        result = target.stub.Verify(verify_request(sid, prompt, proposal), timeout=RPC_TIMEOUT_S)
        if wanted(result.num_accepted):
            return sid, prompt, result
        for worker in (draft, target):
            worker.stub.Release(common_pb2.ReleaseRequest(session_id=sid, epoch=1))
    pytest.fail(f"no round of 40 prompts had the wanted acceptance ({name})")


ROUND_KINDS = {
    "rejection": lambda n: 1 <= n < GAMMA,  # crop inside the block
    "rejection-at-first": lambda n: n == 0,
    "all-accepted": lambda n: n == GAMMA,  # bonus token; the draft holds all γ candidates
}


@pytest.mark.parametrize("kind", list(ROUND_KINDS))
def test_next_round_after_rollback_equals_a_fresh_forward(
    kind, draft, target, target_model, draft_model
):
    sid, prompt, first = first_round(draft, target, f"rollback-{kind}", ROUND_KINDS[kind])
    n = first.num_accepted
    history = prompt + list(first.output_ids)
    held = len(prompt) + n  # both workers hold the committed prefix up to here
    target_session = target.service.table.sessions[sid]
    assert target_session.tokens == history[:held] and target_session.kv_len == held

    # draft: its q̃ for the next round is the one a fresh session computes from scratch
    with recorded_forwards(draft.service.proposer.runtime) as calls:
        proposal = draft.stub.Propose(
            propose_request(sid, history, GAMMA, start=held, sampling=T1, seed=11),
            timeout=RPC_TIMEOUT_S,
        )
    # fed: the recovered/bonus token, and y_γ after a full acceptance (proposed, never fed)
    assert proposal.computed_tokens == 1 + (n == GAMMA)
    # its pass (alone here): one session, its first step as long as that delta
    assert (proposal.batch_size, proposal.batch_positions) == (1, proposal.computed_tokens)
    first_step = next(logits for s, _, logits in calls if s == sid)
    assert torch.allclose(first_step[-1], fresh_logits(draft_model, history)[-1], atol=ATOL)
    fresh = draft.stub.Propose(
        propose_request(sid + "-fresh", history, GAMMA, sampling=T1, seed=11),
        timeout=RPC_TIMEOUT_S,
    )
    assert fresh.computed_tokens == len(history)
    assert (fresh.batch_size, fresh.batch_positions) == (1, len(history))
    assert list(proposal.candidate_ids) == list(fresh.candidate_ids)
    for ours, theirs in zip(proposal.draft_dists, fresh.draft_dists, strict=True):
        ours_q = dict(zip(ours.token_ids, ours.weights))
        theirs_q = dict(zip(theirs.token_ids, theirs.weights))
        assert ours_q.keys() == theirs_q.keys()
        assert max(abs(ours_q[t] - theirs_q[t]) for t in ours_q) <= 2  # 16-bit wire weights

    # target: p of the next round is the target model's over the committed history
    candidates = list(proposal.candidate_ids)
    request = verify_request(sid, history, proposal, start=held, sampling=T1, seed=11)
    with recorded_forwards(target.service.engine.runtime) as calls:
        second = target.stub.Verify(request, timeout=RPC_TIMEOUT_S)
    assert second.computed_tokens == 1 + GAMMA  # the accepted prefix's KV was kept
    ((_, inputs, logits),) = [(s, x, z) for s, x, z in calls if s == sid]
    assert inputs == history[held:] + candidates
    expected = fresh_logits(target_model, history + candidates)[len(history) - 1 :]
    assert torch.allclose(logits, expected, atol=ATOL)
    log_p = expected.double().log_softmax(-1)
    outputs = list(second.output_ids)
    want = [float(log_p[i, token]) for i, token in enumerate(outputs)]
    assert list(second.output_logprobs) == pytest.approx(want, abs=ATOL)

    fresh = target.stub.Verify(
        verify_request(sid + "-fresh", history, proposal, sampling=T1, seed=11),
        timeout=RPC_TIMEOUT_S,
    )
    assert list(fresh.output_ids) == outputs
    assert list(fresh.output_logprobs) == pytest.approx(list(second.output_logprobs), abs=ATOL)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_mismatch_and_stale_epoch_refused_then_full_prefix_resyncs(role, draft, target):
    worker = draft if role == "draft" else target
    prompt = prompts(1, vocab_of(target), [24], seed=2)[0]
    sid = f"resync-{role}"

    def call(history, start, sid=sid, epoch=3):
        if role == "draft":
            req = propose_request(sid, history, GAMMA, start, T1, seed=5, epoch=epoch)
            return worker.stub.Propose, req
        req = verify_request(sid, history, [7, 8, 9], start, T1, seed=5, epoch=epoch)
        return worker.stub.Verify, req

    rpc, request = call(prompt, 0)
    rpc(request, timeout=RPC_TIMEOUT_S)

    # the coordinator's committed history diverges from the worker's at position 10
    history = prompt[:10] + [(prompt[10] + 1) % vocab_of(target)] + prompt[11:] + [42]
    rpc, request = call(history, len(prompt))
    err = rpc_error(rpc, request)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "base.base_fingerprint" in err.details()

    rpc, request = call(history, 0, epoch=2)
    err = rpc_error(rpc, request)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "base.epoch" in err.details()

    rpc, request = call(history, len(prompt), sid="resync-unknown")
    err = rpc_error(rpc, request)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "full prefix" in err.details()

    rpc, request = call(history, 0)
    resynced = rpc(request, timeout=RPC_TIMEOUT_S)
    assert resynced.computed_tokens == len(history) - 10 + (3 if role == "target" else 0)
    rpc, request = call(history, 0, sid=f"resync-{role}-fresh")
    fresh = rpc(request, timeout=RPC_TIMEOUT_S)
    if role == "draft":
        assert list(resynced.candidate_ids) == list(fresh.candidate_ids)
    else:
        assert list(resynced.output_ids) == list(fresh.output_ids)
        assert list(resynced.output_logprobs) == pytest.approx(
            list(fresh.output_logprobs), abs=ATOL
        )


def concurrently(call, requests) -> list:
    """Issue all requests at once from their own threads; responses in request order."""
    barrier = threading.Barrier(len(requests))

    def one(request):
        barrier.wait(timeout=RPC_TIMEOUT_S)
        return call(request, timeout=RPC_TIMEOUT_S)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


MIXED = [
    GREEDY,
    common_pb2.SamplingParams(temperature=0.9, top_p=0.8),  # top-p
    common_pb2.SamplingParams(temperature=1.0),  # plain seeded sampling
    common_pb2.SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
]


@pytest.mark.parametrize("mix", ["greedy", "mixed"])
def test_batched_verify_equals_one_at_a_time(mix, draft, batching_target):
    """10 sessions of different lengths and γ (0 = plain decoding), 3 rounds each."""
    target = batching_target
    gammas = [0, 1, 2, 3, 4, 5, 6, 8, 3, 1]
    histories = prompts(10, vocab_of(target), [3, 5, 8, 12, 17, 23, 30, 38, 45, 60], seed=4)
    samplings = [GREEDY if mix == "greedy" else MIXED[i % len(MIXED)] for i in range(10)]
    held = [0] * 10
    batch_sizes = []
    for _ in range(3):
        requests = []
        for i, (history, gamma, sampling) in enumerate(zip(histories, gammas, samplings)):
            proposal = None
            if gamma:
                proposal = draft.stub.Propose(
                    propose_request(f"{mix}-{i}", history, gamma, held[i], sampling, seed=i),
                    timeout=RPC_TIMEOUT_S,
                )
            request = verify_request(f"{mix}-batched-{i}", history, proposal, held[i], sampling, i)
            requests.append(request)
        batched = concurrently(target.stub.Verify, requests)
        batch_sizes += [r.batch_size for r in batched]
        for i, (request, together) in enumerate(zip(requests, batched)):
            request.base.session_id = f"{mix}-single-{i}"
            alone = target.stub.Verify(request, timeout=RPC_TIMEOUT_S)
            assert alone.batch_size == 1
            assert (alone.num_accepted, list(alone.output_ids)) == (
                together.num_accepted,
                list(together.output_ids),
            ), f"session {i} ({samplings[i]})"
            assert list(together.output_logprobs) == pytest.approx(
                list(alone.output_logprobs), abs=ATOL
            )
            held[i] = len(histories[i]) + together.num_accepted
            histories[i] += list(together.output_ids)
    assert max(batch_sizes) > 1, batch_sizes


def test_32_concurrent_sessions_through_both_workers_match_greedy_decoding(
    draft, target, target_model
):
    count, new_tokens = 32, 12
    session_prompts = prompts(count, vocab_of(target), range(3, 35), seed=5)
    barrier = threading.Barrier(count)

    def run(i: int):
        barrier.wait(timeout=RPC_TIMEOUT_S)
        return generate(draft.stub, target.stub, f"many-{i}", session_prompts[i], new_tokens, 3)

    with ThreadPoolExecutor(count) as pool:
        runs = list(pool.map(run, range(count)))
    for i, (prompt, result) in enumerate(zip(session_prompts, runs)):
        assert result.tokens == greedy_reference(target_model, prompt, new_tokens), f"session {i}"
    assert len({tuple(r.tokens) for r in runs}) == count  # cross-talk would be visible
    accepted = [a for r in runs for a in r.accepted]
    assert 0 in accepted and 3 in accepted  # both rejections and full acceptances happened
    assert max(b for r in runs for b in r.batch_sizes) > 1


@torch.inference_mode()
def prompt_the_target_repeats(model, vocab: int) -> tuple[list[int], list[int]]:
    """A prompt ending in a trigram seen before, followed there by the very token t that
    the target predicts next: so the n-gram proposal's first candidate is accepted.

    Returns (prompt, the continuation after the earlier trigram). t is found by one
    batched forward over every choice of t (a fixed point exists for most random heads).
    """
    gen = torch.Generator().manual_seed(8)
    key = [21, 22, 23]
    for _ in range(20):
        head = torch.randint(24, vocab, (8,), generator=gen).tolist()
        tail = torch.randint(24, vocab, (4,), generator=gen).tolist()
        batch = torch.tensor([head + key + [t] + tail + key for t in range(vocab)])
        predicted = model(input_ids=batch).logits[:, -1].argmax(-1)  # [vocab]
        fixed = (predicted == torch.arange(vocab)).nonzero().flatten().tolist()
        if fixed:
            return head + key + [fixed[0]] + tail + key, [fixed[0], *tail]
    pytest.fail("no prompt found whose continuation the target repeats")


def test_ngram_proposer_continues_a_repeated_pattern(ngram, target, target_model):
    info = ngram.stub.Info(common_pb2.InfoRequest())
    assert info.proposer == "ngram"
    pattern = [11, 12, 13, 14, 15]
    prompt = [3, *pattern, 7, *pattern, 9, *pattern[:2]]  # ends with 11, 12
    response = ngram.stub.Propose(propose_request("ngram-1", prompt, 4), timeout=RPC_TIMEOUT_S)
    assert response.token_only and not response.draft_dists
    assert list(response.candidate_ids) == [13, 14, 15, 9]  # the most recent occurrence
    response = ngram.stub.Propose(
        propose_request("ngram-2", [1, 2, 3, 4, 5], 4, sampling=T1), timeout=RPC_TIMEOUT_S
    )
    assert response.token_only and list(response.candidate_ids) == []  # no earlier match


def test_ngram_drafts_verify_greedy_exact(ngram, target, target_model):
    repeated, continuation = prompt_the_target_repeats(target_model, vocab_of(target))
    response = ngram.stub.Propose(
        propose_request("ngram-repeat", repeated, 4), timeout=RPC_TIMEOUT_S
    )
    assert list(response.candidate_ids) == continuation[:4]
    starts = [repeated, *prompts(3, vocab_of(target), [6, 20, 33], seed=6)]
    for i, start in enumerate(starts):
        run = generate(ngram.stub, target.stub, f"ngram-gen-{i}", start, 24, gamma=4)
        assert run.tokens == greedy_reference(target_model, start, 24), f"prompt {i}"
        if i == 0:
            assert run.accepted[0] >= 1  # an accepted n-gram candidate, still exact

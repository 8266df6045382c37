"""Speculative rounds against workers, driven the way a coordinator drives them.

Delta rule used throughout: after a round on base_len L with n candidates accepted, both
workers hold the committed prefix of length L + n (the draft also holds its rejected
candidates, the target nothing past them), so the next round's delta starts at L + n.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import grpc
import torch

from specdec.core.prefix import fingerprint
from specdec.v1 import common_pb2, draft_pb2, target_pb2

GREEDY = common_pb2.SamplingParams()
RPC_TIMEOUT_S = 60


def base(session_id: str, history: list[int], epoch: int = 1) -> common_pb2.Base:
    return common_pb2.Base(
        session_id=session_id,
        epoch=epoch,
        base_len=len(history),
        base_fingerprint=fingerprint(history),
    )


def delta(history: list[int], start: int = 0) -> common_pb2.TokenDelta:
    return common_pb2.TokenDelta(start=start, token_ids=history[start:])


def propose_request(
    session_id, history, gamma, start=0, sampling=GREEDY, seed=0, epoch=1
) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        base=base(session_id, history, epoch),
        delta=delta(history, start),
        num_speculative_tokens=gamma,
        sampling=sampling,
        seed=seed,
    )


def verify_request(
    session_id, history, proposal=None, start=0, sampling=GREEDY, seed=0, epoch=1, logprobs=True
) -> target_pb2.VerifyRequest:
    """Verify `proposal`'s candidates (a ProposeResponse, or a list of token ids)."""
    if proposal is None or isinstance(proposal, list):
        candidates, dists = proposal or [], []
    else:
        candidates, dists = list(proposal.candidate_ids), list(proposal.draft_dists)
    return target_pb2.VerifyRequest(
        base=base(session_id, history, epoch),
        delta=delta(history, start),
        candidate_ids=candidates,
        draft_dists=dists,
        sampling=sampling,
        seed=seed,
        return_logprobs=logprobs,
    )


@dataclass
class Generation:
    """One session's run: tokens generated and what the workers reported per round."""

    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)


def generate(
    draft_stub,
    target_stub,
    session_id: str,
    prompt: list[int],
    new_tokens: int,
    gamma: int,
    sampling=GREEDY,
    seed: int = 0,
) -> Generation:
    """Propose → Verify rounds until `new_tokens` tokens are committed."""
    history, held, out = list(prompt), 0, Generation()
    while len(history) - len(prompt) < new_tokens:
        left = new_tokens - (len(history) - len(prompt))
        proposal = draft_stub.Propose(
            propose_request(session_id, history, gamma, held, sampling, seed),
            timeout=RPC_TIMEOUT_S,
        )
        request = verify_request(session_id, history, proposal, held, sampling, seed)
        request.max_output_tokens = left
        result = target_stub.Verify(request, timeout=RPC_TIMEOUT_S)
        held = len(history) + result.num_accepted
        history += list(result.output_ids)
        out.accepted.append(result.num_accepted)
        out.batch_sizes.append(result.batch_size)
    out.tokens = history[len(prompt) :]
    return out


@torch.inference_mode()
def greedy_reference(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy decoding: argmax of a full forward, token by token."""
    history = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([history])).logits[0, -1]
        history.append(int(logits.argmax()))
    return history[len(prompt) :]


@torch.inference_mode()
def fresh_logits(model, history: list[int]) -> torch.Tensor:
    """Logits [len(history), vocab] of one uncached forward over the whole history."""
    return model(input_ids=torch.tensor([history])).logits[0].float()


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """Run a call that must fail and return its error (fails the test when it succeeds)."""
    try:
        call(*args, timeout=RPC_TIMEOUT_S, **kwargs)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{call} succeeded but should have failed")


@contextlib.contextmanager
def recorded_forwards(runtime):
    """Record (session_id, inputs, logits) of every ModelRuntime.forward while active (the
    logits it returned: with `keep`, only the last positions)."""
    calls: list[tuple[str, list[int], torch.Tensor]] = []
    original = runtime.forward

    def forward(sessions, inputs, keep=None):
        logits = original(sessions, inputs, keep=keep)
        calls.extend(
            (s.session_id, list(x), rows.clone()) for s, x, rows in zip(sessions, inputs, logits)
        )
        return logits

    runtime.forward = forward
    try:
        yield calls
    finally:
        del runtime.forward  # back to the class method

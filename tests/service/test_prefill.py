"""Prefill computes a long prompt's KV in chunks; the next Verify then only feeds the last
token plus its candidates, and its result equals a session that never prefilled."""

from __future__ import annotations

import torch
from rounds import base, delta, verify_request

from specdec.v1 import target_pb2


def test_chunked_prefill_then_verify(model_dirs, start_worker):
    worker = start_worker("target", model_dirs["target"], prefill_chunk=64)
    vocab = worker.service.engine.runtime.vocab_size
    prompt = torch.randint(1, vocab, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = worker.stub.Prefill(
        target_pb2.PrefillRequest(base=base("long", prompt), delta=delta(prompt)), timeout=60
    )
    assert prefill.kv_len == len(prompt) - 1  # the last prompt token is fed by Verify
    candidates = prompt[-3:]
    after = worker.stub.Verify(
        verify_request("long", prompt, candidates, start=len(prompt)), timeout=60
    )
    assert after.computed_tokens == 1 + len(candidates)
    fresh = worker.stub.Verify(verify_request("fresh", prompt, candidates), timeout=60)
    assert fresh.computed_tokens == len(prompt) + len(candidates)
    assert list(after.output_ids) == list(fresh.output_ids)
    assert torch.allclose(
        torch.tensor(after.output_logprobs), torch.tensor(fresh.output_logprobs), atol=1e-4
    )

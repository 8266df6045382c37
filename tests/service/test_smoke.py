from __future__ import annotations

from specdec.core.prefix import fingerprint
from specdec.v1 import common_pb2, draft_pb2, target_pb2


def test_propose_then_verify_round(draft, target):
    prompt = [5, 6, 7, 8, 9]
    base = common_pb2.Base(
        session_id="s1", epoch=1, base_len=len(prompt), base_fingerprint=fingerprint(prompt)
    )
    delta = common_pb2.TokenDelta(start=0, token_ids=prompt)
    sampling = common_pb2.SamplingParams(temperature=0.8)
    proposal = draft.stub.Propose(
        draft_pb2.ProposeRequest(
            base=base, delta=delta, num_speculative_tokens=4, sampling=sampling, seed=3
        )
    )
    assert len(proposal.candidate_ids) == 4 and len(proposal.draft_dists) == 4
    result = target.stub.Verify(
        target_pb2.VerifyRequest(
            base=base,
            delta=delta,
            candidate_ids=proposal.candidate_ids,
            draft_dists=proposal.draft_dists,
            sampling=sampling,
            seed=3,
        )
    )
    assert len(result.output_ids) == result.num_accepted + 1
    print(result)

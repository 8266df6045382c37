"""The whole system, real processes and Redis: greedy exactness, streams, distribution, seeds,
stops, log-probabilities and the counters /metrics serves. Sessions and refused requests:
test_generate_sessions.py and test_generate_limits.py."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.core.params import SamplingParams
from specdec.core.sampling import probs_from_logits
from specdec.v1 import common_pb2, coordinator_pb2

PROMPTS = [
    "def add(a, b):",
    "class Point:\n    def",
    "import os\n",
    "for i in range(10):\n    print(",
]


def hf_greedy(hf, prompt: str, n: int) -> list[int]:
    model, tokenizer = hf
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(
        ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    return out[0, ids.shape[1] :].tolist()


def request(
    prompt="def add(a, b):", gamma=None, session_id="", **sampling
) -> coordinator_pb2.GenerateRequest:
    sampling.setdefault("max_new_tokens", 24)
    sampling.setdefault("ignore_eos", True)
    req = coordinator_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(**sampling), session_id=session_id
    )
    if gamma is not None:
        req.speculation.num_speculative_tokens = gamma
    return req


@pytest.mark.parametrize("gamma", [None, 0, 1, 3, 6])
def test_greedy_equals_target_generate(stub, hf, gamma):
    for prompt in PROMPTS:
        response = stub.Generate(request(prompt, gamma), timeout=60)
        assert list(response.token_ids) == hf_greedy(hf, prompt, 24), (prompt, gamma)
        assert response.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
        assert response.text == hf[1].decode(list(response.token_ids), skip_special_tokens=True)
        stats = response.stats
        assert stats.generated_tokens == 24 and stats.prompt_tokens == len(hf[1].encode(prompt))
        if gamma:
            assert stats.draft_tokens > 0 and stats.rounds < 24 + 1
        if gamma == 0:
            assert stats.draft_tokens == 0 and stats.rounds == 24


def test_stream_chunks_are_contiguous_and_match_generate(stub):
    chunks = list(stub.GenerateStream(request(gamma=3, max_new_tokens=30), timeout=60))
    offsets = [c.offset for c in chunks]
    tokens = [t for c in chunks for t in c.token_ids]
    assert offsets[0] == 0 and len(tokens) == 30
    assert all(b == a + len(c.token_ids) for a, b, c in zip(offsets, offsets[1:], chunks))
    assert chunks[-1].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    assert list(stub.Generate(request(gamma=3, max_new_tokens=30), timeout=60).token_ids) == tokens


def exact_first_two(hf, prompt: str, params: SamplingParams) -> dict[tuple[int, int], float]:
    model, tokenizer = hf
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        p1 = probs_from_logits(model(torch.tensor([ids])).logits[0, -1], params)
        joint = {}
        for a in p1.nonzero().flatten().tolist():
            p2 = probs_from_logits(model(torch.tensor([ids + [a]])).logits[0, -1], params)
            for b in p2.nonzero().flatten().tolist():
                joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def chi_square(samples: list[tuple[int, int]], joint: dict) -> float:
    if any(s not in joint for s in samples):
        return 0.0
    cells = sorted(joint)
    observed = [sum(1 for s in samples if s == c) for c in cells]
    expected = [joint[c] * len(samples) for c in cells]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.slow
def test_distribution_of_first_two_tokens_matches_target(stub, hf):
    """Temperature 1 with top-k 3: 9 possible (token, token) pairs, exact target probabilities."""
    prompt, params = "def add(a, b):", SamplingParams(temperature=1.0, top_k=3)
    samples = []
    for seed in range(600):
        response = stub.Generate(
            request(prompt, gamma=2, temperature=1.0, top_k=3, seed=seed, max_new_tokens=2),
            timeout=30,
        )
        samples.append(tuple(response.token_ids))
    assert chi_square(samples, exact_first_two(hf, prompt, params)) > 1e-3
    # negative control: the same samples must be rejected against a different distribution
    wrong = exact_first_two(hf, prompt, SamplingParams(temperature=0.4, top_k=3))
    assert chi_square(samples, wrong) < 1e-4


def test_seeded_sampling_is_reproducible(stub):
    first = stub.Generate(
        request(gamma=3, temperature=0.9, top_p=0.9, seed=1234, max_new_tokens=20), timeout=60
    )
    second = stub.Generate(
        request(gamma=3, temperature=0.9, top_p=0.9, seed=1234, max_new_tokens=20), timeout=60
    )
    other = stub.Generate(
        request(gamma=3, temperature=0.9, top_p=0.9, seed=999, max_new_tokens=20), timeout=60
    )
    assert list(first.token_ids) == list(second.token_ids)
    assert list(first.token_ids) != list(other.token_ids)


def test_stop_strings_tokens_and_eos(stub, hf):
    _, tokenizer = hf
    full = stub.Generate(request(gamma=2, max_new_tokens=24), timeout=60)
    text = full.text
    stop = text[5:8]
    stopped = stub.Generate(request(gamma=2, max_new_tokens=24, stop=[stop]), timeout=60)
    assert stopped.finish_reason == coordinator_pb2.FINISH_REASON_STOP
    assert stopped.text == text[: text.index(stop)] and stop not in stopped.text
    stop_id = full.token_ids[4]
    by_id = stub.Generate(request(gamma=2, max_new_tokens=24, stop_token_ids=[stop_id]), timeout=60)
    assert by_id.finish_reason == coordinator_pb2.FINISH_REASON_STOP
    assert list(by_id.token_ids) == list(full.token_ids)[: list(full.token_ids).index(stop_id) + 1]


def test_prometheus_metrics(model_dirs):
    """Each service serves /metrics; after a request the counters a user alerts on are there."""
    import urllib.request

    from specdec.launcher.stack import Stack, StackSettings
    from specdec.serving.redis_embedded import free_port

    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        coordinator_args=["--metrics-port", str(ports["coordinator"])],
        target_args=["--metrics-port", str(ports["target"])],
        draft_args=["--metrics-port", str(ports["draft"])],
    )
    with Stack(settings) as stack:
        from specdec.client import Client

        with Client(stack.address) as client:
            client.generate(
                "def add(a, b):", max_new_tokens=12, num_speculative_tokens=2, ignore_eos=True
            )
        scrape = {
            name: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
            .read()
            .decode()
            for name, port in ports.items()
        }
    assert sample(scrape["coordinator"], "specdec_requests_total", finish_reason="LENGTH") == 1.0
    assert sample(scrape["coordinator"], "specdec_generated_tokens_total") == 12.0
    assert sample(scrape["coordinator"], "specdec_round_seconds_count") >= 1.0
    assert sample(scrape["coordinator"], "specdec_spec_decode_num_draft_tokens_total") >= 2.0
    for role in ("target", "draft"):
        assert (sample(scrape[role], "specdec_worker_batch_size_count", role=role) or 0) >= 1.0, (
            scrape[role][-1500:]
        )
        assert sample(scrape[role], "specdec_worker_requests_total", role=role, code="OK") >= 1.0
        assert sample(scrape[role], "specdec_worker_sessions", role=role) is not None


def sample(text: str, name: str, **labels) -> float | None:
    """Value of the first sample called `name` whose labels include `labels` (None if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_long_prompt_goes_through_chunked_prefill(stub, hf):
    """A prompt above --prefill-threshold is prefilled in chunks first; output stays exact."""
    model, tokenizer = hf
    prompt = torch.randint(
        1, len(tokenizer), (300,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    req = coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_new_tokens=16, ignore_eos=True),
    )
    req.speculation.num_speculative_tokens = 3
    response = stub.Generate(req, timeout=60)
    ids = torch.tensor([prompt])
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
    )
    assert list(response.token_ids) == expected[0, len(prompt) :].tolist()


def test_async_client_equals_sync_client(stack):
    import asyncio

    from specdec.client import AsyncClient, Client

    async def run():
        client = AsyncClient(stack.address)
        try:
            chunks = [
                c async for c in client.stream("def add(a, b):", max_new_tokens=20, ignore_eos=True)
            ]
            whole = await client.generate("def add(a, b):", max_new_tokens=20, ignore_eos=True)
            return chunks, whole
        finally:
            await client.close()

    chunks, whole = asyncio.run(run())
    with Client(stack.address) as client:
        expected = client.generate("def add(a, b):", max_new_tokens=20, ignore_eos=True)
    assert (
        [t for c in chunks for t in c.token_ids]
        == list(whole.token_ids)
        == list(expected.token_ids)
    )
    assert (
        whole.text == expected.text and whole.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    )


# --- log-probabilities: the target's, so they equal Hugging Face's at the same positions ---


def hf_logprobs(hf, prompt_ids: list[int], tokens: list[int], temperature=0.0, top_p=1.0):
    """log p of each token given the prompt and the tokens before it, from one HF forward:
    the raw log-softmax for greedy, else after HF's own temperature and top-p warpers."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    model, _ = hf
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    if temperature > 0:
        logits = TemperatureLogitsWarper(temperature)(ids, logits)
        if top_p < 1.0:
            logits = TopPLogitsWarper(top_p)(ids, logits)
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("gamma", [0, 2, 5])
@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_logprobs_equal_hugging_face_whatever_gamma(stub, hf, gamma, mode):
    sampling = dict(temperature=0.8, top_p=0.9, seed=3) if mode == "sampling" else {}
    req = request("def add(a, b):", gamma, max_new_tokens=20, **sampling)
    req.return_logprobs, req.top_logprobs = True, 3
    response = stub.Generate(req, timeout=60)
    tokens = list(response.token_ids)
    prompt_ids = hf[1].encode("def add(a, b):")
    lp = hf_logprobs(
        hf, prompt_ids, tokens, **({} if mode == "greedy" else dict(temperature=0.8, top_p=0.9))
    )
    assert len(response.logprobs) == len(tokens) == len(response.top_logprobs) == 20
    want = lp[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(
        torch.tensor(list(response.logprobs), dtype=torch.float64), want, atol=2e-4
    )
    for i, top in enumerate(response.top_logprobs):
        values, ids = lp[i].topk(3)
        kept = values > float("-inf")
        assert list(top.token_ids) == ids[kept].tolist(), i
        assert list(top.logprobs) == pytest.approx(values[kept].tolist(), abs=2e-4)


def test_logprobs_negative_control_wrong_position_fails(stub, hf):
    """The comparison above can fail: shifted by one position, HF's values no longer match."""
    req = request("def add(a, b):", 2, max_new_tokens=12)
    req.return_logprobs = True
    response = stub.Generate(req, timeout=60)
    tokens = list(response.token_ids)
    lp = hf_logprobs(hf, hf[1].encode("def add(a, b):") + tokens[:1], tokens[1:])
    shifted = lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    got = torch.tensor(list(response.logprobs)[:-1], dtype=torch.float64)
    assert not torch.allclose(got, shifted, atol=2e-4)


def test_a_resumed_stream_gets_the_stored_logprobs(stub):
    req = request("import os\n", 3, max_new_tokens=16, session_id="logprob-resume")
    req.return_logprobs, req.top_logprobs = True, 2
    whole = stub.Generate(req, timeout=60)
    again = coordinator_pb2.GenerateRequest(session_id="logprob-resume", resume_from=5)
    chunks = list(stub.GenerateStream(again, timeout=60))
    logprobs = [lp for c in chunks for lp in c.logprobs]
    tops = [list(t.token_ids) for c in chunks for t in c.top_logprobs]
    assert logprobs == list(whole.logprobs)[5:]
    assert tops == [list(t.token_ids) for t in whole.top_logprobs][5:]

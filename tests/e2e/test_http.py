"""The OpenAI-compatible HTTP API of a real stack, called with the official `openai` package
(a client nobody here wrote) and with raw HTTP: chat and completions, streaming and not,
greedy output equal to gRPC Generate and to Hugging Face `generate`, errors in OpenAI's
shape with the documented status, API keys, a disconnect that cancels, and a schema-based
fuzz run (schemathesis) over the OpenAPI document the gateway serves: no 5xx."""

from __future__ import annotations

import collections
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from test_generate import hf_greedy

from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port
from specdec.v1 import coordinator_pb2

pytestmark = pytest.mark.slow
KEY = "http-test-key"
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def stack(model_dirs):
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        http_port=free_port(),
        api_keys=[KEY],
    )
    with Stack(settings) as running:
        yield running


@pytest.fixture(scope="module")
def model(stack):
    return stack.settings.target_model.rstrip("/").rsplit("/", 1)[-1]


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=60)


def grpc_greedy(stack, prompt, n, **kwargs) -> coordinator_pb2.GenerateResponse:
    with Client(stack.address, **stack.client_options()) as client:
        return client.generate(prompt, max_new_tokens=n, ignore_eos=True, temperature=0, **kwargs)


def test_models_lists_the_served_model(oai, model):
    assert [m.id for m in oai.models.list().data] == [model]


@pytest.mark.parametrize("gamma", [None, 0, 3])
def test_completion_equals_grpc_and_hf_greedy(stack, oai, hf, model, gamma):
    extra = {"ignore_eos": True}
    if gamma is not None:
        extra["num_speculative_tokens"] = gamma
    out = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra
    )
    reference = grpc_greedy(stack, PROMPT, 20)
    assert list(reference.token_ids) == hf_greedy(hf, PROMPT, 20)
    assert out.choices[0].text == reference.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == len(hf[1].encode(PROMPT))
    spec = out.model_extra["speculation"]
    assert spec["accepted_tokens"] <= spec["draft_tokens"]
    assert sum(spec["rounds_per_gamma"]) == spec["rounds"]
    assert spec["verify_forward_ms"] > 0  # the workers' own pass times
    if gamma == 0:
        assert spec["draft_tokens"] == 0 and spec["rounds"] == 20
        assert spec["rounds_per_gamma"] == [20]
        assert spec["draft_forward_ms"] == 0  # no proposals, no draft passes
    else:
        assert len(spec["accepted_per_position"]) >= 1
        assert spec["draft_forward_ms"] > 0


def test_token_id_prompt_and_streamed_completion(stack, oai, model, hf):
    ids = hf[1].encode(PROMPT)
    whole = oai.completions.create(
        model=model, prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        oai.completions.create(
            model=model,
            prompt=ids,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text == grpc_greedy(stack, ids, 16).text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_completion_logprobs_are_the_grpc_ones_streamed_or_not(stack, oai, model):
    with Client(stack.address, **stack.client_options()) as client:
        reference = client.generate(
            PROMPT,
            max_new_tokens=12,
            ignore_eos=True,
            temperature=0,
            return_logprobs=True,
            top_logprobs=3,
        )
    out = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    block = out.choices[0].logprobs
    assert block.token_logprobs == pytest.approx(list(reference.logprobs), abs=1e-4)
    assert len(block.tokens) == 12 and all(len(top) >= 1 for top in block.top_logprobs)
    assert "".join(block.tokens) == out.choices[0].text
    streamed = [
        lp
        for chunk in oai.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if chunk.choices and chunk.choices[0].logprobs
        for lp in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(list(reference.logprobs), abs=1e-4)


def test_chat_is_refused_clearly_without_a_chat_template(oai, model):
    """The tiny code model has no chat template: 400 naming messages, OpenAI's error shape."""
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == "messages"
    assert info.value.body["type"] == "invalid_request_error"


def post(stack, path, body, key=KEY, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(stack.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": PROMPT, "max_tokens": 4, "temperature": -1}, 400, "temperature"),
        ({"prompt": PROMPT, "max_tokens": 4, "top_p": 0}, 400, "top_p"),
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 10**7}, 400, "max_tokens"),
        ({"prompt": PROMPT, "n": 2}, 400, "n"),
        ({"prompt": PROMPT, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
        ({"prompt": PROMPT, "stop": ["x"] * 40}, 400, "stop"),
        ({"prompt": PROMPT, "no_such_field": 1}, 400, "no_such_field"),
        ({"prompt": [10**9]}, 400, "prompt"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": PROMPT, "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ],
)
def test_bad_requests_get_400_naming_the_field(stack, model, body, status, param):
    code, payload = post(stack, "/completions", {"model": model, **body})
    assert code == status, payload
    assert payload["error"]["param"] == param, payload
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]


def test_auth_model_and_body_errors(stack, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    code, payload = post(stack, "/completions", body, key=None)
    assert code == 401 and payload["error"]["code"] == "invalid_api_key"
    code, payload = post(stack, "/completions", body, key="wrong")
    assert code == 401 and payload["error"]["message"] == "invalid API key"
    code, payload = post(stack, "/completions", {**body, "model": "gpt-4"})
    assert code == 404 and payload["error"]["param"] == "model"
    code, payload = post(stack, "/completions", None, raw=b"{not json")
    assert code == 400 and "error" in payload
    with urllib.request.urlopen(stack.http_url.removesuffix("/v1") + "/health", timeout=5) as r:
        assert r.status == 200  # health needs no key


def test_openai_client_errors_are_typed(stack, model):
    bad = openai.OpenAI(base_url=stack.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt=PROMPT, max_tokens=2)


def test_a_client_that_disconnects_mid_stream_cancels_its_session(stack, model):
    """Read a few events of a long stream, close the connection: the session ends CANCELLED
    long before its max_tokens (read back over gRPC)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        stack.http_url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    response = urllib.request.urlopen(request, timeout=60)
    first = b""
    while b"data: {" not in first:
        first += response.readline()
    session = json.loads(first.split(b"data: ", 1)[1])["id"].removeprefix("cmpl-")
    response.close()
    with Client(stack.address, **stack.client_options()) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = client.get_session(session)
            if info.status == coordinator_pb2.SESSION_STATUS_FINISHED:
                break
            time.sleep(0.2)
    assert info.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED
    assert len(info.generated_token_ids) < 400


def test_the_grpc_api_is_unchanged_beside_it(stack):
    with Client(stack.address, api_key="") as client, pytest.raises(grpc.RpcError) as info:
        client.generate(PROMPT, max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_schema_fuzz_finds_no_server_error(stack, model):
    """schemathesis generates requests from the served OpenAPI document (bounded): every
    answer is below 500."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(stack.http_url.removesuffix("/v1") + "/openapi.json")
    failures, statuses = [], []

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=schema.as_strategy())
    def check(case):
        if isinstance(case.body, dict):  # past the model check, into the real validation
            case.body["model"] = model
        response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            failures.append((case.path, response.status_code, json.dumps(case.body)[:300]))

    check()
    assert failures == []
    assert len(statuses) >= 100, "the fuzzer barely ran"
    tally = collections.Counter(statuses)
    assert tally[200] >= 10 and tally[400] >= 10, tally


def test_a_body_past_the_message_limit_is_413_before_it_is_read(stack):
    """Only the headers are sent (Content-Length 5 MiB, limit 4 MiB): the answer comes
    without the body, so nothing that large was buffered."""
    import http.client
    import urllib.parse

    url = urllib.parse.urlsplit(stack.http_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(5 << 20))
    conn.endheaders()
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    assert response.status == 413 and "--max-message-mb" in payload["error"]["message"]

"""Limits on every field of the public API, checked before any work, through the real stack:
each refusal names the field and never echoes a huge input; a session under attack still
produces its reference output."""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

S = common_pb2.SamplingParams
CHAT = coordinator_pb2.ChatMessage


def generate(stub, timeout=30, **fields):
    fields.setdefault("prompt", "def add(a, b):")
    return stub.Generate(coordinator_pb2.GenerateRequest(**fields), timeout=timeout)


def refused(stub, code=grpc.StatusCode.INVALID_ARGUMENT, **fields) -> str:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **fields)
    assert info.value.code() == code, info.value.details()
    assert len(info.value.details()) < 300  # the input is never echoed back whole
    return info.value.details()


LIMITS = [
    (dict(sampling=S(stop=["x"] * 17)), "sampling.stop: 17 strings exceed --max-stop-sequences 16"),
    (dict(sampling=S(stop=["y" * 257])), "sampling.stop[0] must have 1 to 256 characters, got 257"),
    (dict(sampling=S(stop=["ok", ""])), "sampling.stop[1] must have 1 to 256 characters, got 0"),
    (dict(sampling=S(stop_token_ids=[1] * 65)), "sampling.stop_token_ids: 65 ids exceed"),
    (dict(prompt="z" * 300_000), "prompt: 300000 bytes exceed --max-prompt-bytes 262144"),
    (dict(prompt="", prompt_token_ids=[1] * 5000), "prompt_token_ids: 5000 tokens exceed"),
    (dict(sampling=S(max_new_tokens=600)), "exceed the target context of 512 tokens"),
    (dict(sampling=S(temperature=float("nan"))), "sampling.temperature must be finite"),
    (dict(sampling=S(min_p=float("inf"))), "sampling.min_p must be finite"),
    (dict(session_id="s" * 129), "session_id must be 1 to 128 characters"),
    (dict(session_id="a b"), "session_id must be 1 to 128 characters"),
    (dict(messages=[CHAT(role="user", content="hi")]), "prompt and messages are exclusive"),
    (
        dict(prompt="", prompt_token_ids=[1], messages=[CHAT(role="user", content="hi")]),
        "prompt_token_ids and messages are exclusive",
    ),
    (dict(prompt="", messages=[CHAT(role="tool", content="x")]), "messages[0].role must be one of"),
    (
        dict(prompt="", messages=[CHAT(role="user", content="x")] * 257),
        "messages: 257 messages exceed --max-messages 256",
    ),
    (
        dict(prompt="", messages=[CHAT(role="user", content="z" * 200_000)] * 2),
        "messages: 400000 bytes of content exceed --max-prompt-bytes 262144",
    ),
    # the tiny test tokenizer has no chat template
    (
        dict(prompt="", messages=[CHAT(role="user", content="hi")]),
        "messages: the target model has no chat template",
    ),
]


@pytest.mark.parametrize(("fields", "message"), LIMITS, ids=[m[:30] for _, m in LIMITS])
def test_each_limit_names_the_field(stub, fields, message):
    assert message in refused(stub, **fields)


def test_get_and_cancel_check_the_session_id(stub):
    for call, cls in (
        (stub.GetSession, coordinator_pb2.GetSessionRequest),
        (stub.CancelSession, coordinator_pb2.CancelSessionRequest),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(cls(session_id="x" * 10_000), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "(got 10000 characters)" in info.value.details()


def test_a_tiny_temperature_is_greedy(stub):
    """1e-40 would overflow float32 logits into NaN; below 1e-5 a request is greedy."""
    greedy = generate(stub, sampling=S(max_new_tokens=12, ignore_eos=True))
    tiny = generate(stub, sampling=S(temperature=1e-40, max_new_tokens=12, ignore_eos=True))
    assert list(tiny.token_ids) == list(greedy.token_ids) and len(greedy.token_ids) == 12


def raw_call(address: str, method: str, payload: bytes):
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(
            f"/specdec.v1.Coordinator/{method}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=10)
        return info.value
    finally:
        channel.close()


def test_bytes_that_are_not_a_message_are_invalid_argument(stack):
    for payload in (b"\xff\xff\xff\xff garbage", b"\x0a\x05ab\xff\xfecd"):  # junk; bad UTF-8
        err = raw_call(stack.address, "Generate", payload)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid specdec.v1.GenerateRequest" in err.details()
    err = raw_call(stack.address, "GetSession", b"\x0a\x02\xc3\x28")  # invalid UTF-8 id
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_oversized_message_is_resource_exhausted(stack):
    request = coordinator_pb2.GenerateRequest(prompt="p" * (5 << 20))  # 5 MiB > 4 MiB
    channel = grpc.insecure_channel(
        stack.address, options=[("grpc.max_send_message_length", 16 << 20)]
    )
    try:
        with pytest.raises(grpc.RpcError) as info:
            coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()


def test_stream_caps_give_resource_exhausted(stack):
    """At --max-streams-per-session a second stream on a session is refused, at --max-streams
    any further call; the running streams are unharmed and the caps free up afterwards."""
    from specdec.serving.redis_embedded import free_port

    port = free_port()
    extra = ["--max-streams", "2", "--max-streams-per-session", "1"]
    child = stack.add_coordinator(port, name="coordinator-streams", extra=extra)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    limited = coordinator_pb2_grpc.CoordinatorStub(channel)

    def stream(session_id):
        return limited.GenerateStream(
            coordinator_pb2.GenerateRequest(
                prompt="def f(x):",
                session_id=session_id,
                sampling=S(max_new_tokens=300, ignore_eos=True),
            ),
            timeout=60,
        )

    try:
        first_stream = stream("capped-1")
        first = next(first_stream)
        with pytest.raises(grpc.RpcError) as info:
            next(stream("capped-1"))  # a second follower of the same session
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max-streams-per-session" in info.value.details()
        second_stream = stream("capped-2")
        second = next(second_stream)
        with pytest.raises(grpc.RpcError) as info:
            generate(limited, sampling=S(max_new_tokens=4))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams)" in info.value.details()
        for head, rest in ((first, first_stream), (second, second_stream)):
            tokens = list(head.token_ids) + [t for chunk in rest for t in chunk.token_ids]
            assert len(tokens) == 300
        assert len(generate(limited, sampling=S(max_new_tokens=4, ignore_eos=True)).token_ids) == 4
    finally:
        channel.close()
        child.signal(15)
        child.process.wait(timeout=20)


def test_full_workers_are_back_pressure_not_failures(model_dirs):
    """Workers at --max-in-flight 1 under 6 concurrent sessions answer RESOURCE_EXHAUSTED; the
    coordinator waits (target) or goes target-only (draft) instead of failing them over, and
    every greedy output equals the uncontended one."""
    import threading
    import urllib.request

    from test_generate import sample

    from specdec.client import Client
    from specdec.launcher.stack import Stack, StackSettings
    from specdec.serving.redis_embedded import free_port

    metrics = free_port()
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        coordinator_args=["--metrics-port", str(metrics)],
        target_args=["--max-in-flight", "1"],
        draft_args=["--max-in-flight", "1"],
    )
    prompts = [f"def f{i}(x):" for i in range(6)]
    kwargs = dict(max_new_tokens=20, num_speculative_tokens=2, ignore_eos=True)
    with Stack(settings) as stack, Client(stack.address) as client:
        alone = [list(client.generate(p, **kwargs).token_ids) for p in prompts]
        together: list = [None] * len(prompts)

        def run(i):
            with Client(stack.address) as own:
                together[i] = own.generate(prompts[i], **kwargs)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read()
    assert [list(r.token_ids) for r in together] == alone
    assert all(r.stats.target_failovers == 0 and r.stats.draft_failovers == 0 for r in together)
    pressed = [
        sample(text.decode(), "specdec_backpressure_total", tier=t) for t in ("target", "draft")
    ]
    assert sum(v or 0.0 for v in pressed) > 0  # the workers really were full


def test_new_sessions_are_shed_while_the_target_tier_is_saturated(model_dirs):
    """With a verify-step bound every real step exceeds, a session that is running keeps
    running (and finishes exactly), a new one is refused with RESOURCE_EXHAUSTED naming the
    flag, and once the running one is done and its steps left the window, admission reopens."""
    import threading
    import time

    from specdec.client import Client
    from specdec.launcher.stack import Stack, StackSettings

    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        coordinator_args=["--shed-verify-s", "0.000001"],
    )
    kwargs = dict(max_new_tokens=120, num_speculative_tokens=2, ignore_eos=True)
    with Stack(settings) as stack, Client(stack.address, retries=0) as client:
        alone = list(client.generate("def f(x):", **kwargs).token_ids)
        time.sleep(5.5)  # the window forgets that run
        first: dict = {}
        started = threading.Event()

        def run():
            with Client(stack.address) as own:
                tokens = []
                for chunk in own.stream("def f(x):", **kwargs):
                    tokens += list(chunk.token_ids)
                    if len(tokens) >= 10:
                        started.set()
                first["tokens"] = tokens

        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate("def g(x):", max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--shed-verify-s" in refused.value.details()
        thread.join(120)
        assert first["tokens"] == alone  # the running session was never disturbed
        time.sleep(5.5)
        assert len(client.generate("def g(x):", max_new_tokens=4).token_ids) == 4


def test_a_burst_of_new_sessions_starts_a_few_at_a_time_and_all_finish(model_dirs):
    """--max-starting 1: six sessions arrive together; they take turns for their first round
    (prefill + first verify), none is refused or fails, each output equals its lone run,
    and the turns show: the last first token comes after the first session's."""
    import threading

    from specdec.client import Client
    from specdec.launcher.stack import Stack, StackSettings

    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        coordinator_args=["--max-starting", "1"],
    )
    prompts = [f"def g{i}(x, y):" * 8 for i in range(6)]  # prompts long enough to prefill
    kwargs = dict(max_new_tokens=12, num_speculative_tokens=2, ignore_eos=True)
    with Stack(settings) as stack, Client(stack.address) as client:
        alone = [list(client.generate(p, **kwargs).token_ids) for p in prompts]
        together: list = [None] * len(prompts)

        def run(i):
            with Client(stack.address, retries=0) as own:
                together[i] = own.generate(prompts[i], **kwargs)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert [list(r.token_ids) for r in together] == alone
    firsts = sorted(r.stats.time_to_first_token_ms for r in together)
    assert firsts[-1] > firsts[0] * 3, firsts  # one at a time (all at once: ~2×)

"""The stack with every control on (TLS to the public API, mTLS between tiers, API keys, a
password on Redis), as real processes: output still equals Hugging Face greedy, faults still
lose nothing, and what lacks a key or a certificate is refused. Also a compromised worker
(valid certificate, corrupted answers) is failed over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_faults import live_address as live
from test_faults import reference, stream_and_kill
from test_generate import PROMPTS, hf_greedy
from up_process import stop

from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port
from specdec.serving.registry import index_key, worker_key
from specdec.serving.security import ClientTLS

pytestmark = pytest.mark.slow
KEY = "e2e-secret-key-7f3a"
LIAR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "liar_worker.py")


@pytest.fixture(scope="module")
def secure(model_dirs):
    """TLS + mTLS + API keys + Redis password; two targets, one draft, two coordinators."""
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        target_workers=2,
        tls=True,
        api_keys=[KEY],
        coordinator_args=["--lease-s", "1.0", "--worker-timeout-s", "20"],
    )
    with Stack(settings) as running:
        running.second_port = free_port()
        # INFO: the tests wait for its "target worker … joined/unreachable" lines
        running.add_coordinator(
            running.second_port, name="coordinator-b", extra=["--log-level", "info"]
        )
        yield running


def client(stack, address=None, **overrides) -> Client:
    options = {**stack.client_options(), "timeout_s": 120, "backoff_s": 0.3, **overrides}
    return Client(address or live(stack), **options)


@pytest.mark.parametrize("gamma", [None, 3])
def test_greedy_equals_hf_with_every_control_on(secure, hf, gamma):
    with client(secure) as c:
        for prompt in PROMPTS:
            out = c.generate(
                prompt, max_new_tokens=24, ignore_eos=True, num_speculative_tokens=gamma
            )
            assert list(out.token_ids) == hf_greedy(hf, prompt, 24), (prompt, gamma)


def call_code(c: Client, method: str = "generate"):
    try:
        if method == "generate":
            c.generate("def add(a, b):", max_new_tokens=4)
        else:
            c.get_session("no-such-session")
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_the_public_api_needs_the_key(secure):
    with client(secure, api_key="") as c:
        assert call_code(c) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(c, "get_session") == grpc.StatusCode.UNAUTHENTICATED
    with client(secure, api_key="not-the-key") as c:
        assert call_code(c) == grpc.StatusCode.UNAUTHENTICATED
    with client(secure) as c:
        assert call_code(c) == grpc.StatusCode.OK
        assert call_code(c, "get_session") == grpc.StatusCode.NOT_FOUND  # past the key check


def health(address, tls: ClientTLS | None):
    ch = (
        grpc.secure_channel(address, tls.credentials(), tls.options())
        if tls
        else grpc.insecure_channel(address)
    )
    with ch:
        try:
            return (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(), timeout=5)
                .status
            )
        except grpc.RpcError as exc:
            return exc.code()


def test_plaintext_and_unknown_cas_are_refused_health_stays_open(secure, tmp_path):
    from specdec.launcher.certs import CertificateAuthority

    serving = health_pb2.HealthCheckResponse.SERVING
    ca = secure.ca.cert_path
    assert health(secure.address, ClientTLS(ca)) == serving  # no key needed for health
    assert health(secure.address, None) == grpc.StatusCode.UNAVAILABLE
    with client(secure, tls_ca="", retries=0) as c:  # plaintext to the TLS port
        assert call_code(c) == grpc.StatusCode.UNAVAILABLE
    other = CertificateAuthority.create(tmp_path / "other")
    with client(secure, tls_ca=other.cert_path, retries=0) as c:
        assert call_code(c) == grpc.StatusCode.UNAVAILABLE


def test_workers_refuse_callers_without_a_cluster_certificate(secure, tmp_path):
    from specdec.launcher.certs import CertificateAuthority

    ca = secure.ca.cert_path
    other = CertificateAuthority.create(tmp_path / "intruder")
    foreign_cert, foreign_key = other.issue("intruder")
    cert, key = secure.ca.issue("probe")
    for address in secure.target_addresses + secure.draft_addresses:
        assert health(address, None) == grpc.StatusCode.UNAVAILABLE
        assert health(address, ClientTLS(ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
        assert health(address, ClientTLS(ca, foreign_cert, foreign_key)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert health(address, ClientTLS(ca, cert, key)) == health_pb2.HealthCheckResponse.SERVING


def test_redis_refuses_a_client_without_the_password(secure):
    bare = secure.redis_url.replace(f":{secure.redis.password}@", "")
    assert secure.redis.password and bare != secure.redis_url
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.from_url(bare).keys("specdec:*")
    assert redis.from_url(secure.redis_url).ping()


def test_target_worker_dies_under_mtls(secure):
    expected = reference(secure, temperature=0.8, seed=11, num_speculative_tokens=2)
    session = "secure-target-dies"

    def kill():
        with client(secure) as c:
            info = c.get_session(session)
        index = secure.target_addresses.index(info.target_worker)
        secure.child(f"target-worker-{index}").signal(signal.SIGKILL)

    tokens, last = stream_and_kill(
        secure, kill, temperature=0.8, seed=11, num_speculative_tokens=2, session_id=session
    )
    assert tokens == expected
    assert last.stats.target_failovers >= 1


def test_coordinator_dies_and_the_client_resumes_on_the_other_over_tls(secure):
    expected = reference(secure, temperature=0.7, seed=5, num_speculative_tokens=3)
    addresses = [secure.address, f"127.0.0.1:{secure.second_port}"]
    tokens, last = stream_and_kill(
        secure,
        lambda: secure.child("coordinator").signal(signal.SIGKILL),
        addresses=addresses,
        temperature=0.7,
        seed=5,
        num_speculative_tokens=3,
        session_id="secure-coordinator-dies",
    )
    assert tokens == expected
    assert last.stats.takeovers >= 1


class LiarProcess:
    """tests/liar_worker.py in front of a live target, registered in Redis as a target with
    the lowest load, so the coordinator's next new session goes to it."""

    def __init__(self, stack, mode: str, with_certificate: bool):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        upstream = next(
            a
            for i, a in enumerate(stack.target_addresses)
            if stack.child(f"target-worker-{i}").alive()
        )
        argv = [sys.executable, LIAR, "--upstream", upstream, "--port", str(self.port)]
        argv += ["--mode", mode]
        if with_certificate:  # a compromised worker: it holds a valid cluster certificate
            cert, key = stack.ca.issue(f"liar-{mode}")
            argv += ["--tls-cert", cert, "--tls-key", key, "--tls-ca", stack.ca.cert_path]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.ready.wait(60), "\n".join(self.lines)
        self.redis = redis.from_url(stack.redis_url)
        self.key = worker_key("target", self.address)
        self.redis.set(self.key, json.dumps({"address": self.address, "load": -1000}), px=60_000)
        self.redis.sadd(index_key("target"), self.address)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.strip())
            if line.startswith("READY"):
                self.ready.set()

    def seen_by(self, stack, coordinator: str, word: str, timeout_s: float = 60.0) -> None:
        """Wait until `coordinator` logs this worker with `word` ("joined", "unreachable"):
        its registry refresh has reached the liar (a fixed sleep raced it on a loaded CI)."""
        child = stack.child(coordinator)
        needle = f"target worker {self.address} {word}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(needle in line for line in list(child.lines)):
                return
            time.sleep(0.2)
        raise AssertionError(f"{coordinator} never logged {needle!r}:\n{child.tail(30)}")

    def corrupted(self) -> int:
        return sum(line.startswith("CORRUPTED") for line in self.lines)

    def stop(self):
        self.redis.delete(self.key)
        self.redis.srem(index_key("target"), self.address)
        self.process.kill()
        self.process.wait(10)


@pytest.mark.parametrize("mode", ["extra", "vocab", "prefix"])
def test_a_compromised_worker_is_failed_over_and_output_stays_exact(secure, hf, mode):
    liar = LiarProcess(secure, mode, with_certificate=True)
    try:
        liar.seen_by(secure, "coordinator-b", "joined")
        prompt = PROMPTS[0]
        with client(secure, f"127.0.0.1:{secure.second_port}") as c:
            out = c.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert list(out.token_ids) == hf_greedy(hf, prompt, 24)
        assert liar.corrupted() >= 1, (
            "the session never reached the hostile worker:\n"
            + secure.child("coordinator-b").tail(60)
            + "\nliar:\n"
            + "\n".join(liar.lines)
        )
        assert out.stats.target_failovers >= 1
    finally:
        liar.stop()


def test_a_worker_without_a_cluster_certificate_never_joins(secure, hf):
    liar = LiarProcess(secure, "extra", with_certificate=False)
    try:
        liar.seen_by(secure, "coordinator-b", "unreachable")
        with client(secure, f"127.0.0.1:{secure.second_port}") as c:
            out = c.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)
        assert list(out.token_ids) == hf_greedy(hf, PROMPTS[1], 24)
        assert liar.corrupted() == 0
        assert out.stats.target_failovers == 0, secure.child("coordinator-b").tail(60)
    finally:
        liar.stop()


def test_generate_cli_over_tls_with_a_key(secure):
    base = [sys.executable, "-m", "specdec", "generate", "--addr", live(secure)]
    base += ["--max-new-tokens", "8", "--ignore-eos", "--tls-ca", secure.ca.cert_path]
    base += ["def add(a, b):"]
    env = {**os.environ, "SPECDEC_API_KEY": KEY}
    ok = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip()
    env["SPECDEC_API_KEY"] = "wrong"
    refused = subprocess.run(base, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 1
    assert "UNAUTHENTICATED: invalid API key" in refused.stderr


def test_specdec_up_with_tls_and_a_key_end_to_end(model_dirs):
    """`specdec up --tls --api-key K` as a user runs it: the banner says how to call it, the
    CLI and the Python client get through with the key, nothing without it, and Ctrl-C
    removes the throwaway CA."""
    port = free_port()
    argv = [sys.executable, "-m", "specdec", "up", "--tls", "--api-key", KEY, "--port", str(port)]
    argv += ["--target-model", model_dirs["target"], "--draft-model", model_dirs["draft"]]
    argv += ["--target-threads", "1"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "specdec up exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("serving;"):
                break
        banner = "".join(lines)
        assert "export SPECDEC_API_KEY=" in banner
        assert "--- " in banner and "tok/s" in banner, "the demo ran over TLS with the key"
        ca = banner.split("--tls-ca ", 1)[1].split()[0]
        assert os.path.isfile(ca)
        address = f"127.0.0.1:{port}"
        cli = [sys.executable, "-m", "specdec", "generate", "--addr", address, "--tls-ca", ca]
        cli += ["--max-new-tokens", "6", "--ignore-eos", "def f(x):"]
        ok = subprocess.run(
            cli,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "SPECDEC_API_KEY": KEY},
        )
        assert ok.returncode == 0, ok.stderr
        with Client(address, tls_ca=ca, api_key=KEY, timeout_s=60) as c:
            assert len(c.generate("import os", max_new_tokens=5, ignore_eos=True).token_ids) == 5
        with Client(address, tls_ca=ca, api_key="", timeout_s=60) as c:
            assert call_code(c) == grpc.StatusCode.UNAUTHENTICATED
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert not os.path.exists(ca), "the throwaway CA outlived the stack"
    finally:
        stop(process)  # a failed assertion above: Ctrl-C, so nothing it started outlives it

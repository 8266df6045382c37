"""Draft and target workers as real processes: READY, health, Redis registry, a round across
the two processes (also on the call streams), and a graceful SIGTERM (NOT_SERVING,
deregistered, call streams ended, exit 0 in the grace)."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest
import redis.asyncio as aioredis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from specdec.core.prefix import fingerprint
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import list_workers
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_TIMEOUT_S = 180  # imports torch and loads a model on 2 shared cores
# Draining takes milliseconds, but a loaded 2-core box needs seconds to tear down torch and
# gRPC after that; a drain that waited out the grace would still exceed it.
GRACE_S = 15.0
HEARTBEAT_S = 5.0  # entry TTL 15 s: a missing entry right after exit means it was deleted
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerProcess:
    """`python -m <role>_worker` on a free loopback port; stdout lines go to a queue."""

    def __init__(self, role: str, model_dir: str, redis_url: str):
        self.role = role
        self.address = ""  # bound by the worker itself (--port 0): READY says which
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed by kill()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"{role}_worker",
                "--model",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--redis-url",
                redis_url,
                "--device",
                "cpu",
                "--threads",
                "1",
                "--heartbeat-s",
                str(HEARTBEAT_S),
                "--grace-s",
                str(GRACE_S),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def logs(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.process.poll() is None, f"{self.role} exited:\n{self.logs()}"
                continue
            if line.startswith("READY"):  # READY <role> <host:port>: the port it bound
                self.address = line.split()[2]
                return line
        raise AssertionError(f"{self.role} not READY in {timeout_s}s:\n{self.logs()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.stderr.close()


class HealthWatch:
    """A health Watch stream in a thread; cancelled once it sees NOT_SERVING so the
    draining server has no call left to wait for."""

    def __init__(self, channel: grpc.Channel):
        self.statuses: list[int] = []
        self.serving = threading.Event()
        self.not_serving = threading.Event()
        self.call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=READY_TIMEOUT_S
        )
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            for response in self.call:
                self.statuses.append(response.status)
                if response.status == SERVING:
                    self.serving.set()
                elif response.status == NOT_SERVING and self.serving.is_set():
                    self.not_serving.set()
                    self.call.cancel()
        except grpc.RpcError:
            pass


def registered(redis_url: str, role: str) -> list[dict]:
    async def read() -> list[dict]:
        client = aioredis.from_url(redis_url)
        try:
            return await list_workers(client, role)
        finally:
            await client.aclose()

    return asyncio.run(read())


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as redis:
        yield redis.url


def test_workers_serve_register_and_drain_on_sigterm(model_dirs, redis_url):
    workers = {
        role: WorkerProcess(role, model_dirs[role], redis_url) for role in ("target", "draft")
    }
    channels = {}
    held_open = threading.Event()  # the caller's side of the call streams stays open
    try:
        for role, worker in workers.items():
            ready = worker.wait_ready(READY_TIMEOUT_S)
            assert re.fullmatch(rf"READY {role} 127\.0\.0\.1:[1-9]\d*", ready), ready
            channels[role] = grpc.insecure_channel(worker.address)
            health = health_pb2_grpc.HealthStub(channels[role])
            service = "specdec.v1.TargetWorker" if role == "target" else "specdec.v1.DraftWorker"
            for name in ("", service):
                check = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert check.status == SERVING, name
            # READY comes after registering: the entry is there at once
            (entry,) = registered(redis_url, role)
            assert entry["role"] == role and entry["address"] == worker.address
            assert int(entry["vocab_size"]) == 320 and entry["model_name"] == role

        # one greedy round across the two processes equals the target's own greedy decoding
        prompt = [5, 6, 7, 8, 9, 10]
        base = common_pb2.Base(
            session_id="e2e", epoch=1, base_len=len(prompt), base_fingerprint=fingerprint(prompt)
        )
        delta = common_pb2.TokenDelta(start=0, token_ids=prompt)
        proposal = draft_pb2_grpc.DraftWorkerStub(channels["draft"]).Propose(
            draft_pb2.ProposeRequest(base=base, delta=delta, num_speculative_tokens=4), timeout=60
        )
        result = target_pb2_grpc.TargetWorkerStub(channels["target"]).Verify(
            target_pb2.VerifyRequest(base=base, delta=delta, candidate_ids=proposal.candidate_ids),
            timeout=60,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
        history = list(prompt)
        with torch.inference_mode():
            for _ in result.output_ids:
                history.append(int(model(input_ids=torch.tensor([history])).logits[0, -1].argmax()))
        expected = history[len(prompt) :]
        assert list(result.output_ids) == expected

        # a call stream to each worker, answered as the unary call, then held open by the
        # caller through the drain: the worker must end it, not wait out its grace for it
        def calls(message):
            yield message
            held_open.wait(GRACE_S + 30)

        again = common_pb2.Base(
            session_id="e2e-stream",
            epoch=1,
            base_len=len(prompt),
            base_fingerprint=fingerprint(prompt),
        )
        streams = {
            "target": target_pb2_grpc.TargetWorkerStub(channels["target"]).VerifyStream(
                calls(
                    target_pb2.VerifyCall(
                        call_id=1,
                        request=target_pb2.VerifyRequest(
                            base=again, delta=delta, candidate_ids=proposal.candidate_ids
                        ),
                        timeout_ms=60_000,
                    )
                )
            ),
            "draft": draft_pb2_grpc.DraftWorkerStub(channels["draft"]).ProposeStream(
                calls(
                    draft_pb2.ProposeCall(
                        call_id=1,
                        request=draft_pb2.ProposeRequest(
                            base=again, delta=delta, num_speculative_tokens=4
                        ),
                        timeout_ms=60_000,
                    )
                )
            ),
        }
        verified, proposed = next(streams["target"]), next(streams["draft"])
        assert verified.call_id == 1 and not verified.status.code
        assert list(verified.response.output_ids) == expected
        assert proposed.call_id == 1 and not proposed.status.code
        assert list(proposed.response.candidate_ids) == list(proposal.candidate_ids)

        watches = {role: HealthWatch(channel) for role, channel in channels.items()}
        for role, watch in watches.items():
            assert watch.serving.wait(10), f"{role} health watch never saw SERVING"
        started = time.monotonic()
        for worker in workers.values():
            worker.process.send_signal(signal.SIGTERM)
        for role, worker in workers.items():
            code = worker.process.wait(timeout=GRACE_S + 30)
            elapsed = time.monotonic() - started
            assert code == 0, f"{role} exited with {code}:\n{worker.logs()}"
            assert elapsed < GRACE_S, f"{role} took {elapsed:.1f}s to drain"
            assert watches[role].not_serving.is_set(), watches[role].statuses
            assert registered(redis_url, role) == [], f"{role} is still registered"
            assert "Traceback" not in worker.logs(), worker.logs()
            assert list(streams[role]) == []  # the worker ended its call stream: OK, no more
    finally:
        held_open.set()
        for channel in channels.values():
            channel.close()
        for worker in workers.values():
            worker.kill()

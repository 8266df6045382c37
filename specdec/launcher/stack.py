"""The local stack as real processes: embedded Redis, draft and target workers, a coordinator.

Used by `specdec up`, the end-to-end tests and the benchmarks. Each child is its own process
group; `stop()` terminates all of them (then kills stragglers), also after a failed start.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from specdec.launcher.certs import CertificateAuthority
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import redact
from specdec.serving.security import hash_key


class StackError(RuntimeError):
    """A part of the stack failed to start; the message names it and says why."""


@dataclass
class StackSettings:
    target_model: str
    draft_model: str
    port: int = 50051
    host: str = "127.0.0.1"
    redis_url: str = ""
    draft_workers: int = 1
    target_workers: int = 1
    draft_threads: int = 1
    target_threads: int = 1
    proposer: str = "model"
    startup_timeout_s: float = 180.0
    coordinator_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    log_level: str = "warning"
    # Security: every hop over (m)TLS with a throwaway CA, and API keys on the public API.
    tls: bool = False
    api_keys: list[str] = field(default_factory=list)
    state_dir: str = ""  # certificates and the key file (default: a temporary directory)
    reflection: bool = False  # gRPC reflection on every service (specdec up turns it on)
    http_port: int = -1  # the first coordinator's OpenAI-compatible HTTP API (-1 = off)
    # The embedded Redis persists (append-only file) in redis_dir, default <state_dir>/redis,
    # so restarting it loses no session; off: in memory only.
    persist_redis: bool = False
    redis_dir: str = ""
    # Run the workers and coordinators from this source tree instead of the installed code
    # (a benchmark's baseline revision, bench.stack_ab); "" = the installed code.
    code_dir: str = ""


class Child:
    def __init__(self, name: str, argv: list[str], env: dict, cwd: str | None = None):
        self.name = name
        self.argv = argv
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.ready = threading.Event()
        self.ready_line = ""  # "READY <role> <host:port> …": the address it bound
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("READY"):
                self.ready_line = line.strip()
                self.ready.set()

    def bound_address(self) -> str:
        """The host:port its READY line reports (a port of 0 asked for a free one); its argv
        then names that port, so a restart with the same argv comes back on the same address."""
        address = self.ready_line.split()[2]
        if "--port" in self.argv:
            self.argv[self.argv.index("--port") + 1] = address.rsplit(":", 1)[1]
        return address

    def tail(self, n: int = 15) -> str:
        return "\n".join(list(self.lines)[-n:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)


class Stack:
    def __init__(self, settings: StackSettings):
        self.settings = settings
        self.redis: EmbeddedRedis | None = None
        self.redis_url = settings.redis_url
        self.children: list[Child] = []
        self.draft_addresses: list[str] = []
        self.target_addresses: list[str] = []
        self.port = settings.port  # the coordinator's; 0 until it reports the one it bound
        self.state_dir = ""
        self._own_state_dir = False
        self.ca: CertificateAuthority | None = None
        self.worker_tls: list[str] = []  # flags of a worker (its certificate is shared)
        self.coordinator_security: list[str] = []

    def _prepare_state(self) -> None:
        """The state directory: the throwaway CA, one certificate per tier, the API-key file
        (hashed keys) and the embedded Redis's data, as asked."""
        s = self.settings
        if not (s.tls or s.api_keys or (s.persist_redis and not s.redis_dir)):
            return
        self.state_dir = s.state_dir or tempfile.mkdtemp(prefix="specdec-up-")
        self._own_state_dir = not s.state_dir
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        if s.tls:
            self.ca = CertificateAuthority.create(os.path.join(self.state_dir, "tls"))
            ca = self.ca.cert_path
            cert, key = self.ca.issue("worker")
            self.worker_tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
            cert, key = self.ca.issue("coordinator")
            self.coordinator_security += ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
        if s.api_keys:
            path = os.path.join(self.state_dir, "api-keys")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(hash_key(k) + "\n" for k in s.api_keys))
            self.coordinator_security += ["--api-keys-file", path]

    def _reflection(self) -> list[str]:
        return ["--reflection"] if self.settings.reflection else []

    def client_options(self) -> dict:
        """Keyword arguments of `specdec.client.Client` that reach this stack."""
        options = {}
        if self.ca is not None:
            options["tls_ca"] = self.ca.cert_path
        if self.settings.api_keys:
            options["api_key"] = self.settings.api_keys[0]
        return options

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (`…/v1`), when http_port is set."""
        scheme = "https" if self.settings.tls else "http"
        return f"{scheme}://{self.settings.host}:{self.settings.http_port}/v1"

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        # In the environment, not on the command line: the URL may carry Redis's password.
        env["SPECDEC_REDIS_URL"] = self.redis_url
        code = self.settings.code_dir
        if code:
            env["PYTHONPATH"] = code
        child = Child(name, [sys.executable, "-m", module, *args], env, cwd=code or None)
        self.children.append(child)
        return child

    def _spawn_worker(self, tier: str, i: int, model: str, threads: int, extra: list[str]) -> Child:
        """Start worker i of a tier; it binds a free port itself (--port 0) and reports it when
        ready (a port picked here first could be taken before the worker, which loads its
        model before binding, got to it)."""
        args = ["--model", model, "--port", "0", "--threads", str(threads)]
        args += [*self.worker_tls, *extra]
        return self._spawn(f"{tier}-worker-{i}", f"{tier}_worker", args)

    def start(self, progress=print) -> Stack:
        s = self.settings
        try:
            self._prepare_state()
            if not self.redis_url:
                data = ""
                if s.persist_redis:
                    data = s.redis_dir or os.path.join(self.state_dir, "redis")
                self.redis = EmbeddedRedis(data_dir=data).start()
                self.redis_url = self.redis.url
                kept = f", sessions kept in {data}" if data else ""
                progress(f"redis        {redact(self.redis_url)} (embedded redis-server{kept})")
            common = ["--log-level", s.log_level, *self._reflection()]
            tiers = [("target", s.target_model, s.target_threads, common + s.target_args, "")]
            draft = ["--proposer", s.proposer, *common, *s.draft_args]
            tiers.append(
                ("draft", s.draft_model, s.draft_threads, draft, f" proposer={s.proposer}")
            )
            workers = [
                (tier, i, model, threads, note, self._spawn_worker(tier, i, model, threads, extra))
                for tier, model, threads, extra, note in tiers
                for i in range(s.target_workers if tier == "target" else s.draft_workers)
            ]
            self._wait(self.children, s.startup_timeout_s)
            for tier, i, model, threads, note, child in workers:
                address = child.bound_address()
                getattr(self, f"{tier}_addresses").append(address)
                line = f"{tier}[{i}]".ljust(13) + f"{address}  model={model} threads={threads}"
                progress(line + note)
            http = ["--http-port", str(s.http_port)] if s.http_port >= 0 else []
            coordinator = self._spawn(
                "coordinator", "coordinator", self._coordinator_args(s.port, http)
            )
            self._wait([coordinator], s.startup_timeout_s)
            self.port = int(coordinator.bound_address().rsplit(":", 1)[1])
            progress(f"coordinator  {self.address}")
            return self
        except BaseException:
            self.stop()
            raise

    def add_coordinator(self, port: int, name: str = "", extra: list[str] | None = None) -> Child:
        """Start another coordinator replica on the same Redis and workers (and wait for it)."""
        s = self.settings
        child = self._spawn(
            name or f"coordinator-{port}", "coordinator", self._coordinator_args(port, extra or [])
        )
        self._wait([child], s.startup_timeout_s)
        return child

    def _coordinator_args(self, port: int, extra: list[str] = ()) -> list[str]:
        s = self.settings
        return [
            "--tokenizer",
            s.target_model,
            "--host",
            s.host,
            "--port",
            str(port),
            "--draft-addr",
            ",".join(self.draft_addresses),
            "--target-addr",
            ",".join(self.target_addresses),
            "--log-level",
            s.log_level,
            *self.coordinator_security,
            *self._reflection(),
            *s.coordinator_args,
            *extra,
        ]

    def _wait(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for child in children:
            while not child.ready.wait(0.1):
                if not child.alive():
                    raise StackError(
                        f"{child.name} exited with code {child.process.returncode} during start-up:\n{child.tail()}"
                    )
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{child.name} was not healthy within {timeout_s:.0f}s:\n{child.tail()}"
                    )

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every child (coordinator first), wait, then SIGKILL what is left."""
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.process.wait(timeout=5)
        if self.redis:
            self.redis.stop()
            self.redis = None
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self._own_state_dir = False

    def __enter__(self) -> Stack:
        return self.start(progress=lambda _msg: None)

    def __exit__(self, *exc) -> None:
        self.stop()

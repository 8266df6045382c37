"""The chaos benchmark's faults (`bench.chaos`): a target's link in its own network namespace
(veth pair, slowed by a token-bucket filter or cut), and the seeded injector that kills, stops
and restarts processes, Redis and the link, one bounded fault at a time."""

from __future__ import annotations

import collections
import contextlib
import random
import signal
import subprocess
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.chaos import ChaosStack


class Link:
    """A network namespace joined to the host by a veth pair: host 10.77.<n>.1, inside .2."""

    def __init__(self, name: str = "specdec-chaos", subnet: int = 77):
        self.name = name
        self.host_if, self.ns_if = f"sdc{subnet}a", f"sdc{subnet}b"
        self.host_ip, self.ns_ip = f"10.{subnet}.0.1", f"10.{subnet}.0.2"

    def _ip(self, *args: str, ns: bool = False) -> None:
        prefix = ["ip", "netns", "exec", self.name] if ns else []
        subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=10)

    def up(self) -> Link:
        self.down()  # a leftover of an interrupted run
        self._ip("ip", "netns", "add", self.name)
        self._ip("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("ip", "link", "set", self.ns_if, "netns", self.name)
        self._ip("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        self._ip("ip", "link", "set", self.host_if, "up")
        self._ip("ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if, ns=True)
        self._ip("ip", "link", "set", self.ns_if, "up", ns=True)
        self._ip("ip", "link", "set", "lo", "up", ns=True)
        return self

    def down(self) -> None:
        for cmd in (["ip", "link", "del", self.host_if], ["ip", "netns", "del", self.name]):
            subprocess.run(cmd, capture_output=True, timeout=10)

    def slow(self) -> None:
        """A congested link both ways: 2 Mbit/s token buckets whose queues delay packets."""
        for ns, dev in ((False, self.host_if), (True, self.ns_if)):
            self._ip(
                "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "2mbit", "burst",
                "8kb", "latency", "200ms", ns=ns,
            )  # fmt: skip

    def fast(self) -> None:
        for ns, dev in ((False, self.host_if), (True, self.ns_if)):
            with contextlib.suppress(subprocess.CalledProcessError):
                self._ip("tc", "qdisc", "del", "dev", dev, "root", ns=ns)

    def cut(self, on: bool) -> None:
        self._ip("ip", "link", "set", self.host_if, "down" if on else "up")

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


class Injector(threading.Thread):
    """One bounded fault at a time, chosen by a seeded generator, each undone before the next."""

    def __init__(self, stack: ChaosStack, seed: int, kinds: list[str], gap_s: float):
        super().__init__(daemon=True)
        self.stack, self.rng, self.kinds, self.gap_s = stack, random.Random(seed), kinds, gap_s
        self.done = threading.Event()
        self.injected: collections.Counter = collections.Counter()
        self.log: list[str] = []
        self.failure = ""

    def _pick(self, prefix: str) -> str:
        names = [c.name for c in self.stack.children if c.name.startswith(prefix) and c.alive()]
        return self.rng.choice(sorted(names))

    def _sleep(self, s: float) -> None:
        self.done.wait(s)

    def inject(self, kind: str) -> None:
        stack = self.stack
        tier = {"draft": "draft-worker", "target": "target-worker", "coordinator": "coordinator"}
        action, _, what = kind.partition("_")
        if action in ("kill", "stop"):
            name = self._pick(tier[what])
            child = stack.child(name)
            if action == "kill":
                child.signal(signal.SIGKILL)
                child.process.wait(10)
                self._sleep(self.rng.uniform(0.5, 1.5))
                stack.restart(name)
                stack._wait([stack.child(name)], 120)
            else:
                child.signal(signal.SIGSTOP)
                self._sleep(self.rng.uniform(1.0, 3.0))
                child.signal(signal.SIGCONT)
            self.log.append(f"{kind} {name}")
        elif kind == "redis_restart":
            stack.redis.process.send_signal(signal.SIGTERM)  # syncs the append-only file
            stack.redis.process.wait(10)
            self._sleep(self.rng.uniform(0.3, 1.0))
            stack.redis.restart()
            self.log.append(kind)
        elif kind == "redis_pause":
            stack.redis.process.send_signal(signal.SIGSTOP)
            self._sleep(self.rng.uniform(1.0, 2.5))
            stack.redis.process.send_signal(signal.SIGCONT)
            self.log.append(kind)
        elif kind == "link_slow":
            stack.link.slow()
            self._sleep(self.rng.uniform(2.0, 4.0))
            stack.link.fast()
            self.log.append(kind)
        elif kind == "link_cut":
            stack.link.cut(True)
            self._sleep(self.rng.uniform(2.0, 4.0))
            stack.link.cut(False)
            self.log.append(kind)
        self.injected[kind] += 1

    def run(self) -> None:
        try:
            queue = list(self.kinds)
            while not self.done.is_set():
                self._sleep(self.rng.uniform(0.5, 1.0) * self.gap_s)
                if self.done.is_set():
                    return
                if not queue:
                    return
                self.inject(queue.pop(0))
        except Exception as exc:  # noqa: BLE001 - reported, the run then fails
            self.failure = f"{type(exc).__name__}: {exc}"

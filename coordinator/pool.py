"""Worker pools of the coordinator: static addresses plus a discovery (the Redis registry by
default; coordinator/discovery.py), vocabulary checks, session affinity and least-load
placement."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from coordinator.discovery import Discovery, RedisDiscovery, StaticDiscovery
from specdec.serving.callstream import CallLane
from specdec.serving.security import ClientTLS, SecurityConfigError
from specdec.serving.server import channel
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

OLD_CHANNEL_GRACE_S = 60.0
PROBE_AGAIN_S = 5.0  # a worker that failed a call is out this long, then probed
PROBE_TIMEOUT_S = 1.0  # the probe's Info deadline (a blackholed worker must not stall refresh)


@dataclass
class Worker:
    address: str
    role: str
    info: common_pb2.WorkerInfo
    channel: grpc.aio.Channel
    stub: object
    lanes: dict[str, CallLane] = field(default_factory=dict)  # method → its call stream
    registry_load: float = 0.0
    in_flight: int = 0
    sessions: set[str] = field(default_factory=set)
    dead_until: float = 0.0
    probe: bool = False  # it failed a call: answers Info once more before it is picked again

    def call(self, method: str):
        """The worker's `method` (Propose, Verify, ...): on its call stream where it has one."""
        return self.lanes.get(method) or getattr(self.stub, method)

    @property
    def load(self) -> float:
        return self.registry_load + self.in_flight + 0.01 * len(self.sessions)


class WorkerPool:
    """All known workers of one role whose vocabulary matches the coordinator's tokenizer."""

    def __init__(
        self,
        role: str,
        static: list[str],
        vocab_fingerprint: str,
        redis=None,
        timeout_s: float = 5.0,
        tls: ClientTLS | None = None,
        discovery: Discovery | None = None,
        streams: bool = False,
    ):
        """`discovery` finds workers besides `static` (its owner starts and closes it);
        without one, `redis` is short for RedisDiscovery(redis), and no redis for static.
        `streams`: Propose and Verify on a call stream per worker (`CallLane`)."""
        self.role = role
        self.static = [a for a in static if a]
        self.vocab_fingerprint = vocab_fingerprint
        if discovery is None:
            discovery = RedisDiscovery(redis) if redis is not None else StaticDiscovery()
        self.discovery = discovery
        self.timeout_s = timeout_s
        self.tls = tls
        self.streams = streams
        self._tls_stamp = tls.stamp() if tls else None
        self.workers: dict[str, Worker] = {}
        self.refused: dict[str, str] = {}  # address → why it is not used
        self._lock = asyncio.Lock()

    def _stub(self, ch):
        return (
            draft_pb2_grpc.DraftWorkerStub(ch)
            if self.role == "draft"
            else target_pb2_grpc.TargetWorkerStub(ch)
        )

    def _lanes(self, stub, info: common_pb2.WorkerInfo) -> dict[str, CallLane]:
        """A call stream per method where the worker says it serves one (`call_streams`),
        batched where it serves that (`call_batches`)."""
        if not (self.streams and info.call_streams):
            return {}
        method, messages = (
            ("Propose", draft_pb2) if self.role == "draft" else ("Verify", target_pb2)
        )
        unary, call = getattr(stub, method), getattr(messages, f"{method}Call")
        if info.call_batches:
            lane = CallLane(
                getattr(stub, f"{method}Batches"), unary, call, getattr(messages, f"{method}Calls")
            )
        else:
            lane = CallLane(getattr(stub, f"{method}Stream"), unary, call)
        return {method: lane}

    async def _connect(self, address: str) -> None:
        try:
            ch = channel(address, self.tls)
        except SecurityConfigError as exc:  # a certificate file vanished mid-rotation
            log.warning("%s worker %s: not connecting: %s", self.role, address, exc)
            return
        stub = self._stub(ch)
        try:
            info = await stub.Info(common_pb2.InfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            await ch.close()
            log.warning(
                "%s worker %s unreachable: %s %s", self.role, address, exc.code(), exc.details()
            )
            return
        if self._refuses(address, info):
            await ch.close()
            return
        self.workers[address] = Worker(address, self.role, info, ch, stub, self._lanes(stub, info))
        log.info("%s worker %s joined (%s)", self.role, address, info.model_name)

    def _refuses(self, address: str, info: common_pb2.WorkerInfo) -> bool:
        """A worker whose vocabulary is not the coordinator's is refused (and remembered)."""
        if info.vocab_fingerprint == self.vocab_fingerprint:
            return False
        self.refused[address] = (
            f"vocabulary fingerprint {info.vocab_fingerprint} differs from the target tokenizer's "
            f"{self.vocab_fingerprint}"
        )
        log.error("refusing %s worker %s: %s", self.role, address, self.refused[address])
        return True

    async def _rotate_channels(self) -> None:
        """After the coordinator's certificate files changed, give every worker a new channel
        (new handshakes present the new certificate); old channels close once their calls
        have had a minute to finish."""
        stamp = self.tls.stamp()
        if stamp == self._tls_stamp:
            return
        try:
            fresh = {address: channel(address, self.tls) for address in self.workers}
        except SecurityConfigError as exc:  # half-written rotation: try at the next refresh
            log.warning("TLS files changed but cannot be read yet: %s", exc)
            return
        self._tls_stamp = stamp
        log.info("TLS files changed: new channels to %d %s worker(s)", len(fresh), self.role)
        for address, ch in fresh.items():
            worker = self.workers[address]
            old = worker.channel
            worker.channel, worker.stub = ch, self._stub(ch)
            # the old streams end with the old channel
            worker.lanes = self._lanes(worker.stub, worker.info)
            asyncio.get_running_loop().call_later(
                OLD_CHANNEL_GRACE_S, lambda c=old: asyncio.ensure_future(c.close())
            )

    async def refresh(self) -> None:
        """Pick up static and discovered workers; forget discovered ones that went away."""
        async with self._lock:
            if self.tls is not None:
                await self._rotate_channels()
            discovered = await self.discovery.addresses(self.role)  # address → load hint
            wanted = set(self.static) | set(discovered)
            for address in wanted:
                if address not in self.workers and address not in self.refused:
                    await self._connect(address)
                if address in discovered and address in self.workers:
                    self.workers[address].registry_load = discovered[address]
            for address in list(self.workers):  # static ones are always wanted
                if address not in wanted:
                    await self.workers.pop(address).channel.close()
            await self._probe()

    async def _probe(self) -> None:
        """Workers that failed a call, once their time out is over: back when Info answers,
        out for another while when not. A static address stays known after its process
        died (no registry entry expires for it): without the probe every new session would
        be placed on it, fail once and fail over, again after each time out."""
        now = time.monotonic()
        due = [w for w in self.workers.values() if w.probe and w.dead_until <= now]
        answers = await asyncio.gather(*(self._info(w) for w in due))
        for worker, info in zip(due, answers):
            if info is None:
                worker.dead_until = time.monotonic() + PROBE_AGAIN_S
            elif self._refuses(worker.address, info):  # another model came up there
                await self.workers.pop(worker.address).channel.close()
            else:
                streams = (info.call_streams, info.call_batches)
                if streams != (worker.info.call_streams, worker.info.call_batches):
                    # upgraded or rolled back: the lanes it serves now
                    worker.lanes = self._lanes(worker.stub, info)
                worker.info, worker.probe = info, False
                log.info("%s worker %s answers again", self.role, worker.address)

    async def _info(self, worker: Worker) -> common_pb2.WorkerInfo | None:
        try:
            return await worker.stub.Info(
                common_pb2.InfoRequest(), timeout=min(self.timeout_s, PROBE_TIMEOUT_S)
            )
        except grpc.RpcError:
            return None

    def alive(self) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.dead_until <= now and not w.probe]

    def pick(self, prefer: str = "", exclude: set[str] | None = None) -> Worker | None:
        """Session affinity first (where its KV is), else the least-loaded live worker."""
        exclude = exclude or set()
        candidates = [w for w in self.alive() if w.address not in exclude]
        for worker in candidates:
            if worker.address == prefer:
                return worker
        return min(candidates, key=lambda w: w.load, default=None)

    def mark_dead(self, address: str, for_s: float = PROBE_AGAIN_S, probe: bool = True) -> None:
        """Out for `for_s`; with `probe`, back only once it answers Info (see `_probe`)."""
        worker = self.workers.get(address)
        if worker is not None:
            worker.dead_until = time.monotonic() + for_s
            worker.probe = worker.probe or probe

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.channel.close()

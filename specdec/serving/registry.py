"""Worker registry in Redis: workers announce themselves with a heartbeat TTL; the
coordinator lists them.

Keys: specdec:worker:{<role>}:<address> → JSON WorkerInfo fields, with the heartbeat TTL, and
the set specdec:workers:{<role>} of the addresses registered. Listing reads the set and the
entries it names (SMEMBERS, then one MGET) — never a SCAN, whose cost grows with every key
in Redis (a SCAN of the keyspace took 363 ms with 25k finished sessions in it, every 2 s per
role). The hash tag puts a role's keys in one slot, so on a Redis Cluster both commands go
to one primary; an address whose entry expired (a worker that died) is dropped from the set
by the next listing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from specdec.serving.redis_topology import (
    RedisConfigError,
    check_redis_url,
    client_for,
    parse_redis_url,
    redact,
)

__all__ = [
    "REDIS_ACL",
    "RedisConfigError",
    "Registration",
    "check_redis_url",
    "list_workers",
    "parse_redis_url",
    "redact",
    "redis_client",
]

log = logging.getLogger(__name__)

PREFIX = "specdec:worker:"
# Every Redis command (and connecting) gives up after this long, well below the 3 s session
# lease: a stalled Redis surfaces as UNAVAILABLE within a second instead of blocking a loop
# for redis-py's default of about a minute.
REDIS_TIMEOUT_S = 1.0


PASSWORD_ENV = "SPECDEC_REDIS_PASSWORD"

# The least privilege a specdec Redis user needs (docs/security.md): keys under specdec:,
# no channels, and only the commands the coordinator, the workers and their Lua scripts
# issue — `ACL SETUSER specdec on >PASSWORD <these rules>`. tests/service/test_tls.py
# runs every store and registry operation as such a user, and
# tests/service/test_redis_topologies.py does on a Redis Cluster: there the client also
# reads the slot map (CLUSTER SLOTS; SHARDS on newer clients), the command table (COMMAND)
# and follows slot migrations (ASKING). READONLY is not needed: specdec never reads replicas.
REDIS_ACL = (
    "resetkeys",
    "~specdec:*",
    "resetchannels",
    "-@all",
    "+hello",
    "+auth",
    "+ping",
    "+select",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+expire",
    "+pexpire",
    "+hset",
    "+hget",
    "+hgetall",
    "+hincrby",
    "+rpush",
    "+lrange",
    "+sadd",
    "+srem",
    "+smembers",
    "+mget",
    "+evalsha",
    "+script|load",
    "+script|exists",
    "+cluster|slots",
    "+cluster|shards",
    "+command",
    "+asking",
)


def redis_client(
    url: str, timeout_s: float = REDIS_TIMEOUT_S, ca: str = ""
) -> aioredis.Redis | RedisCluster:
    """A client of `url` — redis:// or rediss://, redis+cluster:// (a RedisCluster) or
    redis+sentinel:// (the master a Sentinel names, followed across failovers), see
    specdec/serving/redis_topology.py — with a username and password in the URL, or the
    password from SPECDEC_REDIS_PASSWORD; `ca` verifies a TLS server. RedisConfigError (naming
    --redis-url) for a malformed URL."""
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    return client_for(url, options, os.environ.get(PASSWORD_ENV), ca)


def worker_key(role: str, address: str) -> str:
    return f"{PREFIX}{{{role}}}:{address}"


def index_key(role: str) -> str:
    """The set of a role's registered addresses (same slot as their entries)."""
    return f"specdec:workers:{{{role}}}"


class Registration:
    """Keeps one worker's registry entry alive until stopped, then deletes it."""

    def __init__(
        self,
        redis_url: str,
        role: str,
        address: str,
        describe: Callable[[], dict],
        heartbeat_s: float,
        redis_ca: str = "",
    ):
        self.redis = redis_client(redis_url, ca=redis_ca)
        self.key = worker_key(role, address)
        self.index = index_key(role)
        self.address = address
        self.describe = describe
        self.heartbeat_s = heartbeat_s
        self._task: asyncio.Task | None = None

    async def beat(self) -> None:
        ttl_ms = int(self.heartbeat_s * 3000)
        await self.redis.set(self.key, json.dumps(self.describe()), px=ttl_ms)
        await self.redis.sadd(self.index, self.address)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except Exception as exc:  # noqa: BLE001 - Redis down: keep serving, retry
                log.warning("registry heartbeat failed: %s", exc)

    async def start(self) -> None:
        """First heartbeat now (a Redis outage only delays registration), then periodically."""
        try:
            await self.beat()
        except Exception as exc:  # noqa: BLE001 - keep serving; the loop retries
            log.warning("registry unreachable at start-up, will retry: %s", exc)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task  # no heartbeat write may land after the delete
        try:
            await self.redis.delete(self.key)
            await self.redis.srem(self.index, self.address)
        except Exception as exc:  # noqa: BLE001 - the entry then expires by its TTL
            log.warning("registry delete failed: %s", exc)
        finally:
            await self.redis.aclose()


async def list_workers(redis: aioredis.Redis | RedisCluster, role: str) -> list[dict]:
    """Registered workers of one role (entries whose heartbeat has not expired): the
    addresses in the role's set, their entries in one MGET; addresses whose entry expired
    are removed from the set."""
    addresses = sorted(
        a.decode() if isinstance(a, bytes) else a for a in await redis.smembers(index_key(role))
    )
    if not addresses:
        return []
    raws = await redis.mget([worker_key(role, a) for a in addresses])
    gone = [a for a, raw in zip(addresses, raws) if not raw]
    if gone:
        await redis.srem(index_key(role), *gone)
    return [json.loads(raw) for raw in raws if raw]

"""The Redis topologies specdec reaches: the --redis-url forms, the client each one gets,
and what differs on a cluster (one Lua script over many sessions, one slot each).

  redis://[user:password@]host:port[/db]                     one Redis (rediss:// over TLS)
  redis+cluster://[user:password@]host:port[,host:port...]/  a Redis Cluster (startup nodes)
  redis+sentinel://[user:password@]host:port[,host:port...]/<master>[/<db>]
                                                             the master a Sentinel names
  rediss+cluster://, rediss+sentinel://                      the same over TLS

The user and password are the data nodes' (ACL); a Sentinel itself is reached without auth
unless the URL has `?sentinel_password=...` (and `&sentinel_username=...`). Cluster and
Sentinel clients follow resharding and failovers themselves.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

FLAG = "--redis-url"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
SENTINEL_QUERY = ("sentinel_username", "sentinel_password")


class RedisConfigError(ValueError):
    """A --redis-url that cannot work; the message names the flag (a start-up usage error)."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed --redis-url."""

    kind: str  # "single" | "cluster" | "sentinel"
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()  # cluster startup nodes or sentinels
    username: str | None = None
    password: str | None = None
    db: int = 0
    master: str = ""  # the Sentinel's name of the master
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def _split_scheme(url: str) -> tuple[str, str, str]:
    """(scheme, kind, rest) of `url`; kind is single, cluster or sentinel."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise RedisConfigError(f"{FLAG}: not a URL (expected redis://host:port/...)")
    scheme = scheme.lower()
    if scheme in PLAIN_SCHEMES:
        return scheme, "single", rest
    base, _, kind = scheme.partition("+")
    if base in ("redis", "rediss") and kind in ("cluster", "sentinel"):
        return scheme, kind, rest
    raise RedisConfigError(
        f"{FLAG}: unknown scheme {scheme}:// (use redis://, rediss://, redis+cluster://, "
        "rediss+cluster://, redis+sentinel:// or rediss+sentinel://)"
    )


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    parts = urllib.parse.urlsplit("//" + text)
    try:
        port = parts.port
    except ValueError:
        raise RedisConfigError(f"{FLAG}: bad port in {text!r}") from None
    if not parts.hostname:
        raise RedisConfigError(f"{FLAG}: empty host in {text!r}")
    return parts.hostname, port or default_port


def _db(text: str) -> int:
    if not text.isdigit():
        raise RedisConfigError(f"{FLAG}: database {text!r} is not a number")
    return int(text)


def parse_redis_url(url: str) -> RedisTarget:
    """Check `url` and take it apart; RedisConfigError naming --redis-url when it is
    malformed (unknown scheme, no hosts, a bad port, no Sentinel master name, ...)."""
    scheme, kind, rest = _split_scheme(url.strip())
    tls = scheme.startswith("rediss")
    if kind == "single":
        try:
            urllib.parse.urlsplit(url).port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise RedisConfigError(f"{FLAG}: {exc}") from None
        return RedisTarget("single", tls)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    hosts = tuple(_host_port(h, DEFAULT_PORT[kind]) for h in hostlist.split(",") if hostlist)
    if not hosts:
        raise RedisConfigError(f"{FLAG}: {scheme}:// needs at least one host:port")
    options = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    allowed = SENTINEL_QUERY if kind == "sentinel" else ()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise RedisConfigError(f"{FLAG}: {scheme}:// does not take ?{unknown[0]}=")
    segments = [s for s in path.split("/") if s]
    if kind == "cluster":
        if segments not in ([], ["0"]):
            raise RedisConfigError(f"{FLAG}: a Redis Cluster has only database 0 (got /{path})")
        return RedisTarget("cluster", tls, hosts, username, password)
    if not segments:
        raise RedisConfigError(
            f"{FLAG}: {scheme}:// needs the master's name: "
            f"{scheme}://host:{DEFAULT_PORT['sentinel']}/<master-name>[/<db>]"
        )
    if len(segments) > 2:
        raise RedisConfigError(f"{FLAG}: expected /<master-name>[/<db>], got /{path}")
    db = _db(segments[1]) if len(segments) == 2 else 0
    return RedisTarget(
        "sentinel",
        tls,
        hosts,
        username,
        password,
        db,
        urllib.parse.unquote(segments[0]),
        options.get("sentinel_username") or None,
        options.get("sentinel_password") or None,
    )


def check_redis_url(url: str) -> None:
    """Refuse (RedisConfigError naming --redis-url) a malformed URL; empty means embedded or
    none."""
    if url:
        parse_redis_url(url)


def redact(url: str) -> str:
    """`url` with its passwords (the data nodes' and a sentinel_password) replaced, for logs
    and terminals."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, q, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = userinfo.partition(":")[0] + ":***@" + hosts
    if q:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        hidden = [(k, "***" if "password" in k.lower() else v) for k, v in pairs]
        query = urllib.parse.urlencode(hidden, safe="*")
    return f"{scheme}{sep}{netloc}{slash}{path}{q}{query}"


class SentinelRedis(aioredis.Redis):
    """The master's client from a Sentinel; closing it also closes the Sentinel connections."""

    sentinel: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel is not None:
                await self.sentinel.aclose()


def client_for(url: str, options: dict, password: str | None, ca: str):
    """The asyncio client of `url` with connection `options` (timeouts), `password` when the
    URL has none, and `ca` to verify a TLS server."""
    target = parse_redis_url(url)
    if target.kind == "single":
        if password and not urllib.parse.urlsplit(url).password:
            options = {**options, "password": password}
        if ca:
            options = {**options, "ssl_ca_certs": ca}
        return aioredis.from_url(url, **options)
    tls = {"ssl": True, **({"ssl_ca_certs": ca} if ca else {})} if target.tls else {}
    auth = {"username": target.username, "password": target.password or password}
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return RedisCluster(startup_nodes=nodes, **auth, **options, **tls)
    sentinel_auth = {"username": target.sentinel_username, "password": target.sentinel_password}
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs={**options, **tls, **sentinel_auth})
    client = sentinel.master_for(
        target.master, redis_class=SentinelRedis, db=target.db, **auth, **options, **tls
    )
    client.sentinel = sentinel
    return client


async def run_script_many(redis, script: AsyncScript, calls: list[tuple[list[str], list]]) -> list:
    """`script` once per (keys, args) in `calls`, in one pipeline: one round trip on a plain
    Redis, one per primary (concurrently) on a cluster. Raises the first error.

    redis-py's cluster pipeline refuses `evalsha` and never loads scripts, so there EVALSHA
    goes in as a raw command (routed by its keys' slot) and the calls a primary answers
    NOSCRIPT are sent again after SCRIPT LOAD on every primary — only those, so none runs
    twice."""
    if not isinstance(redis, RedisCluster):
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()
    results: list = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for i in todo:
            keys, args = calls[i]
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        for i, result in zip(todo, await pipe.execute(raise_on_error=False)):
            results[i] = result
        todo = [i for i in todo if isinstance(results[i], NoScriptError)]
        if not todo or attempt:
            break
        await redis.script_load(script.script)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results

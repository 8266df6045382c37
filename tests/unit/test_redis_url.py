"""--redis-url forms: what each parses to, the refusals that name the flag, redaction, and
the client class each form gets (no server needed: clients connect lazily)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from specdec.serving.redis_topology import RedisConfigError, RedisTarget, parse_redis_url
from specdec.serving.registry import redact, redis_client


@pytest.mark.parametrize(
    "url, target",
    [
        ("redis://:pw@127.0.0.1:6379/0", RedisTarget("single", False)),
        ("rediss://u:pw@cache:6380/1", RedisTarget("single", True)),
        (
            "redis+cluster://u:p%40ss@a:7000,b:7001,[::1]:7002/",
            RedisTarget("cluster", False, (("a", 7000), ("b", 7001), ("::1", 7002)), "u", "p@ss"),
        ),
        ("rediss+cluster://a", RedisTarget("cluster", True, (("a", 6379),))),
        (
            "redis+sentinel://:pw@s1:26380,s2/mymaster/2?sentinel_password=sp",
            RedisTarget(
                "sentinel", False, (("s1", 26380), ("s2", 26379)), None, "pw", 2, "mymaster",
                None, "sp",
            ),
        ),
        (
            "rediss+sentinel://specdec@s1/m",
            RedisTarget("sentinel", True, (("s1", 26379),), "specdec", None, 0, "m"),
        ),
    ],
)  # fmt: skip
def test_each_form_parses(url, target):
    assert parse_redis_url(url) == target


@pytest.mark.parametrize(
    "url, why",
    [
        ("redis+sentinel://s1:26379/", "needs the master's name"),
        ("redis+sentinel://s1:26379/m/1/2", "expected /<master-name>"),
        ("redis+sentinel://s1/m/x", "not a number"),
        ("redis+cluster:///", "at least one host"),
        ("redis+cluster://:pw@/", "at least one host"),
        ("redis+cluster://a:1,,b:2/", "empty host"),
        ("redis+cluster://a:x/", "bad port"),
        ("redis+cluster://a:1/3", "only database 0"),
        ("redis+cluster://a:1/?sentinel_password=x", "does not take"),
        ("redis+sentinel://s/m?password=x", "does not take"),
        ("http://a:1/", "unknown scheme"),
        ("redis+proxy://a:1/", "unknown scheme"),
        ("a:6379", "not a URL"),
        ("redis://a:99999/0", "out of range"),
    ],
)
def test_malformed_urls_are_refused_naming_the_flag(url, why):
    with pytest.raises(RedisConfigError, match=f"^--redis-url: .*{why}"):
        parse_redis_url(url)


def test_a_refusal_never_shows_the_password():
    with pytest.raises(RedisConfigError) as error:
        parse_redis_url("redis+cluster://u:hunter2@a:x/")
    assert "hunter2" not in str(error.value)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis+cluster://u:s3cret@a:1,b:2/", "redis+cluster://u:***@a:1,b:2/"),
        (
            "redis+sentinel://:s3cret@s1,s2/m/0?sentinel_password=t0p&x=1",
            "redis+sentinel://:***@s1,s2/m/0?sentinel_password=***&x=1",
        ),
        ("rediss://u:s3cret@h:6380/0", "rediss://u:***@h:6380/0"),
        ("redis://h:1/0?password=s3cret", "redis://h:1/0?password=***"),
        ("redis+cluster://u@a:1/", "redis+cluster://u@a:1/"),
        ("redis://a:1/0", "redis://a:1/0"),
    ],
)
def test_redact_hides_every_password(url, shown):
    assert redact(url) == shown


def test_each_form_gets_its_client_with_the_timeouts_and_password(monkeypatch):
    """Single: Redis; cluster: RedisCluster with every startup node; sentinel: the master's
    client of a Sentinel over every listed sentinel. The password comes from the URL, else
    SPECDEC_REDIS_PASSWORD; the socket timeouts apply to the data connections."""
    monkeypatch.setenv("SPECDEC_REDIS_PASSWORD", "from-env")

    async def build():
        single = redis_client("redis://a:1/0", timeout_s=0.5)
        cluster = redis_client("redis+cluster://u:pw@a:7000,b:7001/", timeout_s=0.5)
        sentinel = redis_client("redis+sentinel://s1:1,s2:2/m/3?sentinel_password=sp", 0.5)
        try:
            assert type(single) is aioredis.Redis
            assert single.connection_pool.connection_kwargs["password"] == "from-env"
            assert isinstance(cluster, RedisCluster)
            assert sorted(n.name for n in cluster.startup_nodes) == ["a:7000", "b:7001"]
            kwargs = cluster.get_connection_kwargs()
            assert (kwargs["username"], kwargs["password"]) == ("u", "pw")
            assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.5
            pool = sentinel.connection_pool
            assert (pool.service_name, pool.connection_kwargs["db"]) == ("m", 3)
            assert pool.connection_kwargs["password"] == "from-env"
            assert pool.connection_kwargs["socket_timeout"] == 0.5
            sentinels = pool.sentinel_manager.sentinels
            assert [c.connection_pool.connection_kwargs["port"] for c in sentinels] == [1, 2]
            assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
        finally:
            for client in (single, cluster, sentinel):
                await client.aclose()

    asyncio.run(build())

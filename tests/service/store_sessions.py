"""Sessions in a SessionStore on a real Redis, for the store's tests and their reruns
(test_redis_topologies.py, test_tls.py): one store call at a time, a record, a snapshot of a
session's keys, and every store and registry operation once."""

from __future__ import annotations

import asyncio
import uuid

from coordinator.store import Keys, SessionRecord, SessionStore
from specdec.serving.registry import redis_client

LEASE_S, TTL_S = 5.0, 60
LEASE_MS = int(LEASE_S * 1000)


def call(url: str, name: str, *args, **kwargs):
    """Run one SessionStore method (or, with a leading '_', one raw script) in a fresh loop."""

    async def go():
        r = redis_client(url)  # any --redis-url form: test_redis_topologies.py reruns these
        try:
            return await getattr(SessionStore(r, LEASE_S, TTL_S), name)(*args, **kwargs)
        finally:
            await r.aclose()

    return asyncio.run(go())


def record(sid: str, prompt=(1, 2, 3), gamma: int | None = None) -> SessionRecord:
    sampling = {"temperature": 0.7, "top_p": 0.9}
    return SessionRecord(sid, 0, 0, list(prompt), [], sampling, 2**40 + 7, gamma)


def snapshot(db, sid: str) -> dict:
    k = Keys.of(sid)
    return {
        "hash": db.hgetall(k.hash),
        "tokens": db.lrange(k.tokens, 0, -1),
        "text": db.lrange(k.text, 0, -1),
        "lease": db.get(k.lease),
        "cancel": db.get(k.cancel),
        # expiring or not: whole seconds left would flip when a test crosses a second
        "ttls": [db.ttl(key) > 0 for key in (k.hash, k.tokens, k.text)],
    }


def started(url, sid):
    """A session created by c1 with one committed token (version 4, text 'he', rounds=1)."""
    assert call(url, "create", record(sid), "c1") is True
    assert call(url, "commit", sid, "c1", 3, 0, [7], ["he"], {"rounds": 1}) == (4, "")


async def exercise_store(url: str) -> None:
    """Every store and registry operation specdec issues, once, through `url` (the ACL test
    runs this as a least-privilege Redis user)."""
    from specdec.serving.registry import Registration, list_workers

    r = redis_client(url)
    try:
        store = SessionStore(r, LEASE_S, TTL_S)
        sid = f"acl-{uuid.uuid4().hex}"
        assert await store.create(record(sid), "c1")
        assert not await store.create(record(sid), "c1")
        assert await store.reassign(sid, "c1", "d:1", "t:1") == 1
        assert await store.commit(sid, "c1", 3, 1, [7], ["x"], {"rounds": 1}) == (4, "")
        assert await store.renew(sid, "c1", 1)
        assert await store.renew_all("c1", [(sid, 1)]) == [True]
        assert (await store.load(sid)).generated == [7]
        assert await store.release_all("c1", [sid]) == 1
        assert await store.take_over(sid, "c2") == 2
        await store.cancel(sid)
        assert await store.commit(sid, "c2", 4, 2, [8], ["y"], {}) == (5, "CANCELLED")
        registration = Registration(url, "target", "127.0.0.1:1", lambda: {"address": "a"}, 1.0)
        await registration.start()
        assert [w["address"] for w in await list_workers(r, "target")] == ["a"]
        await registration.stop()
        assert await list_workers(r, "target") == []
    finally:
        await r.aclose()

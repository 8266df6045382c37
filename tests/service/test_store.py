"""SessionStore and its Lua scripts (create, commit, renew, take-over, bump) on a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis

from coordinator.store import Keys, LostSession, SessionRecord, SessionStore
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import redis_client

LEASE_S, TTL_S = 5.0, 60
LEASE_MS = int(LEASE_S * 1000)


@pytest.fixture(scope="module")
def url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def db(url):
    client = redis.Redis.from_url(url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def sid() -> str:
    return f"test-{uuid.uuid4().hex}"


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


def test_create_writes_the_hash_and_the_lease(url, db, sid):
    """create returns True, writes every field (version = prompt length, gamma '' for None)
    a lease holding the owner that expires within the lease time, and the session TTL; no lists."""
    before = time.time()
    assert call(url, "create", record(sid), "c1") is True
    k = Keys.of(sid)
    h = db.hgetall(k.hash)
    created, updated = float(h.pop("created")), float(h.pop("updated"))
    assert before <= created == updated <= time.time()
    assert h == {
        "epoch": "0",
        "version": "3",
        "prompt": "[1, 2, 3]",
        "sampling": json.dumps({"temperature": 0.7, "top_p": 0.9}),
        "seed": str(2**40 + 7),
        "gamma": "",
        "logprobs": "",
        "owner": "c1",
        "status": "running",
        "finish_reason": "",
        "stats": "{}",
        "tail": "",
    }
    assert db.get(k.lease) == "c1" and 0 < db.pttl(k.lease) <= LEASE_MS
    assert 0 < db.ttl(k.hash) <= TTL_S and not db.exists(k.tokens, k.text, k.cancel, k.logprobs)


def test_create_refuses_an_existing_id(url, db, sid):
    """A second create with the same id returns False and leaves hash and lease as they were."""
    assert call(url, "create", record(sid), "c1") is True
    before = snapshot(db, sid)
    assert call(url, "create", record(sid, prompt=(9, 9), gamma=5), "c2") is False
    assert snapshot(db, sid) == before


@pytest.mark.parametrize("gamma", [None, 4])
def test_load_round_trips_a_created_record(url, sid, gamma):
    """load gives back prompt, sampling, seed, gamma (None or int), no texts and no tail."""
    call(url, "create", record(sid, prompt=(5, 6), gamma=gamma), "c1")
    got = call(url, "load", sid)
    assert (got.session_id, got.epoch, got.version, got.prompt) == (sid, 0, 2, [5, 6])
    assert got.sampling == {"temperature": 0.7, "top_p": 0.9} and got.seed == 2**40 + 7
    assert got.gamma == gamma and got.generated == [] and got.texts == [] and got.tail == ""
    assert (got.owner, got.status, got.finish_reason, got.stats) == ("c1", "running", "", {})
    assert call(url, "load", f"missing-{uuid.uuid4().hex}") is None


def test_commit_appends_tokens_texts_and_stats(url, db, sid):
    """Commits append tokens and their texts, bump the version by n, store the stats JSON,
    keep the session running with its lease and the session TTL refreshed on every key; zero
    tokens only update stats."""
    started(url, sid)
    k = Keys.of(sid)
    assert call(url, "commit", sid, "c1", 4, 0, [8, 9], ["llo", " wö"], {"rounds": 2}) == (6, "")
    assert call(url, "commit", sid, "c1", 6, 0, [], [], {"rounds": 3}) == (6, "")
    assert db.lrange(k.tokens, 0, -1) == ["7", "8", "9"]
    assert db.lrange(k.text, 0, -1) == ["he", "llo", " wö"]
    h = db.hgetall(k.hash)
    assert (h["version"], h["stats"], h["status"]) == ("6", '{"rounds": 3}', "running")
    assert db.get(k.lease) == "c1"
    assert all(0 < db.ttl(key) <= TTL_S for key in (k.hash, k.tokens, k.text))


@pytest.mark.parametrize("reason", ["EOS", "LENGTH"])
def test_finishing_commit_ends_the_session(url, db, sid, reason):
    """A commit with a finish reason marks the session finished with that reason and tail,
    puts a TTL on hash, tokens and texts, and deletes the lease; load shows it all."""
    started(url, sid)
    k = Keys.of(sid)
    done = call(url, "commit", sid, "c1", 4, 0, [8], ["llo"], {"r": 2}, reason, "!\n")
    assert done == (5, reason)
    h = db.hgetall(k.hash)
    assert (h["status"], h["finish_reason"], h["tail"]) == ("finished", reason, "!\n")
    assert h["version"] == "5" and not db.exists(k.lease)
    assert all(0 < db.ttl(key) <= TTL_S for key in (k.hash, k.tokens, k.text))
    got = call(url, "load", sid)
    assert (got.generated, got.texts, got.tail, got.version) == ([7, 8], ["he", "llo"], "!\n", 5)
    assert (got.status, got.finish_reason, got.stats) == ("finished", reason, {"r": 2})
    assert got.owner == ""  # load reports the lease holder, and the lease is gone


@pytest.mark.parametrize(
    "case, owner, version, epoch, why",
    [
        ("other owner", "c2", 4, 0, "lease lost"),
        ("lease deleted", "c1", 4, 0, "lease lost"),
        ("lease expired", "c1", 4, 0, "lease lost"),
        ("stale version", "c1", 3, 0, "version changed"),
        ("ahead version", "c1", 5, 0, "version changed"),
        ("wrong epoch", "c1", 4, 1, "epoch changed"),
        ("epoch checked before version", "c1", 3, 1, "epoch changed"),
    ],
)
def test_commit_refusals_change_nothing(url, db, sid, case, owner, version, epoch, why):
    """A refused commit (even a finishing one) raises LostSession naming the reason and leaves
    version, tokens, texts, stats, status and lease untouched."""
    started(url, sid)
    if case == "lease deleted":
        db.delete(Keys.of(sid).lease)
    elif case == "lease expired":
        db.pexpire(Keys.of(sid).lease, 1)
        time.sleep(0.02)
    before = snapshot(db, sid)
    with pytest.raises(LostSession, match=rf"commit refused \({why}\)"):
        call(url, "commit", sid, owner, version, epoch, [9], ["x"], {"rounds": 9}, "EOS", "t")
    assert snapshot(db, sid) == before


@pytest.mark.parametrize("reason, expected", [("", "CANCELLED"), ("EOS", "EOS")])
def test_commit_after_cancel_finishes_the_session(url, db, sid, reason, expected):
    """With the cancel key set, a commit without a finish reason finishes as CANCELLED and
    stores the tail passed in; an explicit finish reason is kept."""
    started(url, sid)
    call(url, "cancel", sid)
    assert call(url, "commit", sid, "c1", 4, 0, [8], ["y"], {}, reason, "end") == (5, expected)
    k = Keys.of(sid)
    h = db.hgetall(k.hash)
    assert (h["status"], h["finish_reason"], h["tail"]) == ("finished", expected, "end")
    assert db.lrange(k.text, 0, -1) == ["he", "y"] and not db.exists(k.lease)
    assert 0 < db.ttl(k.hash) <= TTL_S


def test_logprobs_are_committed_with_their_tokens_and_load_back(url, db, sid):
    rec = record(sid)
    rec.top_logprobs = 2
    assert call(url, "create", rec, "c1") is True
    entries = ["[-0.5, [[7, -0.5], [9, -1.5]]]", "[-0.25, [[8, -0.25], [3, -2.0]]]"]
    assert call(url, "commit", sid, "c1", 3, 0, [7, 8], ["a", "b"], {}, logprobs=entries) == (
        5,
        "",
    )
    loaded = call(url, "load", sid)
    assert (loaded.top_logprobs, loaded.logprobs, loaded.generated) == (2, entries, [7, 8])
    k = Keys.of(sid)
    assert 0 < db.ttl(k.logprobs) <= TTL_S
    with pytest.raises(ValueError, match="log-probability entry"):
        call(url, "commit", sid, "c1", 5, 0, [1], ["x"], {}, logprobs=[])
    plain = record(sid + "-plain")
    assert call(url, "create", plain, "c1") is True
    assert call(url, "load", sid + "-plain").top_logprobs is None


def test_commit_rejects_texts_not_matching_tokens(url, db, sid):
    """One text per token: a mismatch raises ValueError and the session stays as it was."""
    started(url, sid)
    before = snapshot(db, sid)
    with pytest.raises(ValueError, match="one text"):
        call(url, "commit", sid, "c1", 4, 0, [8, 9], ["x"], {}, "EOS")
    assert snapshot(db, sid) == before


def test_renew_extends_the_owners_lease(url, db, sid):
    """renew by the lease owner returns True and pushes the lease expiry back to the full time."""
    call(url, "create", record(sid), "c1")
    lease = Keys.of(sid).lease
    db.pexpire(lease, 1000)
    assert call(url, "renew", sid, "c1", 0) is True
    assert db.get(lease) == "c1" and 1000 < db.pttl(lease) <= LEASE_MS


def test_renew_counts_a_finished_session_as_kept(url, db, sid):
    """After the final commit deleted the lease, the script returns 2 (renew True) and does not
    bring the lease back."""
    started(url, sid)
    call(url, "commit", sid, "c1", 4, 0, [], [], {}, "EOS")
    k = Keys.of(sid)
    keys = [k.lease, k.hash, k.tokens, k.text]
    assert call(url, "_renew", keys=keys, args=["c1", LEASE_MS, 0, TTL_S]) == 2
    assert call(url, "renew", sid, "c1", 0) is True
    assert not db.exists(k.lease)


def test_renew_takes_back_an_expired_lease(url, db, sid):
    """A lease that expired while nobody took over (same epoch, running) is taken back."""
    call(url, "create", record(sid), "c1")
    lease = Keys.of(sid).lease
    db.delete(lease)
    assert call(url, "renew", sid, "c1", 0) is True
    assert db.get(lease) == "c1" and 0 < db.pttl(lease) <= LEASE_MS


@pytest.mark.parametrize("case", ["another owner holds the lease", "lease gone, epoch moved"])
def test_renew_refuses_when_another_may_own_it(url, db, sid, case):
    """renew returns False (script 0) and changes nothing when another coordinator holds the
    lease, or when the lease is gone and the epoch is no longer ours."""
    call(url, "create", record(sid), "c1")
    k = Keys.of(sid)
    if case == "another owner holds the lease":
        db.set(k.lease, "c2", px=LEASE_MS)
    else:
        db.delete(k.lease)
    before = snapshot(db, sid)
    epoch = 0 if case == "another owner holds the lease" else 1
    assert call(url, "renew", sid, "c1", epoch) is False
    assert call(url, "_renew", keys=[k.lease, k.hash], args=["c1", LEASE_MS, epoch]) == 0
    assert snapshot(db, sid) == before


def test_take_over_waits_while_the_lease_is_held(url, db, sid):
    """take_over returns None while the lease is held and leaves epoch, owner and lease alone."""
    call(url, "create", record(sid), "c1")
    before = snapshot(db, sid)
    assert call(url, "take_over", sid, "c2") is None
    assert snapshot(db, sid) == before


def test_take_over_after_the_lease_is_gone(url, db, sid):
    """After the lease is gone take_over returns epoch+1 and makes the new owner the lease
    holder; the old owner's commit and renew are then refused, the new owner's commit lands."""
    started(url, sid)
    k = Keys.of(sid)
    db.delete(k.lease)
    assert call(url, "take_over", sid, "c2") == 1
    h = db.hgetall(k.hash)
    assert (h["epoch"], h["owner"], db.get(k.lease)) == ("1", "c2", "c2")
    assert 0 < db.pttl(k.lease) <= LEASE_MS
    with pytest.raises(LostSession, match="lease lost"):
        call(url, "commit", sid, "c1", 4, 0, [8], ["x"], {})
    assert call(url, "renew", sid, "c1", 0) is False
    assert call(url, "commit", sid, "c2", 4, 1, [8], ["x"], {}) == (5, "")
    assert call(url, "load", sid).owner == "c2"


def test_reassign_bumps_the_epoch_and_records_workers(url, db, sid):
    """reassign by the lease owner returns the new epoch and records the workers; a commit at
    the old epoch is then refused."""
    started(url, sid)
    assert call(url, "reassign", sid, "c1", "draft:1", "target:2") == 1
    h = db.hgetall(Keys.of(sid).hash)
    assert (h["epoch"], h["draft_worker"], h["target_worker"]) == ("1", "draft:1", "target:2")
    with pytest.raises(LostSession, match="epoch changed"):
        call(url, "commit", sid, "c1", 4, 0, [8], ["x"], {})
    assert call(url, "commit", sid, "c1", 4, 1, [8], ["x"], {}) == (5, "")


def test_reassign_refuses_another_owner(url, db, sid):
    """reassign by a coordinator not holding the lease raises LostSession and changes nothing."""
    started(url, sid)
    before = snapshot(db, sid)
    with pytest.raises(LostSession, match="lease lost"):
        call(url, "reassign", sid, "c2", "draft:1", "target:2")
    assert snapshot(db, sid) == before


def test_cancel_sets_the_flag_with_a_ttl(url, db, sid):
    """cancel sets the cancel key (with a TTL) and does not by itself finish the session."""
    started(url, sid)
    call(url, "cancel", sid)
    k = Keys.of(sid)
    assert db.get(k.cancel) == "1" and 0 < db.ttl(k.cancel) <= TTL_S
    assert db.hget(k.hash, "status") == "running" and db.get(k.lease) == "c1"


def test_two_sessions_share_no_keys(url, db, sid):
    """Distinct ids get distinct keys: commits, cancel and finish on one leave the other as
    it was, and the other still commits without being cancelled."""
    other = f"test-{uuid.uuid4().hex}"
    started(url, sid)
    started(url, other)
    assert not set(vars(Keys.of(sid)).values()) & set(vars(Keys.of(other)).values())
    before = snapshot(db, other)
    call(url, "commit", sid, "c1", 4, 0, [8, 9], ["a", "b"], {"rounds": 5})
    call(url, "cancel", sid)
    assert call(url, "commit", sid, "c1", 6, 0, [], [], {}) == (6, "CANCELLED")
    assert snapshot(db, other) == before
    assert call(url, "commit", other, "c1", 4, 0, [8], ["c"], {}) == (5, "")


def test_take_over_refuses_finished_and_missing_sessions(url, db, sid):
    """Nothing to take: a finished session (its lease is gone) or an id with no session gets
    None, and no lease, stub hash or epoch bump is written."""
    started(url, sid)
    assert call(url, "commit", sid, "c1", 4, 0, [5], ["x"], {}, "EOS", "") == (5, "EOS")
    before = snapshot(db, sid)
    assert call(url, "take_over", sid, "c2") is None
    assert snapshot(db, sid) == before
    missing = f"test-{uuid.uuid4().hex}"
    assert call(url, "take_over", missing, "c2") is None
    assert db.exists(*vars(Keys.of(missing)).values()) == 0  # not even a stub hash


def test_an_id_cannot_reach_another_sessions_keys(url, db, sid):
    """Ids may contain ':'; "<sid>:cancel" is a session of its own, never <sid>'s cancel flag,
    and every key of a session shares one Redis Cluster hash tag."""
    started(url, sid)
    other = f"{sid}:cancel"
    assert call(url, "create", record(other), "c2") is True
    assert call(url, "commit", sid, "c1", 4, 0, [9], ["y"], {}) == (5, "")  # not cancelled
    assert db.hget(Keys.of(other).hash, "owner") == "c2"
    k = Keys.of(sid)
    tags = {key[key.index("{") : key.index("}") + 1] for key in vars(k).values()}
    assert tags == {"{" + sid + "}"}


def test_a_running_session_lives_while_renewed_and_expires_when_abandoned(url, db):
    """Every key of a running session carries the session TTL, refreshed by each commit,
    renewal and takeover; a session whose owner stops renewing (a crashed coordinator) and
    that nobody resumes is gone after the TTL instead of "running" forever."""

    async def scenario(sid: str, keep_renewing: bool):
        r = redis_client(url)
        store = SessionStore(r, lease_s=0.5, ttl_s=2)
        try:
            await store.create(record(sid), "c1")
            await store.commit(sid, "c1", 3, 0, [7], ["he"], {})
            for _ in range(6):  # 3 s, past the 2 s TTL
                await asyncio.sleep(0.5)
                if keep_renewing:
                    assert await store.renew(sid, "c1", 0)
            return await store.load(sid)
        finally:
            await r.aclose()

    alive = asyncio.run(scenario(f"kept-{uuid.uuid4().hex}", keep_renewing=True))
    assert alive is not None and alive.generated == [7] and alive.status == "running"
    k = Keys.of(alive.session_id)
    assert all(0 < db.ttl(key) <= 2 for key in (k.hash, k.tokens, k.text))
    abandoned_id = f"abandoned-{uuid.uuid4().hex}"
    assert asyncio.run(scenario(abandoned_id, keep_renewing=False)) is None
    k = Keys.of(abandoned_id)
    assert not db.exists(k.hash, k.tokens, k.text, k.lease)


def test_renew_all_renews_many_sessions_in_one_pipeline(url, db):
    """One call for every session of a coordinator: each gets its own answer, exactly as
    `renew` would give it (kept, finished-is-kept, taken over by another)."""
    ids = [f"many-{i}-{uuid.uuid4().hex}" for i in range(3)]
    for sid in ids:
        started(url, sid)
    call(url, "commit", ids[1], "c1", 4, 0, [], [], {}, "EOS")  # finished: counts as kept
    db.set(Keys.of(ids[2]).lease, "c2")  # another coordinator holds it now
    for sid in ids:
        db.pexpire(Keys.of(sid).lease, 1000)
    assert call(url, "renew_all", "c1", [(sid, 0) for sid in ids]) == [True, True, False]
    assert 1000 < db.pttl(Keys.of(ids[0]).lease) <= LEASE_MS
    assert db.get(Keys.of(ids[2]).lease) == "c2"
    assert call(url, "renew_all", "c1", []) == []


def test_release_all_gives_up_only_our_leases(url, db):
    ours, theirs = f"rel-ours-{uuid.uuid4().hex}", f"rel-theirs-{uuid.uuid4().hex}"
    started(url, ours)
    started(url, theirs)
    db.set(Keys.of(theirs).lease, "c2")
    assert call(url, "release_all", "c1", [ours, theirs]) == 1
    assert not db.exists(Keys.of(ours).lease) and db.get(Keys.of(theirs).lease) == "c2"
    assert call(url, "take_over", ours, "c3") == 1  # at once, not after the lease time
    assert call(url, "release_all", "c1", []) == 0


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


def test_exercise_store_runs_as_the_default_user(url):
    asyncio.run(exercise_store(url))

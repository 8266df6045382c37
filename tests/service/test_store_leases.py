"""SessionStore leases on a real Redis: renew (one session or many), take-over, reassign (the
epoch bump), release, and the session TTL that ends an abandoned session."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import grpc
import pytest
from store_sessions import LEASE_MS, LEASE_S, TTL_S, call, record, snapshot, started

from coordinator.links import SessionLinks
from coordinator.stats import Stats
from coordinator.store import Keys, LostSession, SessionStore
from specdec.serving.registry import redis_client


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


class _RefusingWorker:
    """A worker that refuses every base (FAILED_PRECONDITION), as one does a stale epoch."""

    address, in_flight = "target-a:1", 0

    def call(self, method: str):
        async def refuse(request, timeout=None, metadata=None):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "base.epoch 0 is older than the worker's epoch 1",
            )

        return refuse


@pytest.mark.parametrize("taken_over", [True, False])
def test_a_worker_refusing_the_epoch_after_a_take_over_is_a_lost_session(url, db, sid, taken_over):
    """A coordinator that stalled past its lease comes back to a worker refusing its epoch
    before its lease renewal noticed: when the session has moved to a later epoch that is a
    lost session (the run stops, its streams follow the new owner), not an internal error.
    Negative control: at the session's own epoch the refusal stays the worker's error."""
    call(url, "create", record(sid), "c1")
    if taken_over:
        db.delete(Keys.of(sid).lease)  # c1 stalled past its lease
        assert call(url, "take_over", sid, "c2") == 1

    async def go():
        r = redis_client(url)
        try:
            ctx = SimpleNamespace(
                store=SessionStore(r, LEASE_S, TTL_S), count=lambda *a, **k: None, owner="c1"
            )
            links = SessionLinks(ctx, sid, 0, {}, Stats())
            links.target.worker = _RefusingWorker()
            await links._call(links.target, "Verify", [1, 2, 3], lambda base, delta: None, 1.0)
        finally:
            await r.aclose()

    expected = LostSession if taken_over else grpc.aio.AioRpcError
    with pytest.raises(expected):
        asyncio.run(go())


@pytest.mark.parametrize("waits", [True, False])
def test_a_failover_waits_for_the_commit_in_flight_at_the_old_epoch(url, db, sid, waits):
    """The commit runs behind the next round's calls; when one of those fails over, the epoch
    bump waits for that commit (it carries the old epoch). Bumped first, the commit finds the
    epoch moved and the run loses its own session — recovered only by a takeover (a CI run
    of b8e8d24: a draft killed mid-stream ended in one). Negative control: a commit the links
    do not know of (`waits` False) is refused."""
    started(url, sid)  # epoch 0, version 4
    worker = SimpleNamespace(address="draft-b:1", sessions=set())
    pool = SimpleNamespace(pick=lambda prefer="", exclude=(): worker)

    async def go():
        r = redis_client(url)
        try:
            store = SessionStore(r, LEASE_S, TTL_S)
            ctx = SimpleNamespace(
                store=store, count=lambda *a, **k: None, owner="c1", pool=lambda role: pool
            )
            links = SessionLinks(ctx, sid, 0, {}, Stats())

            async def commit():  # a commit slow to reach Redis, at the epoch it was made at
                epoch = links.epoch
                await asyncio.sleep(0.05)
                return await store.commit(sid, "c1", 4, epoch, [8], ["llo"], {"rounds": 2})

            landing = asyncio.create_task(commit())
            if waits:
                links.landing = landing
            assert await links.attach("draft", exclude={"draft-a:1"})
            return links.epoch, await landing
        finally:
            await r.aclose()

    if not waits:
        with pytest.raises(LostSession):
            asyncio.run(go())
        return
    assert asyncio.run(go()) == (1, (5, ""))
    k = Keys.of(sid)
    assert db.lrange(k.tokens, 0, -1) == ["7", "8"]
    assert db.hget(k.hash, "epoch") == "1" and db.get(k.lease) == "c1"

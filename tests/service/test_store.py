"""SessionStore and its Lua scripts on a real Redis: create, load, commit (the compare-and-set
and its refusals), cancel, and each session's own keys."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from store_sessions import (
    LEASE_MS,
    TTL_S,
    call,
    exercise_store,
    record,
    snapshot,
    started,
)

from coordinator.store import Keys, LostSession


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


def test_exercise_store_runs_as_the_default_user(url):
    asyncio.run(exercise_store(url))

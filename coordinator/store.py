"""Versioned sessions in Redis: records, leases and the atomic commit (compare-and-set).

Keys per session (prefix specdec:session:{<id>}; ids are [A-Za-z0-9._:-], so the braces both
keep one id from reaching another's keys — "a:cancel" is not a's cancel flag — and make the
id the Redis Cluster hash tag: every key of a session is in one slot, as scripts need):
  <p>          hash   epoch, version (= committed length), prompt, sampling, seed, gamma,
                      draft_worker, target_worker, owner, status, finish_reason, stats, tail,
                      created, updated
  <p>:tokens   list   generated tokens, append-only
  <p>:text     list   per generated token, the text that became final with it (`tail` holds
                      what the end of the stream released after the last token)
  <p>:lease    string owner coordinator id, with a TTL renewed while it runs
  <p>:cancel   string set by CancelSession
Every key of a session expires `--session-ttl-s` after its last create, commit, lease renewal
or takeover: a running session lives as long as an owner keeps it, one whose coordinator
crashed and that no client resumes goes away after the TTL, and a finished one stays readable
for the TTL.
Creation and every commit are one Lua script each: a commit checks the lease owner, the epoch
and the expected version, appends tokens and their text and bumps the version atomically
(docs/architecture.md, invariant 4: commit before stream). Every script and every read takes
the keys of one session only, so all of it works on a Redis Cluster; calls over many
sessions (renew_all, release_all) are one pipeline per primary there.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from specdec.serving.redis_topology import run_script_many

PREFIX = "specdec:session:"

# KEYS: hash, lease. ARGV: owner, lease ms, ttl s, then field/value pairs. 1 = created,
# 0 = exists.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: hash, tokens, lease, cancel, text, logprobs. ARGV: owner, version, epoch,
# finish_reason, stats, now, ttl, tail, with logprobs (0 | 1), then n tokens, their n texts and,
# with logprobs, their n log-probability entries. Returns {new version, finish reason} or
# {-1 lease lost | -2 version changed | -3 epoch changed, ''}.
COMMIT = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return {-1, ''} end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[3] then return {-3, ''} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version'))
if version ~= tonumber(ARGV[2]) then return {-2, ''} end
local lists = 2 + tonumber(ARGV[9])
local n = (#ARGV - 9) / lists
if n > 0 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 10, 9 + n))
  redis.call('RPUSH', KEYS[5], unpack(ARGV, 10 + n, 9 + 2 * n))
  if lists == 3 then redis.call('RPUSH', KEYS[6], unpack(ARGV, 10 + 2 * n, 9 + 3 * n)) end
end
redis.call('HSET', KEYS[1], 'version', version + n, 'stats', ARGV[5], 'updated', ARGV[6])
local ttl = tonumber(ARGV[7])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[5], ttl)
redis.call('EXPIRE', KEYS[6], ttl)
local reason = ARGV[4]
if reason == '' and redis.call('EXISTS', KEYS[4]) == 1 then reason = 'CANCELLED' end
if reason ~= '' then
  redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', reason, 'tail', ARGV[8])
  redis.call('DEL', KEYS[3])
end
return {version + n, reason}
"""

# KEYS: lease, hash, then the session's lists. ARGV: owner, lease ms, epoch, ttl s. 1 = kept (or taken
# back; the session's keys then live another ttl), 2 = finished, 0 = another coordinator may
# own the session.
RENEW = """
local kept = false
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  kept = true
elseif redis.call('HGET', KEYS[2], 'status') == 'finished' then
  return 2
elseif redis.call('EXISTS', KEYS[1]) == 0 and redis.call('HGET', KEYS[2], 'epoch') == ARGV[3]
    and redis.call('HGET', KEYS[2], 'status') == 'running' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  kept = true
end
if not kept then return 0 end
for i = 2, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# KEYS: hash, lease, then the session's lists. ARGV: owner, lease ms, now, ttl s. The new epoch; -1
# while the lease is held or when there is no running session to take (finished, expired or
# never created).
TAKE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return -1 end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'updated', ARGV[3])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
  return epoch
end
return -1
"""

# KEYS: lease. ARGV: owner. 1 = our lease deleted (the session may be taken over now).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: hash, lease. ARGV: owner, draft, target. The new epoch, or -1 when the lease is not ours.
BUMP = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'draft_worker', ARGV[2], 'target_worker', ARGV[3])
return epoch
"""

# KEYS: hash, tokens, text, lease, logprobs. The whole session at one instant: {hash as
# field/value pairs, tokens, texts, lease owner (nil when none), logprobs}. A script, not
# MULTI, because redis-py's asyncio cluster transaction runs every queued command through a
# thread and a fresh event loop.
LOAD = """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1),
  redis.call('LRANGE', KEYS[3], 0, -1), redis.call('GET', KEYS[4]),
  redis.call('LRANGE', KEYS[5], 0, -1)}
"""


class LostSession(Exception):
    """This coordinator lost the lease or the compare-and-set; it must stop touching the session."""


@dataclass
class SessionRecord:
    session_id: str
    epoch: int
    version: int
    prompt: list[int]
    generated: list[int]
    sampling: dict
    seed: int
    gamma: int | None
    draft_worker: str = ""
    target_worker: str = ""
    owner: str = ""
    status: str = "running"
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0
    texts: list[str] = field(default_factory=list)  # per generated token
    tail: str = ""  # text released at the end, after the last token's
    top_logprobs: int | None = None  # None: no log-probabilities; else how many alternatives
    logprobs: list[str] = field(default_factory=list)  # per generated token, a JSON entry


@dataclass(frozen=True)
class Keys:
    hash: str
    tokens: str
    text: str
    lease: str
    cancel: str
    logprobs: str

    @classmethod
    def of(cls, session_id: str) -> Keys:
        p = PREFIX + "{" + session_id + "}"
        return cls(p, p + ":tokens", p + ":text", p + ":lease", p + ":cancel", p + ":logprobs")

    @property
    def lists(self) -> list[str]:
        """The per-token lists whose TTL follows the session's."""
        return [self.tokens, self.text, self.logprobs]


def timed(method):
    """Report each call's Redis latency to the store's `observe(op, seconds)` hook (metrics)."""

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        if self.observe is None:
            return await method(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return await method(self, *args, **kwargs)
        finally:
            self.observe(method.__name__, time.perf_counter() - t0)

    return wrapper


class SessionStore:
    def __init__(
        self,
        redis: aioredis.Redis,
        lease_s: float,
        ttl_s: int,
        observe: Callable[[str, float], None] | None = None,
    ):
        self.redis = redis
        self.observe = observe
        self.lease_ms = int(lease_s * 1000)
        self.ttl_s = int(ttl_s)
        self._create = redis.register_script(CREATE)
        self._commit = redis.register_script(COMMIT)
        self._renew = redis.register_script(RENEW)
        self._take = redis.register_script(TAKE)
        self._bump = redis.register_script(BUMP)
        self._release = redis.register_script(RELEASE)
        self._load = redis.register_script(LOAD)

    @timed
    async def create(self, record: SessionRecord, owner: str) -> bool:
        """Create a new session owned by `owner`, atomically; False when the id exists."""
        k = Keys.of(record.session_id)
        now = time.time()
        fields = {
            "created": now,
            "epoch": record.epoch,
            "version": len(record.prompt),
            "prompt": json.dumps(record.prompt),
            "sampling": json.dumps(record.sampling),
            "seed": str(record.seed),
            "gamma": "" if record.gamma is None else record.gamma,
            "logprobs": "" if record.top_logprobs is None else record.top_logprobs,
            "owner": owner,
            "status": "running",
            "finish_reason": "",
            "stats": "{}",
            "tail": "",
            "updated": now,
        }
        args = [owner, self.lease_ms, self.ttl_s, *[x for kv in fields.items() for x in kv]]
        return bool(await self._create(keys=[k.hash, k.lease], args=args))

    @timed
    async def load(self, session_id: str) -> SessionRecord | None:
        k = Keys.of(session_id)
        pairs, tokens, texts, owner, logprobs = await self._load(
            keys=[k.hash, k.tokens, k.text, k.lease, k.logprobs]
        )
        f = {key.decode(): value.decode() for key, value in zip(pairs[::2], pairs[1::2])}
        if "prompt" not in f:
            return None
        return SessionRecord(
            session_id=session_id,
            epoch=int(f["epoch"]),
            version=int(f["version"]),
            prompt=json.loads(f["prompt"]),
            generated=[int(t) for t in tokens],
            sampling=json.loads(f["sampling"]),
            seed=int(f["seed"]),
            gamma=int(f["gamma"]) if f.get("gamma") else None,
            draft_worker=f.get("draft_worker", ""),
            target_worker=f.get("target_worker", ""),
            owner=owner.decode() if owner else "",
            status=f.get("status", "running"),
            finish_reason=f.get("finish_reason", ""),
            stats=json.loads(f.get("stats") or "{}"),
            created=float(f.get("created", 0)),
            updated=float(f.get("updated", 0)),
            texts=[t.decode() for t in texts],
            tail=f.get("tail", ""),
            top_logprobs=int(f["logprobs"]) if f.get("logprobs") else None,
            logprobs=[entry.decode() for entry in logprobs],
        )

    @timed
    async def take_over(self, session_id: str, owner: str) -> int | None:
        """Acquire an expired (or released) lease; returns the new epoch, None while it is still
        held or when no running session has this id (then there is nothing to take over)."""
        k = Keys.of(session_id)
        epoch = await self._take(
            keys=[k.hash, k.lease, *k.lists],
            args=[owner, self.lease_ms, time.time(), self.ttl_s],
        )
        return None if epoch == -1 else int(epoch)

    @timed
    async def renew(self, session_id: str, owner: str, epoch: int) -> bool:
        """Extend our lease; False only when another coordinator may own the session now.

        A lease that merely expired (a stalled event loop) while nobody took the session over
        — same epoch, still running — is taken back. A session whose final commit already
        landed (the commit deleted the lease) counts as kept: its loop is about to end.
        """
        k = Keys.of(session_id)
        return bool(
            await self._renew(
                keys=[k.lease, k.hash, *k.lists],
                args=[owner, self.lease_ms, epoch, self.ttl_s],
            )
        )

    @timed
    async def renew_all(self, owner: str, sessions: list[tuple[str, int]]) -> list[bool]:
        """`renew` for many (session id, epoch) pairs in one pipeline: one round trip per tick
        however many sessions a coordinator runs (on a cluster, one per primary, at once)."""
        if not sessions:
            return []
        calls = []
        for session_id, epoch in sessions:
            k = Keys.of(session_id)
            calls.append(([k.lease, k.hash, *k.lists], [owner, self.lease_ms, epoch, self.ttl_s]))
        return [bool(result) for result in await run_script_many(self.redis, self._renew, calls)]

    @timed
    async def release_all(self, owner: str, session_ids: list[str]) -> int:
        """Give up our leases of these sessions (shutdown); returns how many were ours."""
        if not session_ids:
            return 0
        calls = [([Keys.of(session_id).lease], [owner]) for session_id in session_ids]
        return sum(int(r) for r in await run_script_many(self.redis, self._release, calls))

    @timed
    async def reassign(self, session_id: str, owner: str, draft: str, target: str) -> int:
        """Record new workers and bump the epoch (workers then refuse the old epoch)."""
        k = Keys.of(session_id)
        epoch = await self._bump(keys=[k.hash, k.lease], args=[owner, draft, target])
        if epoch == -1:
            raise LostSession(f"session {session_id}: lease lost")
        return int(epoch)

    @timed
    async def commit(
        self,
        session_id: str,
        owner: str,
        version: int,
        epoch: int,
        tokens: list[int],
        texts: list[str],
        stats: dict,
        finish_reason: str = "",
        tail: str = "",
        logprobs: list[str] | None = None,
    ) -> tuple[int, str]:
        """Atomically append tokens (with their text) at `version`; returns (new version,
        finish reason).

        The finish reason is `finish_reason`, or CANCELLED when CancelSession flagged the
        session in the meantime (checked in the same script: no extra round trip per round).
        `tail` is stored when the session ends here: the text its end releases. `logprobs`,
        for a session that asked for them, is one JSON entry per token. Raises LostSession
        when the lease, the epoch or the version no longer match.
        """
        if len(texts) != len(tokens) or (logprobs is not None and len(logprobs) != len(tokens)):
            raise ValueError("commit: one text (and log-probability entry) per token")
        k = Keys.of(session_id)
        result, reason = await self._commit(
            keys=[k.hash, k.tokens, k.lease, k.cancel, k.text, k.logprobs],
            args=[
                owner,
                version,
                epoch,
                finish_reason,
                json.dumps(stats),
                time.time(),
                self.ttl_s,
                tail,
                0 if logprobs is None else 1,
                *tokens,
                *texts,
                *(logprobs or []),
            ],
        )
        if result < 0:
            why = {-1: "lease lost", -2: "version changed", -3: "epoch changed"}[int(result)]
            raise LostSession(f"session {session_id}: commit refused ({why})")
        return int(result), reason.decode() if isinstance(reason, bytes) else reason

    @timed
    async def cancel(self, session_id: str) -> None:
        await self.redis.set(Keys.of(session_id).cancel, "1", ex=self.ttl_s)

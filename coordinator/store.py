"""Versioned sessions in Redis: records, leases and the atomic commit (compare-and-set).

Keys per session (prefix specdec:session:<id>):
  <p>          hash   epoch, version (= committed length), prompt, sampling, seed, gamma,
                      draft_worker, target_worker, owner, status, finish_reason, stats,
                      created, updated
  <p>:tokens   list   generated tokens, append-only
  <p>:lease    string owner coordinator id, with a TTL renewed while it runs
  <p>:cancel   string set by CancelSession
Every commit is one Lua script: it checks the lease owner, the epoch and the expected
version, appends the tokens and bumps the version atomically (ARCHITECTURE.md invariant 4).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

PREFIX = "specdec:session:"

COMMIT = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return {-1, ''} end
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[3] then return {-3, ''} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version'))
if version ~= tonumber(ARGV[2]) then return {-2, ''} end
local n = #ARGV - 7
for i = 8, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], 'version', version + n, 'stats', ARGV[5], 'updated', ARGV[6])
local reason = ARGV[4]
if reason == '' and redis.call('EXISTS', KEYS[4]) == 1 then reason = 'CANCELLED' end
if reason ~= '' then
  redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reason', reason)
  local ttl = tonumber(ARGV[7])
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('DEL', KEYS[3])
end
return {version + n, reason}
"""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('HGET', KEYS[2], 'status') == 'finished' then return 2 end
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('HGET', KEYS[2], 'epoch') == ARGV[3]
    and redis.call('HGET', KEYS[2], 'status') == 'running' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

TAKE = """
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'updated', ARGV[3])
  return epoch
end
return -1
"""

BUMP = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'draft_worker', ARGV[2], 'target_worker', ARGV[3])
return epoch
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


class SessionStore:
    def __init__(self, redis: aioredis.Redis, lease_s: float, ttl_s: int):
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)
        self.ttl_s = int(ttl_s)
        self._commit = redis.register_script(COMMIT)
        self._renew = redis.register_script(RENEW)
        self._take = redis.register_script(TAKE)
        self._bump = redis.register_script(BUMP)

    @staticmethod
    def keys(session_id: str) -> tuple[str, str, str, str]:
        p = PREFIX + session_id
        return p, p + ":tokens", p + ":lease", p + ":cancel"

    async def create(self, record: SessionRecord, owner: str) -> bool:
        """Create a new session owned by `owner`; False when the id already exists."""
        key, _, lease, _ = self.keys(record.session_id)
        now = time.time()
        created = await self.redis.hsetnx(key, "created", now)
        if not created:
            return False
        await self.redis.set(lease, owner, px=self.lease_ms)
        await self.redis.hset(
            key,
            mapping={
                "epoch": record.epoch,
                "version": len(record.prompt),
                "prompt": json.dumps(record.prompt),
                "sampling": json.dumps(record.sampling),
                "seed": str(record.seed),
                "gamma": "" if record.gamma is None else record.gamma,
                "owner": owner,
                "status": "running",
                "finish_reason": "",
                "stats": "{}",
                "updated": now,
            },
        )
        return True

    async def load(self, session_id: str) -> SessionRecord | None:
        key, tokens_key, lease, _ = self.keys(session_id)
        raw = await self.redis.hgetall(key)
        if not raw or b"prompt" not in raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        generated = [int(t) for t in await self.redis.lrange(tokens_key, 0, -1)]
        owner = await self.redis.get(lease)
        return SessionRecord(
            session_id=session_id,
            epoch=int(f["epoch"]),
            version=int(f["version"]),
            prompt=json.loads(f["prompt"]),
            generated=generated,
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
        )

    async def generated_since(self, session_id: str, offset: int) -> list[int]:
        _, tokens_key, _, _ = self.keys(session_id)
        return [int(t) for t in await self.redis.lrange(tokens_key, offset, -1)]

    async def take_over(self, session_id: str, owner: str) -> int | None:
        """Acquire an expired (or released) lease; returns the new epoch, None if still held."""
        key, _, lease, _ = self.keys(session_id)
        epoch = await self._take(keys=[key, lease], args=[owner, self.lease_ms, time.time()])
        return None if epoch == -1 else int(epoch)

    async def renew(self, session_id: str, owner: str, epoch: int) -> bool:
        """Extend our lease; False only when another coordinator may own the session now.

        A lease that merely expired (a stalled event loop) while nobody took the session over
        — same epoch, still running — is taken back. A session whose final commit already
        landed (the commit deleted the lease) counts as kept: its loop is about to end.
        """
        key, _, lease, _ = self.keys(session_id)
        return bool(await self._renew(keys=[lease, key], args=[owner, self.lease_ms, epoch]))

    async def reassign(self, session_id: str, owner: str, draft: str, target: str) -> int:
        """Record new workers and bump the epoch (workers then refuse the old epoch)."""
        key, _, lease, _ = self.keys(session_id)
        epoch = await self._bump(keys=[key, lease], args=[owner, draft, target])
        if epoch == -1:
            raise LostSession(f"session {session_id}: lease lost")
        return int(epoch)

    async def commit(
        self,
        session_id: str,
        owner: str,
        version: int,
        epoch: int,
        tokens: list[int],
        stats: dict,
        finish_reason: str = "",
    ) -> tuple[int, str]:
        """Atomically append tokens at `version`; returns (new version, finish reason).

        The finish reason is `finish_reason`, or CANCELLED when CancelSession flagged the
        session in the meantime (checked in the same script: no extra round trip per round).
        Raises LostSession when the lease, the epoch or the version no longer match.
        """
        key, tokens_key, lease, cancel = self.keys(session_id)
        result, reason = await self._commit(
            keys=[key, tokens_key, lease, cancel],
            args=[
                owner,
                version,
                epoch,
                finish_reason,
                json.dumps(stats),
                time.time(),
                self.ttl_s,
                *tokens,
            ],
        )
        if result < 0:
            why = {-1: "lease lost", -2: "version changed", -3: "epoch changed"}[int(result)]
            raise LostSession(f"session {session_id}: commit refused ({why})")
        return int(result), reason.decode() if isinstance(reason, bytes) else reason

    async def cancel(self, session_id: str) -> None:
        _, _, _, cancel = self.keys(session_id)
        await self.redis.set(cancel, "1", ex=self.ttl_s)

"""The sessions one worker holds: base checks, sync to the committed prefix, LRU eviction
under a session count and a KV memory budget (invariant 3: no computation on a wrong history)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from specdec.core.prefix import PrefixDigest
from specdec.engine.kv import KVSession
from specdec.errors import Exhausted, InvalidArgument, NotFound, StaleBase
from specdec.serving.wire import check_session_id, check_tokens


class SessionTable:
    """Sessions of one worker, least recently used first."""

    def __init__(
        self,
        max_sessions: int,
        max_kv_bytes: int,
        vocab_size: int,
        max_context: int,
        extra_bytes=lambda: 0,
    ):
        self.sessions: OrderedDict[str, KVSession] = OrderedDict()
        self.busy: set[str] = set()
        self.locks: dict[str, asyncio.Lock] = {}
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.evictions = 0
        self.extra_bytes = extra_bytes  # other copies of KV the budget counts (a batch's buffers)

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str):
        """Serialise requests of one session and protect it from eviction meanwhile."""
        lock = self.locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            self.busy.add(session_id)
            try:
                yield
            finally:
                self.busy.discard(session_id)
                if not lock._waiters and session_id not in self.sessions:
                    self.locks.pop(session_id, None)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def kv_bytes(self) -> int:
        """Every byte of KV the worker holds: the sessions' buffers and `extra_bytes`."""
        return sum(s.nbytes for s in self.sessions.values()) + self.extra_bytes()

    def resolve(self, base, delta) -> KVSession:
        """Check a request's base against the cache and sync the session to it.

        FAILED_PRECONDITION when the epoch is stale or the worker cannot prove it holds the
        prefix (missing tokens or fingerprint mismatch): the caller re-sends it whole.
        """
        check_session_id(base.session_id, "base.session_id")
        if base.base_len < 1:
            raise InvalidArgument("base.base_len must be >= 1 (a prompt of at least one token)")
        if base.base_len > self.max_context:
            raise InvalidArgument(
                f"base.base_len {base.base_len} exceeds the model context {self.max_context}"
            )
        new_tokens = check_tokens(delta.token_ids, self.vocab_size, "delta.token_ids")
        if delta.start + len(new_tokens) != base.base_len:
            raise InvalidArgument(
                f"delta: start ({delta.start}) + len(token_ids) ({len(new_tokens)}) must equal base.base_len ({base.base_len})"
            )
        session = self.sessions.get(base.session_id)
        if session is not None and base.epoch < session.epoch:
            raise StaleBase(
                f"base.epoch {base.epoch} is older than the worker's epoch {session.epoch}"
            )
        if delta.start == 0:
            history, digest = new_tokens, PrefixDigest()
        elif session is None or len(session.tokens) < delta.start:
            raise StaleBase(
                f"base: the worker does not hold the first {delta.start} tokens; send the full prefix"
            )
        else:
            history = session.tokens[: delta.start] + new_tokens
            # the digest of the last base this worker proved, extended by what follows it
            proven = session.digest if session.digest.length <= delta.start else None
            digest = proven.copy() if proven is not None else PrefixDigest()
        if not base.base_fingerprint and delta.start != 0:
            raise InvalidArgument("base.base_fingerprint is required unless delta.start = 0")
        proof = digest.of(history)
        if base.base_fingerprint and proof != base.base_fingerprint:
            raise StaleBase(
                "base.base_fingerprint does not match the worker's prefix; send the full prefix"
            )
        if session is None:
            session = self._admit(base.session_id)
        self.sessions.move_to_end(base.session_id)
        session.epoch = int(base.epoch)
        session.sync(history, same=delta.start)
        session.digest = digest  # history is the committed prefix now
        return session

    def _admit(self, session_id: str) -> KVSession:
        while len(self.sessions) >= self.max_sessions:
            if not self._evict_one():
                raise Exhausted(f"all {self.max_sessions} sessions are busy (--max-sessions)")
        session = KVSession(session_id)
        self.sessions[session_id] = session
        return session

    def _evict_one(self) -> bool:
        for session_id in self.sessions:
            if session_id not in self.busy:
                del self.sessions[session_id]
                self._drop_lock(session_id)
                self.evictions += 1
                return True
        return False

    def _drop_lock(self, session_id: str) -> None:
        """Forget a gone session's lock unless someone holds or awaits it."""
        lock = self.locks.get(session_id)
        if lock is not None and not lock.locked():
            del self.locks[session_id]

    def enforce_memory(self) -> None:
        """Evict idle sessions (LRU) until the KV buffers fit the memory budget.

        An evicted session is simply re-sent in full later (FAILED_PRECONDITION), never wrong.
        """
        while self.kv_bytes > self.max_kv_bytes and self._evict_one():
            pass

    def release(self, session_id: str, epoch: int) -> int:
        """Drop a session's KV; refused for an epoch older than the worker's (fencing)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id {session_id!r} is not held by this worker")
        if epoch < session.epoch:
            raise StaleBase(f"epoch {epoch} is older than the worker's epoch {session.epoch}")
        del self.sessions[session_id]
        self._drop_lock(session_id)
        return session.kv_len

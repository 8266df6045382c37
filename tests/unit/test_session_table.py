"""SessionTable: base checks, sync to the committed prefix, LRU eviction and per-session holds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.core.prefix import fingerprint
from specdec.errors import Exhausted, InvalidArgument, NotFound, StaleBase
from specdec.v1.common_pb2 import Base, TokenDelta
from specdec.worker.session_table import SessionTable


def make_table(max_sessions: int = 3, max_kv_bytes: int = 1 << 30) -> SessionTable:
    return SessionTable(max_sessions, max_kv_bytes, vocab_size=100, max_context=16)


def full(table: SessionTable, sid: str, tokens: list[int], epoch: int = 0):
    """Resolve a request that sends the whole prefix (delta.start = 0, no fingerprint)."""
    base = Base(session_id=sid, epoch=epoch, base_len=len(tokens))
    return table.resolve(base, TokenDelta(start=0, token_ids=tokens))


def give_kv(session, n: int) -> None:
    """Append n positions of real KV (one layer, 1 head, dim 4, float32: 2048 bytes at first)."""
    session.append_kv([torch.ones(1, n, 4)], [torch.zeros(1, n, 4)])


def snapshot(table: SessionTable):
    return [(sid, list(s.tokens), s.kv_len, s.epoch) for sid, s in table.sessions.items()]


def test_full_prefix_creates_session_with_exact_history_and_epoch():
    """delta.start = 0 admits a new session holding exactly the sent tokens, at the base's epoch."""
    table = make_table()
    session = full(table, "s", [5, 6, 99], epoch=3)
    assert table.sessions["s"] is session and len(table) == 1
    assert (session.session_id, session.tokens) == ("s", [5, 6, 99])
    assert (session.epoch, session.kv_len) == (3, 0)


def test_delta_appends_and_sync_keeps_kv_of_common_prefix_only():
    """A delta with the right fingerprint extends the history; KV survives only where it still matches."""
    table = make_table()
    session = full(table, "s", [5, 6, 7], epoch=1)
    give_kv(session, 2)
    base = Base(session_id="s", epoch=2, base_len=5, base_fingerprint=fingerprint([5, 6, 7, 8, 9]))
    again = table.resolve(base, TokenDelta(start=3, token_ids=[8, 9]))
    assert again is session
    assert (session.tokens, session.kv_len, session.epoch) == ([5, 6, 7, 8, 9], 2, 2)
    # a delta from position 1 rewrites the history: only the KV of token 0 still holds
    base = Base(session_id="s", epoch=2, base_len=4, base_fingerprint=fingerprint([5, 4, 4, 4]))
    table.resolve(base, TokenDelta(start=1, token_ids=[4, 4, 4]))
    assert (session.tokens, session.kv_len) == ([5, 4, 4, 4], 1)


def test_last_history_token_is_never_counted_as_computed():
    """Even with KV for every token, sync keeps kv_len <= len(history) - 1 (it is fed again)."""
    table = make_table()
    session = full(table, "s", [1, 2, 3])
    give_kv(session, 3)
    assert session.kv_len == 3
    base = Base(session_id="s", base_len=3, base_fingerprint=fingerprint([1, 2, 3]))
    table.resolve(base, TokenDelta(start=3, token_ids=[]))
    assert (session.tokens, session.kv_len) == ([1, 2, 3], 2)
    full(table, "s", [1])
    assert (session.tokens, session.kv_len) == ([1], 0)


FP4 = fingerprint([1, 2, 3, 4])
REFUSALS = {
    "empty session_id": (Base(session_id="", base_len=1), TokenDelta(start=0, token_ids=[1]), InvalidArgument, "base.session_id"),
    "base_len 0": (Base(session_id="a", epoch=5, base_len=0), TokenDelta(), InvalidArgument, "base.base_len"),
    "base_len > context": (Base(session_id="a", epoch=5, base_len=17), TokenDelta(token_ids=[1] * 17), InvalidArgument, "base.base_len 17 exceeds the model context 16"),
    "token outside vocab": (Base(session_id="a", epoch=5, base_len=3), TokenDelta(token_ids=[1, 99, 100]), InvalidArgument, "delta.token_ids[2] = 100"),
    "start + len != base_len": (Base(session_id="a", epoch=5, base_len=4, base_fingerprint=FP4), TokenDelta(start=2, token_ids=[3]), InvalidArgument, "delta: start (2) + len(token_ids) (1) must equal base.base_len (4)"),
    "stale epoch": (Base(session_id="a", epoch=4, base_len=4, base_fingerprint=FP4), TokenDelta(start=3, token_ids=[4]), StaleBase, "base.epoch 4 is older than the worker's epoch 5"),
    "unknown session, start > 0": (Base(session_id="new", base_len=2, base_fingerprint=fingerprint([1, 2])), TokenDelta(start=1, token_ids=[2]), StaleBase, "first 1 tokens"),
    "fewer tokens held than start": (Base(session_id="a", epoch=5, base_len=5, base_fingerprint=fingerprint([1, 2, 3, 9, 9])), TokenDelta(start=4, token_ids=[9]), StaleBase, "first 4 tokens"),
    "fingerprint mismatch": (Base(session_id="a", epoch=5, base_len=4, base_fingerprint=fingerprint([1, 2, 3, 5])), TokenDelta(start=3, token_ids=[4]), StaleBase, "base.base_fingerprint does not match"),
    "fingerprint mismatch, new": (Base(session_id="new", base_len=2, base_fingerprint=fingerprint([9, 9])), TokenDelta(token_ids=[1, 2]), StaleBase, "base.base_fingerprint does not match"),
    "missing fingerprint": (Base(session_id="a", epoch=5, base_len=4), TokenDelta(start=3, token_ids=[4]), InvalidArgument, "base.base_fingerprint is required"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_raise_exact_error_naming_field_and_change_nothing(case):
    """Each malformed or unprovable base is refused with its own error; the table stays as it was."""
    base, delta, error, text = REFUSALS[case]
    table = make_table(max_sessions=2)  # full: a refused new session must not evict anyone
    give_kv(full(table, "a", [1, 2, 3], epoch=5), 2)
    full(table, "b", [7, 8])
    before = snapshot(table)
    with pytest.raises(error) as info:
        table.resolve(base, delta)
    assert type(info.value) is error
    assert text in str(info.value)
    assert snapshot(table) == before == [("a", [1, 2, 3], 2, 5), ("b", [7, 8], 0, 0)]
    assert table.evictions == 0


def test_lru_eviction_follows_resolve_order():
    """Admitting beyond max_sessions evicts the least recently resolved idle session."""
    table = make_table(max_sessions=2)
    full(table, "a", [1])
    full(table, "b", [2])
    full(table, "a", [1, 3])  # a becomes the most recently used
    full(table, "c", [4])
    assert list(table.sessions) == ["a", "c"] and table.evictions == 1
    full(table, "d", [5])
    assert list(table.sessions) == ["c", "d"] and table.evictions == 2


def test_held_sessions_are_never_evicted_and_all_busy_is_exhausted():
    """A held LRU session is skipped; with every session held, a new one is refused (Exhausted)."""
    table = make_table(max_sessions=2)
    full(table, "a", [1])
    full(table, "b", [2])

    async def scenario():
        async with table.hold("a"):
            full(table, "c", [3])  # a is LRU but held: b goes
            assert list(table.sessions) == ["a", "c"]
            async with table.hold("c"):
                with pytest.raises(Exhausted, match="all 2 sessions are busy"):
                    full(table, "d", [4])
                assert list(table.sessions) == ["a", "c"] and table.evictions == 1
        full(table, "d", [4])  # nobody busy any more: a (LRU) goes
        assert list(table.sessions) == ["c", "d"] and table.evictions == 2

    asyncio.run(scenario())
    assert table.busy == set()


def test_enforce_memory_evicts_idle_lru_until_budget_fits():
    """enforce_memory drops idle sessions oldest first until kv_bytes <= max_kv_bytes."""
    table = make_table(max_sessions=4, max_kv_bytes=4096)
    for sid in "abc":
        give_kv(full(table, sid, [1, 2]), 1)
    assert [s.nbytes for s in table.sessions.values()] == [2048, 2048, 2048]
    table.enforce_memory()
    assert list(table.sessions) == ["b", "c"] and table.kv_bytes == 4096 and table.evictions == 1
    table.enforce_memory()  # already within budget: nothing more goes
    assert list(table.sessions) == ["b", "c"] and table.evictions == 1


def test_enforce_memory_never_evicts_a_busy_session():
    """Over budget with the LRU session held: idle ones go, the held one stays (even if still over)."""
    table = make_table(max_sessions=4, max_kv_bytes=0)
    for sid in "abc":
        give_kv(full(table, sid, [1, 2]), 1)

    async def scenario():
        async with table.hold("a"):
            table.enforce_memory()
            assert list(table.sessions) == ["a"] and table.kv_bytes == 2048

    asyncio.run(scenario())
    assert table.evictions == 2


def test_release_returns_kv_len_and_removes_session():
    """release hands back the dropped KV length; an unknown id is NotFound."""
    table = make_table()
    give_kv(full(table, "a", [1, 2, 3, 4]), 3)
    full(table, "b", [5])
    assert table.release("a", 0) == 3
    assert list(table.sessions) == ["b"]
    with pytest.raises(NotFound, match="session_id 'a' is not held"):
        table.release("a", 0)
    with pytest.raises(NotFound, match="'nope'"):
        table.release("nope", 0)
    assert list(table.sessions) == ["b"]


def test_hold_serialises_one_session_and_not_others():
    """A second hold on the same session enters only after the first leaves; another session is free."""
    table = make_table()
    log: list[str] = []

    async def scenario():
        gate = asyncio.Event()

        async def first():
            async with table.hold("s"):
                log.append("first in")
                await gate.wait()
                log.append("first out")

        async def second():
            async with table.hold("s"):
                log.append("second in")

        async def other():
            async with table.hold("t"):
                log.append("other in")

        t1 = asyncio.create_task(first())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(second())
        t3 = asyncio.create_task(other())
        for _ in range(5):
            await asyncio.sleep(0)
        assert log == ["first in", "other in"] and table.busy == {"s"}
        gate.set()
        await asyncio.gather(t1, t2, t3)

    asyncio.run(scenario())
    assert log == ["first in", "other in", "first out", "second in"]
    assert table.busy == set() and table.locks == {}  # no session was admitted: locks dropped


def test_locks_of_evicted_and_released_sessions_are_dropped():
    """A session held once and later evicted or released leaves no lock behind."""
    table = make_table(max_sessions=1)

    async def scenario():
        async with table.hold("a"):
            full(table, "a", [1, 2])
        async with table.hold("b"):  # admitting b evicts a (idle)
            full(table, "b", [3, 4])
        assert list(table.sessions) == ["b"] and list(table.locks) == ["b"]
        table.release("b", 0)
        assert table.locks == {}

    asyncio.run(scenario())


def test_the_budget_counts_other_copies_of_kv():
    """kv_bytes includes `extra_bytes` (a batch's KV buffers), and enforce_memory evicts idle
    sessions to make room for them too."""
    extra = {"bytes": 0}
    table = SessionTable(
        3, 4096, vocab_size=100, max_context=16, extra_bytes=lambda: extra["bytes"]
    )
    for sid in ("a", "b"):
        give_kv(full(table, sid, [1, 2, 3]), 2)  # 2048 bytes each
    table.enforce_memory()
    assert list(table.sessions) == ["a", "b"] and table.kv_bytes == 4096
    extra["bytes"] = 2048
    assert table.kv_bytes == 6144
    table.enforce_memory()
    assert list(table.sessions) == ["b"] and table.kv_bytes == 4096


def test_release_is_fenced_by_epoch():
    """A release from a superseded coordinator (older epoch) is refused and keeps the KV."""
    table = make_table()
    give_kv(full(table, "s", [1, 2, 3], epoch=4), 2)
    with pytest.raises(StaleBase, match="epoch 3 is older than the worker's epoch 4"):
        table.release("s", 3)
    assert "s" in table.sessions and table.sessions["s"].kv_len == 2
    assert table.release("s", 4) == 2 and "s" not in table.sessions

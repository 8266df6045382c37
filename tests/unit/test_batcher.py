"""Batcher: concurrent items of many sessions run as one pass, within size and token limits."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from specdec.worker.batcher import Batcher, BatchRun
from specdec.worker.threads import MODEL_THREAD

HANG_S = 30.0  # a lost item would leave its submit waiting forever: fail instead of hanging


def item(session_id: str, value: int):
    """What a worker submits: something with `.session.session_id` (the batcher keys on it)."""
    return SimpleNamespace(session=SimpleNamespace(session_id=session_id), value=value)


class Recorder:
    """A process(items) that records the values of every batch it saw and returns value * 10."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __call__(self, items: list) -> list:
        self.batches.append([x.value for x in items])
        return [x.value * 10 for x in items]


def run(scenario, process, **kwargs):
    """Run scenario(batcher) in a fresh event loop with a started batcher, always stopped."""
    settings = {"max_batch_size": 8, "max_batch_tokens": 1000, "max_wait_ms": 50.0}
    settings.update(kwargs)

    async def main():
        batcher = Batcher(process, **settings)
        batcher.start()
        try:
            return await asyncio.wait_for(scenario(batcher), HANG_S)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_concurrent_sessions_share_one_pass_with_exact_batch_run():
    """Three sessions submitting together run in ONE process call; each gets its own BatchRun."""
    process = Recorder()

    async def scenario(b):
        first = await asyncio.gather(
            b.submit(item("a", 1), 3), b.submit(item("b", 2), 5), b.submit(item("c", 3), 2)
        )
        second = await asyncio.gather(b.submit(item("a", 4), 1), b.submit(item("b", 5), 4))
        return first, second, b.batches_run

    first, second, batches_run = run(scenario, process)
    assert process.batches == [[1, 2, 3], [4, 5]] and batches_run == 2
    assert all(isinstance(r, BatchRun) for r in first + second)
    assert [(r.result, r.batch_size, r.positions, r.batch_seq) for r in first] == [
        (10, 3, 15, 1),
        (20, 3, 15, 1),
        (30, 3, 15, 1),
    ]
    assert [(r.result, r.batch_size, r.positions, r.batch_seq) for r in second] == [
        (40, 2, 8, 2),
        (50, 2, 8, 2),
    ]
    assert all(r.queue_ns >= 0 and r.forward_ns >= 0 for r in first + second)
    assert len({r.forward_ns for r in first}) == 1  # one pass, one forward time


def test_max_batch_size_splits_a_burst():
    """Five items with max_batch_size=2 run as passes of 2, 2 and 1, in submission order."""
    process = Recorder()

    async def scenario(b):
        return await asyncio.gather(*(b.submit(item(f"s{i}", i), 1) for i in range(5)))

    runs = run(scenario, process, max_batch_size=2)
    assert process.batches == [[0, 1], [2, 3], [4]]
    assert [r.batch_seq for r in runs] == [1, 1, 2, 2, 3]
    assert [r.batch_size for r in runs] == [2, 2, 2, 2, 1]
    assert [r.result for r in runs] == [0, 10, 20, 30, 40]


def test_max_batch_tokens_moves_overflowing_item_to_start_next_batch():
    """4 + 4 tokens fit in 10; the 5-token item would overflow, so it opens the next pass."""
    process = Recorder()

    async def scenario(b):
        tokens = [4, 4, 5, 1]
        return await asyncio.gather(*(b.submit(item(f"s{i}", i), t) for i, t in enumerate(tokens)))

    runs = run(scenario, process, max_batch_tokens=10)
    assert process.batches == [[0, 1], [2, 3]]
    assert [(r.batch_seq, r.positions) for r in runs] == [(1, 8), (1, 8), (2, 10), (2, 10)]


def test_lone_session_does_not_wait_for_max_wait():
    """With a 5 s wait allowed (long recent forward), a single active session runs at once."""
    process = Recorder()

    async def scenario(b):
        b.forward_s = 20.0  # so the wait deadline is max_wait_ms (5 s), not a fraction of ~0
        t0 = time.monotonic()
        result = await b.submit(item("solo", 7), 3)
        return result, time.monotonic() - t0, b._active_sessions()

    result, elapsed, active = run(scenario, process, max_wait_ms=5000.0)
    assert (result.result, result.batch_size, result.batch_seq) == (70, 1, 1)
    assert active == 1
    assert elapsed < 2.0  # behaviour bound: it did not sit out the 5 s window


def test_batch_waits_for_active_session_until_forgotten():
    """A pass waits for every recently active session; after forget() it no longer waits for it."""
    process = Recorder()

    async def scenario(b):
        await asyncio.gather(b.submit(item("a", 1), 1), b.submit(item("b", 2), 1))
        b.forward_s = 20.0  # allow waiting up to max_wait_ms (5 s)
        late = asyncio.create_task(b.submit(item("a", 3), 1))
        await asyncio.sleep(0.1)  # a waits for b, which is still active
        run_b = await b.submit(item("b", 4), 1)
        run_a = await late
        before = b._active_sessions()
        b.forget("b")
        b.forget("never-seen")  # unknown ids are ignored
        after = b._active_sessions()
        t0 = time.monotonic()
        alone = await b.submit(item("a", 5), 1)
        return run_a, run_b, before, after, alone, time.monotonic() - t0

    run_a, run_b, before, after, alone, elapsed = run(scenario, process, max_wait_ms=5000.0)
    assert process.batches == [[1, 2], [3, 4], [5]]
    assert (run_a.batch_seq, run_b.batch_seq, run_a.batch_size) == (2, 2, 2)
    assert (before, after) == (2, 1)
    assert (alone.result, alone.batch_size, alone.batch_seq) == (50, 1, 3)
    assert elapsed < 2.0  # did not wait the 5 s window for the forgotten session


def test_exception_result_fails_only_its_item():
    """An Exception instance returned for one item raises from that submit; the others succeed."""
    bad = ValueError("item 2 is bad")

    def process(items):
        return [bad if x.value == 2 else x.value * 10 for x in items]

    async def scenario(b):
        return await asyncio.gather(
            *(b.submit(item(f"s{i}", i), 1) for i in (1, 2, 3)), return_exceptions=True
        )

    one, two, three = run(scenario, process)
    assert two is bad
    assert (one.result, three.result, one.batch_size, three.batch_seq) == (10, 30, 3, 1)


def test_raising_process_fails_whole_batch_and_keeps_serving():
    """An exception raised by process fails every item of that pass; the next pass still runs."""
    seen: list[list[int]] = []

    def process(items):
        seen.append([x.value for x in items])
        if any(x.value == 99 for x in items):
            raise RuntimeError("model crashed")
        return [x.value * 10 for x in items]

    async def scenario(b):
        failed = await asyncio.gather(
            b.submit(item("a", 1), 1), b.submit(item("b", 99), 1), return_exceptions=True
        )
        later = await b.submit(item("a", 5), 1)
        return failed, later

    failed, later = run(scenario, process)
    assert seen == [[1, 99], [5]]
    assert [type(e) for e in failed] == [RuntimeError, RuntimeError]
    assert all(str(e) == "model crashed" for e in failed)
    assert (later.result, later.batch_size, later.batch_seq) == (50, 1, 2)


def test_in_flight_counts_submitted_unfinished_items():
    """in_flight is every submitted, unfinished item (seen from inside process), 0 when done."""
    observed: list[int] = []
    holder: dict[str, Batcher] = {}

    def process(items):
        observed.append(holder["b"].in_flight)
        return [x.value for x in items]

    async def scenario(b):
        holder["b"] = b
        idle = b.in_flight
        await asyncio.gather(*(b.submit(item(f"s{i}", i), 1) for i in range(3)))
        between = b.in_flight
        await b.submit(item("s0", 9), 1)
        return idle, between, b.in_flight

    assert run(scenario, process) == (0, 0, 0)
    assert observed == [3, 1]


@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_every_item_gets_its_own_result(max_batch_size):
    """However the items are split into passes, each submit returns its own item's result."""
    process = Recorder()

    async def scenario(b):
        return await asyncio.gather(*(b.submit(item(f"s{i % 2}", i), 1) for i in range(6)))

    runs = run(scenario, process, max_batch_size=max_batch_size)
    assert [r.result for r in runs] == [0, 10, 20, 30, 40, 50]
    assert [v for batch in process.batches for v in batch] == list(range(6))
    assert max(len(batch) for batch in process.batches) == max_batch_size


def test_too_few_results_fail_every_item_instead_of_hanging():
    """A process that returns fewer results than items (a bug) fails the whole batch."""

    async def scenario(b):
        return await asyncio.gather(
            b.submit(item("a", 1), 1), b.submit(item("b", 2), 1), return_exceptions=True
        )

    results = run(scenario, lambda items: [0])
    assert all(isinstance(r, RuntimeError) and "1 results for 2 items" in str(r) for r in results)


def test_stop_fails_queued_and_running_items():
    """Stopping the batcher fails what is queued or running with Unavailable, never a hang."""
    from specdec.errors import Unavailable

    started = asyncio.Event()

    def slow(items):
        time.sleep(0.3)
        return [x.value for x in items]

    async def main():
        b = Batcher(slow, max_batch_size=1, max_batch_tokens=1000, max_wait_ms=0.0)
        b.start()
        calls = [asyncio.ensure_future(b.submit(item(s, i), 1)) for i, s in enumerate("abc")]
        await asyncio.sleep(0.05)  # the first is in the model thread, the others queued
        started.set()
        await b.stop()
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_S)

    results = asyncio.run(main())
    assert started.is_set()
    assert all(isinstance(r, Unavailable) for r in results), results


def test_the_token_budget_counts_padded_positions():
    """Three 1-token items and an 8-token one sum to 11 tokens, but a pass of all four would
    compute 4 × 8 = 32 positions: the long one starts the next pass (limit 12)."""
    process = Recorder()

    async def scenario(b):
        tokens = [1, 1, 1, 8]
        return await asyncio.gather(*(b.submit(item(f"s{i}", i), t) for i, t in enumerate(tokens)))

    runs = run(scenario, process, max_batch_tokens=12)
    assert process.batches == [[0, 1, 2], [3]]
    assert [r.positions for r in runs] == [3, 3, 3, 8]


def test_a_lone_sessions_round_runs_on_the_loop_thread_and_anything_else_in_the_model_thread():
    """One session's small item skips the model thread (two hand-offs saved); a prefill-sized
    item, or an item while another session is active, still runs there."""
    import threading

    threads: list[str] = []

    def process(items):
        threads.append(threading.current_thread().name)
        return [x.value for x in items]

    async def scenario(b):
        loop_thread = threading.current_thread().name
        await b.submit(item("solo", 1), 5)  # a round of a lone session: inline
        await b.submit(item("solo", 2), 17)  # more than inline_tokens (a prefill chunk)
        b.forward_s, b.max_wait_s = 0.0, 0.0  # two sessions: do not wait for each other
        await asyncio.gather(b.submit(item("solo", 3), 1), b.submit(item("other", 4), 1))
        await b.submit(item("solo", 5), 1)  # "other" was active within the last second
        b.forget("other")
        busy = b.occupy(time.sleep, 0.2)  # the model thread runs something else (a warm-up)
        await b.submit(item("solo", 6), 1)  # waits for it in the model thread, never beside it
        assert busy.done()
        await b.submit(item("solo", 7), 1)  # alone again, model thread idle
        return loop_thread

    loop_thread = run(scenario, process, inline_tokens=16)
    model = [t for t in threads if t != loop_thread]
    assert threads[0] == loop_thread and threads[-1] == loop_thread
    assert len(model) == len(threads) - 2 == 4 and all(t.startswith(MODEL_THREAD) for t in model)


def test_with_more_than_one_torch_thread_every_pass_runs_in_the_model_thread():
    """At threads > 1 a lone session's round also goes to the model thread: a pass on the
    loop's thread would start a second OpenMP pool (specdec.worker.threads)."""
    import threading

    threads: list[str] = []

    def process(items):
        threads.append(threading.current_thread().name)
        return [x.value for x in items]

    async def scenario(b):
        for i in range(3):
            await b.submit(item("solo", i), 1)

    run(scenario, process, inline_tokens=16, threads=2)
    assert len(threads) == 3 and all(t.startswith(MODEL_THREAD) for t in threads), threads

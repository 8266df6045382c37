"""A worker that failed a call comes back to the pool only once it answers again (a static
address whose process died would otherwise take, and fail over, a new session after every
time out), and call streams are used only with workers that say they serve them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from coordinator.pool import PROBE_AGAIN_S, WorkerPool
from specdec.text.tokenizer import load_tokenizer, vocab_fingerprint
from specdec.v1 import common_pb2


def test_a_failed_worker_is_probed_before_it_is_picked_again(loop_thread, model_dirs, start_worker):
    fingerprint = vocab_fingerprint(load_tokenizer(model_dirs["target"]))
    up = start_worker("target", model_dirs["target"])
    down = start_worker("target", model_dirs["target"])
    down.stop()  # its address stays a static one, as after a crash

    async def scenario():
        pool = WorkerPool("target", [up.address, down.address], fingerprint, streams=True)
        await pool.refresh()  # `down` does not answer Info: never joins
        joined = sorted(pool.workers)
        # a call to `up` failed once; its time out is over
        pool.mark_dead(up.address, for_s=0.0)
        before_probe = [w.address for w in pool.alive()]
        pick_before = pool.pick()
        await pool.refresh()  # the probe: Info answers
        after_probe = [w.address for w in pool.alive()]
        lanes = sorted(pool.workers[up.address].lanes)
        batched = pool.workers[up.address].lanes["Verify"].calls_cls is not None
        # a bad answer: quarantined for its time, no probe needed after it
        pool.mark_dead(up.address, for_s=0.0, probe=False)
        after_quarantine = [w.address for w in pool.alive()]
        await pool.close()
        return joined, before_probe, pick_before, after_probe, (lanes, batched), after_quarantine

    joined, before_probe, pick_before, after_probe, (lanes, batched), after_quarantine = (
        loop_thread.run(scenario())
    )
    assert joined == [up.address]
    assert before_probe == [] and pick_before is None, "picked before it answered again"
    assert after_probe == [up.address]
    assert lanes == ["Verify"], "a worker that serves VerifyStream gets its call stream"
    assert batched, "a worker that serves VerifyBatches gets the batched call stream"
    assert after_quarantine == [up.address]


def test_a_worker_that_stays_down_is_probed_again_later(loop_thread, model_dirs, start_worker):
    fingerprint = vocab_fingerprint(load_tokenizer(model_dirs["target"]))
    worker = start_worker("target", model_dirs["target"])

    async def join():
        pool = WorkerPool("target", [worker.address], fingerprint)
        await pool.refresh()
        return pool, [w.address for w in pool.alive()]

    async def probe(pool):
        pool.mark_dead(worker.address, for_s=0.0)  # the call that found it gone
        await pool.refresh()  # the probe finds nothing
        entry = pool.workers[worker.address]
        out_for = entry.dead_until - time.monotonic()
        alive = [w.address for w in pool.alive()]
        await pool.close()
        return alive, out_for, entry.probe

    pool, joined = loop_thread.run(join())
    worker.stop()  # it crashes after it joined
    alive, out_for, probe = loop_thread.run(probe(pool))
    assert joined == [worker.address]
    assert alive == [] and probe
    assert 0.5 * PROBE_AGAIN_S < out_for <= PROBE_AGAIN_S, out_for


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_worker_gets_the_call_stream_it_says_it_serves(role):
    """Batched where Info says call_batches, the per-call stream where only call_streams (a
    worker of the previous version in a rolling upgrade), unary calls where neither, or
    where the coordinator runs --no-worker-streams."""
    method = "Propose" if role == "draft" else "Verify"
    stub = SimpleNamespace(
        **{f"{method}Batches": "batches", f"{method}Stream": "stream", method: "unary"}
    )
    for streams, batches, expected in (
        (True, True, "batches"),
        (True, False, "stream"),
        (False, False, None),
        (False, True, None),
    ):
        info = common_pb2.WorkerInfo(call_streams=streams, call_batches=batches)
        lanes = WorkerPool(role, [], b"", streams=True)._lanes(stub, info)
        assert (lanes[method].open_stream if lanes else None) == expected
        assert not lanes or (lanes[method].calls_cls is not None) == (expected == "batches")
    assert WorkerPool(role, [], b"", streams=False)._lanes(stub, info) == {}

"""The coordinator pairs only workers whose tokenizer vocabulary matches the target's."""

from __future__ import annotations

from coordinator.pool import WorkerPool
from specdec.text.tokenizer import load_tokenizer, vocab_fingerprint


def test_pool_refuses_a_worker_with_another_vocabulary(
    loop_thread, model_dirs, draft, start_worker
):
    fingerprint = vocab_fingerprint(load_tokenizer(model_dirs["target"]))
    stranger = start_worker("draft", model_dirs["other_vocab"])

    async def refresh():
        pool = WorkerPool("draft", [draft.address, stranger.address], fingerprint)
        await pool.refresh()
        alive = [w.address for w in pool.alive()]
        await pool.close()
        return alive, dict(pool.refused)

    alive, refused = loop_thread.run(refresh())
    assert alive == [draft.address]
    assert stranger.address in refused and "vocabulary fingerprint" in refused[stranger.address]

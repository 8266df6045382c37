"""A stream following a live run never skips tokens the run publishes while a chunk is being
written (the generator is suspended at its yield meanwhile)."""

from __future__ import annotations

import asyncio
import types

from coordinator.sessions import Sessions
from specdec.text.detok import FinishReason


class Run:
    """What `Sessions.follow` reads of a live run."""

    def __init__(self):
        self.session_id = "s"
        self.generated, self.texts, self.logprobs = [1, 2], ["a", "b"], []
        self.finish_reason = None
        self.error = None
        self.tail = ""
        self.changed = asyncio.Event()

    def publish(self, tokens, reason=None):
        self.generated += tokens
        self.texts += [str(t) for t in tokens]
        self.finish_reason = reason
        self.changed.set()
        self.changed = asyncio.Event()

    def stats_dict(self):
        return {}


def test_tokens_published_while_a_chunk_is_written_come_next():
    async def follow():
        run = Run()
        sessions = object.__new__(Sessions)

        async def open_(request):
            return run

        sessions.open = open_
        updates = sessions.follow(types.SimpleNamespace(resume_from=0, session_id="s"))
        first = await updates.__anext__()
        # the consumer writes `first` (the generator waits at its yield); the run goes on
        run.publish([3, 4])
        run.publish([5], FinishReason.LENGTH)
        rest = [u async for u in updates]
        return [first, *rest]

    updates = asyncio.run(asyncio.wait_for(follow(), 10))
    assert [(u.offset, list(u.token_ids)) for u in updates] == [
        (0, [1, 2]),
        (2, [3, 4, 5]),
        (5, []),  # the finish
    ]
    assert updates[-1].finish_reason == FinishReason.LENGTH

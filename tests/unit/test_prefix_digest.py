"""Incremental prefix digests (`PrefixDigest`): the same bytes as `fingerprint`, on the
coordinator's side (a committed prefix that grows, candidates drafted ahead after it) and on
the worker's (`SessionTable.resolve` proving a base from the last proven one), with a
negative control of each: a digest that skips a token is caught."""

from __future__ import annotations

import random
from array import array

import pytest

from specdec.core import prefix
from specdec.core.prefix import PrefixDigest, fingerprint
from specdec.engine import kv
from specdec.errors import StaleBase
from specdec.v1.common_pb2 import Base, TokenDelta
from specdec.worker import session_table
from specdec.worker.session_table import SessionTable

VOCAB = 50


class SkipsAToken(PrefixDigest):
    """A broken digest (the negative control): its increments leave out their first token."""

    def advance(self, tokens, length: int) -> None:
        if length > self.length + 1:
            self._state.update(array("I", tokens[self.length + 1 : length]).tobytes())
            self.length = length
        else:
            super().advance(tokens, length)


def coordinator_mismatches(digest_cls, seed: int = 0, rounds: int = 300) -> int:
    """A committed prefix growing by rounds, with blocks drafted ahead of it (a stable part
    and a tail) and calls that come late (their stable part behind the digest): how many
    digests differ from `fingerprint`."""
    rng = random.Random(seed)
    digest, committed, wrong = digest_cls(), [rng.randrange(VOCAB) for _ in range(5)], 0
    for _ in range(rounds):
        ahead = committed + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]
        calls = [(committed, len(committed)), (ahead, len(committed))]
        if len(committed) > 3 and rng.random() < 0.2:  # a late call: stable part behind
            late = committed[: len(committed) - 2] + [rng.randrange(VOCAB) for _ in range(3)]
            calls.append((late, len(committed) - 2))
        for tokens, stable in calls:
            wrong += digest.of(tokens, stable) != fingerprint(tokens)
        committed = committed + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
    return wrong


def test_the_coordinators_digests_equal_whole_prefix_fingerprints():
    assert coordinator_mismatches(PrefixDigest) == 0
    assert coordinator_mismatches(SkipsAToken) > 0  # the check can fail


def worker_rounds(seed: int, rounds: int = 400) -> int:
    """A coordinator's rounds against one worker's SessionTable: deltas from what the worker
    holds, candidates it keeps (the draft) or crops (the target), lies about the prefix
    (a changed committed token the delta does not re-send), resyncs, epoch bumps. Returns
    how often the table's decision or history differs from the whole-prefix reference."""
    rng = random.Random(seed)
    table = SessionTable(4, 1 << 30, vocab_size=VOCAB, max_context=1 << 16)
    committed = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
    synced, epoch, wrong = 0, 1, 0
    for _ in range(rounds):
        claimed = list(committed)
        if synced > 1 and rng.random() < 0.1:  # the coordinator's prefix differs inside
            at = rng.randrange(synced)
            claimed[at] = (claimed[at] + 1) % VOCAB
        if rng.random() < 0.05:
            epoch += 1
        base = Base(
            session_id="s",
            epoch=epoch,
            base_len=len(claimed),
            base_fingerprint=fingerprint(claimed),
        )
        held = table.sessions.get("s")
        start = synced if held is not None else 0
        worker_view = (held.tokens[:start] if held else []) + claimed[start:]
        try:
            session = table.resolve(base, TokenDelta(start=start, token_ids=claimed[start:]))
            wrong += worker_view != claimed or session.tokens != claimed
        except StaleBase:
            wrong += worker_view == claimed  # refused a true prefix
            try:
                session = table.resolve(base, TokenDelta(start=0, token_ids=claimed))
            except StaleBase:  # even the whole prefix
                wrong += 1
                committed, synced = claimed, 0
                continue
        committed = claimed
        # the worker keeps γ candidates after the base; n are accepted, then one more token
        gamma = rng.randrange(0, 5)
        candidates = [rng.randrange(VOCAB) for _ in range(gamma)]
        session.tokens[len(committed) :] = candidates
        accepted = rng.randrange(0, gamma + 1)
        if rng.random() < 0.5:
            session.crop(len(committed) + accepted)  # the target's rollback
        synced = len(committed) + accepted
        committed = committed + candidates[:accepted] + [rng.randrange(VOCAB)]
        if rng.random() < 0.03:
            table.release("s", epoch)
    return wrong


@pytest.mark.parametrize("seed", range(4))
def test_the_workers_incremental_proof_decides_as_the_whole_prefix(seed):
    assert worker_rounds(seed) == 0


def test_a_skipped_token_in_the_workers_digest_is_caught(monkeypatch):
    for module in (prefix, kv, session_table):
        monkeypatch.setattr(module, "PrefixDigest", SkipsAToken)
    assert sum(worker_rounds(seed) for seed in range(4)) > 0

"""Committed-prefix identity: the fingerprint every worker and the coordinator agree on."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def fingerprint(tokens: Sequence[int]) -> bytes:
    """16-byte digest of a token prefix; identical on every worker and the coordinator."""
    return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()


class PrefixDigest:
    """`fingerprint` of a prefix that only grows, without hashing again what was hashed.

    Holds the blake2b state after the first `length` tokens of a sequence whose first
    `length` tokens never change afterwards (a session's committed prefix): the digest of a
    longer prefix then costs the new tokens only — the same bytes as `fingerprint`, since
    blake2b over a+b is blake2b over a, then b. At a 32k-token context a whole-prefix digest
    costs ~2 ms of CPU, and every round needs four (coordinator: draft and target; each
    worker its own check)."""

    def __init__(self):
        self.length = 0
        self._state = hashlib.blake2b(digest_size=16)

    def copy(self) -> PrefixDigest:
        twin = PrefixDigest()
        twin.length, twin._state = self.length, self._state.copy()
        return twin

    def advance(self, tokens: Sequence[int], length: int) -> None:
        """Hash tokens[self.length:length] in: tokens must begin with the hashed prefix."""
        if length > self.length:
            self._state.update(array("I", tokens[self.length : length]).tobytes())
            self.length = length

    def of(self, tokens: Sequence[int], stable: int | None = None) -> bytes:
        """fingerprint(tokens), where tokens[:stable] (default: all) begin with the hashed
        prefix and never change: they are hashed in for good, the rest only for this digest.
        A prefix stable only below what is hashed cannot be trusted to match it: hashed whole."""
        stable = len(tokens) if stable is None else stable
        if stable < self.length:
            return fingerprint(tokens)
        self.advance(tokens, stable)
        if stable == len(tokens):
            return self._state.digest()
        state = self._state.copy()
        state.update(array("I", tokens[stable:]).tobytes())
        return state.digest()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

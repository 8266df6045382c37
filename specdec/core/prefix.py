"""Committed-prefix identity: the fingerprint every worker and the coordinator agree on."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def fingerprint(tokens: Sequence[int]) -> bytes:
    """16-byte digest of a token prefix; identical on every worker and the coordinator."""
    return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

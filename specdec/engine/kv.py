"""Per-session KV state: committed history, computed-KV length, sync and crop.

A worker keeps, per session, the token history it believes (`tokens`) and the KV of its
first `kv_len` tokens in growable per-layer buffers. Committed length and computed-KV
length are tracked separately (docs/architecture.md, "KV rollback"): a recovered/bonus
token is part of the history before its KV exists — it is computed when the token is fed in
the next round. A rejection is undone by cropping: nothing is copied, the length just moves
back (as gpt-fast indexes by position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core.prefix import PrefixDigest, common_prefix_len


class KVSession:
    """The history and KV cache one worker holds for one session."""

    def __init__(self, session_id: str, epoch: int = 0):
        self.session_id = session_id
        self.epoch = epoch
        self.tokens: list[int] = []  # history the worker holds (committed, then kept candidates)
        self.digest = PrefixDigest()  # of the last base proven (tokens[:digest.length])
        self.kv_len = 0  # tokens[:kv_len] have KV computed
        self.keys: list[torch.Tensor] = []  # per layer [heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.writes = 0  # bumped whenever KV is written (a batch's copy of it is then stale)
        self._nbytes = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the KV buffers (their capacity, not just kv_len)."""
        return self._nbytes

    def sync(self, history: Sequence[int], same: int = 0) -> int:
        """Adopt `history` as the session's tokens, keeping KV of the common prefix only.
        `same`: history's first `same` tokens are known to be the session's (not compared).

        Returns the new kv_len. Rejected candidates and anything the caller does not confirm
        are dropped here (invariant 3: no computation on a wrong history).
        """
        keep = same + common_prefix_len(self.tokens[same:], history[same:])
        self.tokens = list(history)
        # the last history token is always fed again: its logits predict the next position
        self.kv_len = max(0, min(self.kv_len, keep, len(history) - 1))
        return self.kv_len

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` tokens (history and KV)."""
        del self.tokens[length:]
        self.kv_len = min(self.kv_len, length)
        if length < self.digest.length:  # the proven prefix is gone with it
            self.digest = PrefixDigest()

    def pending(self) -> list[int]:
        """History tokens whose KV is not computed yet (fed at the next forward)."""
        return self.tokens[self.kv_len :]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the computed KV of one layer: [heads, kv_len, head_dim] each."""
        return self.keys[layer][:, : self.kv_len], self.values[layer][:, : self.kv_len]

    def reserve(self, length: int, like: list[torch.Tensor] | None = None) -> None:
        """Make room for KV up to `length` tokens (buffers grow by doubling); a session with
        no buffers yet takes the per-layer shape, dtype and device of `like`."""
        if length > self.capacity:
            self._grow(max(length, 2 * self.capacity, 64), self.keys or like or [])

    def append_kv(self, new_keys: list[torch.Tensor], new_values: list[torch.Tensor]) -> None:
        """Append KV [heads, n, head_dim] per layer after kv_len (buffers grow by doubling)."""
        n = new_keys[0].shape[1]
        need = self.kv_len + n
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity, 64), new_keys)
        for layer, (k, v) in enumerate(zip(new_keys, new_values)):
            self.keys[layer][:, self.kv_len : need] = k
            self.values[layer][:, self.kv_len : need] = v
        self.kv_len = need
        self.writes += 1

    def _grow(self, capacity: int, like: list[torch.Tensor]) -> None:
        grown_k, grown_v = [], []
        for layer, sample in enumerate(like):
            heads, _, dim = sample.shape
            k = torch.empty(heads, capacity, dim, dtype=sample.dtype, device=sample.device)
            v = torch.empty_like(k)
            if self.keys:
                k[:, : self.kv_len] = self.keys[layer][:, : self.kv_len]
                v[:, : self.kv_len] = self.values[layer][:, : self.kv_len]
            grown_k.append(k)
            grown_v.append(v)
        self.keys, self.values = grown_k, grown_v
        self._nbytes = sum(t.numel() * t.element_size() for t in self.keys + self.values)

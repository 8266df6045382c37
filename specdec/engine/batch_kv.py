"""A batch's KV cache across forward passes: preallocated buffers the model writes into.

`BufferLayer` lets a Hugging Face model append its new K/V in place after a given length (no
concatenation, no copy of the prefix). `BatchKV` keeps a whole batch's KV in such buffers
between passes, so a batch of the same sessions, round after round, copies nothing: a crop
(a rejection undone) only forgets columns. See `specdec.engine` for how rollback works.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from specdec.engine.kv import KVSession


class BufferLayer(DynamicLayer):
    """A cache layer over preallocated K/V buffers [B, heads, capacity, dim]: the model's new
    K/V are written in place after `length` (no concatenation, no copy of the prefix)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.key_buffer, self.value_buffer, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


BATCH_KV_HEADROOM = 128  # columns a batch's KV buffers get beyond what the first pass needs


class BatchKV:
    """A batch's KV in [B, heads, capacity, dim] buffers per layer, kept across forward passes.

    Row i holds session i's KV at the columns `cols[i]` (its positions, in order). A crop
    only forgets columns, which become holes that the attention mask hides, and every pass
    writes its new tokens at the same columns [width, width + max_new) of every row, with the
    true positions in position_ids. So when the same sessions come back (every round under
    steady load) nothing is copied; a row is valid only while its session saw no other KV
    write (`KVSession.writes`), and a full buffer is rebuilt compactly.
    """

    def __init__(self, sessions: list[KVSession], keys, values, cols: list[list[int]], width):
        self.sessions = list(sessions)
        self.keys, self.values = keys, values
        self.cols = cols
        self.width = width
        self.writes = [s.writes for s in sessions]
        self.capacity = keys[0].shape[2]

    @classmethod
    def build(cls, sessions: list[KVSession], max_cached: int, extra: int) -> BatchKV:
        """A fresh copy, each row's KV left-padded to end at column max_cached."""
        reference = next(s for s in sessions if s.kv_len > 0)
        keys, values = [], []
        for layer in range(len(reference.keys)):
            heads, _, dim = reference.keys[layer].shape
            like = reference.keys[layer]
            shape = (len(sessions), heads, max_cached + extra, dim)
            k = torch.zeros(shape, dtype=like.dtype, device=like.device)
            v = torch.zeros_like(k)
            for i, session in enumerate(sessions):
                if session.kv_len:
                    sk, sv = session.kv(layer)
                    k[i, :, max_cached - session.kv_len : max_cached] = sk
                    v[i, :, max_cached - session.kv_len : max_cached] = sv
            keys.append(k)
            values.append(v)
        cols = [list(range(max_cached - s.kv_len, max_cached)) for s in sessions]
        return cls(sessions, keys, values, cols, max_cached)

    def reusable(self, sessions: list[KVSession], max_new: int) -> bool:
        """Whether these sessions are this batch's, unchanged but for crops, with room left;
        if so, forget the cropped columns."""
        if len(sessions) != len(self.sessions) or self.width + max_new > self.capacity:
            return False
        for i, session in enumerate(sessions):
            if (
                session is not self.sessions[i]
                or session.writes != self.writes[i]
                or session.kv_len > len(self.cols[i])
            ):
                return False
        for i, session in enumerate(sessions):
            del self.cols[i][session.kv_len :]
        return True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def cache(self) -> Cache:
        return Cache(layers=[BufferLayer(k, v, self.width) for k, v in zip(self.keys, self.values)])

    def mask(self, lengths: list[int], max_new: int) -> torch.Tensor:
        """Attention mask [B, width + max_new]: each row's KV columns and its new tokens."""
        mask = torch.zeros(len(self.sessions), self.width + max_new, dtype=torch.long)
        for i, cols in enumerate(self.cols):
            if cols:
                mask[i, torch.tensor(cols)] = 1
            mask[i, self.width : self.width + lengths[i]] = 1
        return mask

    def advance(self, lengths: list[int], max_new: int) -> None:
        """After a pass: the new tokens' columns join their rows."""
        for i, session in enumerate(self.sessions):
            self.cols[i].extend(range(self.width, self.width + lengths[i]))
            self.writes[i] = session.writes
        self.width += max_new

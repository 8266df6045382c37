"""Model runtime: load a Hugging Face causal LM from a local directory and run batched
forward passes over sessions with different cached lengths.

Any `AutoModelForCausalLM` whose attention uses the standard cache (Llama, Qwen2, GPT-2, …)
works. A batch of sessions is run as ONE forward: each session's cached KV is left-padded to
the longest cache, its new tokens right-padded to the longest input, padding masked out, and
positions given per session; afterwards each session's new KV is appended to its own buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from specdec.kv import KVSession

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass(frozen=True)
class RuntimeSettings:
    model_dir: str
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | float16 | bfloat16
    threads: int = 1


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: CUDA was requested but is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def vocab_fingerprint(tokenizer) -> str:
    """Hash of the token→id map and special tokens; equal tokenizers give equal hashes."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def load_tokenizer(model_dir: str):
    if not os.path.isdir(model_dir):
        raise ValueError(f"model: {model_dir!r} is not a directory")
    return AutoTokenizer.from_pretrained(model_dir)


class ModelRuntime:
    """A loaded causal LM plus its tokenizer, ready for batched cached forward passes."""

    def __init__(self, settings: RuntimeSettings):
        if not os.path.isdir(settings.model_dir):
            raise ValueError(f"model: {settings.model_dir!r} is not a directory")
        torch.set_num_threads(max(1, settings.threads))
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.tokenizer = load_tokenizer(settings.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=self.dtype)
        self.model.to(self.device).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(
            getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
        )
        self.model_name = os.path.basename(os.path.normpath(settings.model_dir))
        self.vocab_fingerprint = vocab_fingerprint(self.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = [] if eos is None else [int(eos)]
        self._last_batch: BatchKV | None = None  # model thread only

    def kv_bytes_per_token(self, session: KVSession) -> int:
        return session.nbytes // max(1, session.capacity)

    @torch.inference_mode()
    def forward(self, sessions: list[KVSession], inputs: list[list[int]]) -> list[torch.Tensor]:
        """Feed `inputs[i]` after session i's computed KV; returns logits [n_i, vocab] each.

        Each input continues at the session's kv_len: a prefix of session.pending() (a prefill
        chunk), or all of it followed by extra (candidate) tokens that join the history.
        """
        for session, tokens in zip(sessions, inputs):
            if not tokens:
                raise ValueError("forward: every session needs at least one input token")
            if session.kv_len + len(tokens) > self.max_context:
                raise ValueError(
                    f"context of session {session.session_id} would exceed {self.max_context} tokens"
                )
        batch = len(sessions)
        cached = [s.kv_len for s in sessions]
        lengths = [len(t) for t in inputs]
        max_cached, max_new = max(cached), max(lengths)
        input_ids = torch.zeros(batch, max_new, dtype=torch.long)
        positions = torch.zeros(batch, max_new, dtype=torch.long)
        for i, tokens in enumerate(inputs):
            input_ids[i, : lengths[i]] = torch.tensor(tokens)
            positions[i] = cached[i] + torch.arange(max_new)
        in_place = batch == 1 and cached[0] > 0  # a lone session: its own buffers are the cache
        reused, attention = None, None
        if in_place:
            sessions[0].reserve(cached[0] + max_new)
            cache = self._session_cache(sessions[0])
        elif max_cached > 0:
            reused = self._batch_kv(sessions, max_cached, max_new)
            cache, attention = reused.cache(), reused.mask(lengths, max_new)
        else:  # nothing cached yet: right-padded inputs only
            cache = DynamicCache(config=self.model.config)
            attention = (torch.arange(max_new)[None] < torch.tensor(lengths)[:, None]).long()
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=None if attention is None else attention.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()  # [B, max_new, vocab]
        results = []
        for i, session in enumerate(sessions):
            start = session.kv_len
            if in_place:
                session.kv_len += lengths[i]
                session.writes += 1
            else:
                start_col = reused.width if reused is not None else 0
                new = slice(start_col, start_col + lengths[i])
                session.append_kv(
                    [layer.keys[i, :, new] for layer in cache.layers],
                    [layer.values[i, :, new] for layer in cache.layers],
                )
            session.tokens[start : start + lengths[i]] = inputs[i]
            results.append(logits[i, : lengths[i]].cpu())
        if reused is not None:
            reused.advance(lengths, max_new)
        return results

    def _session_cache(self, session: KVSession) -> Cache:
        """The session's own buffers as the cache of a batch of one."""
        return Cache(
            layers=[
                BufferLayer(k[None], v[None], session.kv_len)
                for k, v in zip(session.keys, session.values)
            ]
        )

    def _batch_kv(self, sessions: list[KVSession], max_cached: int, max_new: int) -> BatchKV:
        """The batch's KV as [B, heads, capacity, dim] buffers per layer: the previous batch's
        buffers when the same sessions come back unchanged but for crops (the common case
        under steady load: nothing is copied), else a fresh left-padded copy."""
        previous = self._last_batch
        if previous is not None and previous.reusable(sessions, max_new):
            return previous
        self._last_batch = None  # free the old copy before making a new one
        self._last_batch = BatchKV.build(sessions, max_cached, max_new + BATCH_KV_HEADROOM)
        return self._last_batch

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
        attention = torch.zeros(batch, max_cached + max_new, dtype=torch.long)
        positions = torch.zeros(batch, max_new, dtype=torch.long)
        for i, tokens in enumerate(inputs):
            input_ids[i, : lengths[i]] = torch.tensor(tokens)
            attention[i, max_cached - cached[i] : max_cached + lengths[i]] = 1
            positions[i] = cached[i] + torch.arange(max_new)
        in_place = batch == 1 and cached[0] > 0  # a lone session: its own buffers are the cache
        if in_place:
            sessions[0].reserve(cached[0] + max_new)
            cache = self._session_cache(sessions[0])
        else:
            cache = self._padded_cache(sessions, max_cached, max_new)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=None if in_place else attention.to(self.device),
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
            else:
                new = slice(max_cached, max_cached + lengths[i])
                session.append_kv(
                    [layer.keys[i, :, new] for layer in cache.layers],
                    [layer.values[i, :, new] for layer in cache.layers],
                )
            session.tokens[start : start + lengths[i]] = inputs[i]
            results.append(logits[i, : lengths[i]].cpu())
        return results

    def _session_cache(self, session: KVSession) -> Cache:
        """The session's own buffers as the cache of a batch of one."""
        return Cache(
            layers=[
                BufferLayer(k[None], v[None], session.kv_len)
                for k, v in zip(session.keys, session.values)
            ]
        )

    def _padded_cache(self, sessions: list[KVSession], max_cached: int, max_new: int) -> Cache:
        """Buffers [B, heads, max_cached + max_new, dim] per layer, cached KV left-padded."""
        if max_cached == 0:
            return DynamicCache(config=self.model.config)
        reference = next(s for s in sessions if s.kv_len > 0)
        layers = []
        for layer in range(len(reference.keys)):
            heads, _, dim = reference.keys[layer].shape
            template = reference.keys[layer]
            keys = torch.zeros(
                len(sessions),
                heads,
                max_cached + max_new,
                dim,
                dtype=template.dtype,
                device=template.device,
            )
            values = torch.zeros_like(keys)
            for i, session in enumerate(sessions):
                if session.kv_len:
                    k, v = session.kv(layer)
                    keys[i, :, max_cached - session.kv_len : max_cached] = k
                    values[i, :, max_cached - session.kv_len : max_cached] = v
            layers.append(BufferLayer(keys, values, max_cached))
        return Cache(layers=layers)

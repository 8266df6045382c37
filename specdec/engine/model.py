"""Model runtime: load a Hugging Face causal LM from a local directory and run batched
forward passes over sessions with different cached lengths.

Any `AutoModelForCausalLM` whose attention uses the standard cache (Llama, Qwen2, GPT-2, …)
works. A directory may add `head.safetensors` (`token_ids`, int64 [N]): the LM head then covers
only those tokens (an FR-Spec draft: the 49k–256k-row head is most of a small draft's cost),
`forward` returns logits over them in that order, and `head_ids` maps a column to its token
id. Only a draft may have one: verification needs the target's full distribution.

A batch of sessions is run as ONE forward: new tokens right-padded to the longest input,
positions given per session. Its attention, on a CPU, reads each session's own KV buffers
(`session_attention`: nothing copied, nothing padded); for a model that does not qualify, or
with `batch_attention="padded"`, each session's cached KV is left-padded into a batch copy
(`batch_kv.BatchKV`, reused while the same sessions come back) and its new KV appended to its
own buffers afterwards.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache

from specdec.engine import lean_forward, session_attention
from specdec.engine.batch_kv import BATCH_KV_HEADROOM, BatchKV, BufferLayer
from specdec.engine.kernels import LINEAR_LABELS, kernel_of, pack_linears
from specdec.engine.kv import KVSession
from specdec.text.tokenizer import eos_token_ids, load_tokenizer, vocab_fingerprint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RuntimeSettings:
    model_dir: str
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | float16 | bfloat16
    threads: int = 1
    linear_kernel: str = "auto"  # auto | compiled | packed | default (specdec.engine.kernels)
    batch_attention: str = "auto"  # auto | sessions | padded (specdec.engine.session_attention)
    attention_kernel: str = "auto"  # auto | compiled | torch (specdec.engine.attention_kernel)
    model_forward: str = "auto"  # auto | lean | hf (specdec.engine.lean_forward)


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
        self.eos_token_ids = list(eos_token_ids(self.tokenizer))
        self.head_ids = _restrict_head(self.model, settings.model_dir, self.vocab_size)
        self.packed_linears = pack_linears(self.model, settings.linear_kernel)
        log.info(
            "model %s on %s: %s",
            self.model_name,
            self.device,
            f"{self.packed_linears} linear layers on {LINEAR_LABELS[kernel_of(self.model)]}"
            if self.packed_linears
            else LINEAR_LABELS["default"],
        )
        self._last_batch: BatchKV | None = None  # model thread only
        # per layer an empty [kv_heads, 0, head_dim] KV tensor (shape, dtype and device of a
        # session's buffers) when attention reads the sessions' own buffers; None: padded
        self._kv_like: list[torch.Tensor] | None = None
        self._attention_kernel = None  # the compiled kernel's module, when it attends
        self._lean: lean_forward.LeanForward | None = None  # the model's layers called directly
        session_attention.install(self, settings.batch_attention, settings.attention_kernel)
        lean_forward.install(self, settings.model_forward)
        log.info(
            "model %s: batched attention %s%s",
            self.model_name,
            (
                "over each session's own KV"
                + (", short blocks by the compiled kernel" if self._attention_kernel else "")
            )
            if self.session_attention
            else "over a padded batch copy",
            ""
            if self._lean is None
            else f"; the lean forward ({self._lean.fused} linear calls a pass fused away)",
        )

    @property
    def session_attention(self) -> bool:
        """Whether a batch's attention reads each session's own KV (no batch copy)."""
        return self._kv_like is not None

    @property
    def batch_kv_bytes(self) -> int:
        """Bytes of the batch KV buffers kept across passes (a copy of sessions' KV)."""
        return self._last_batch.nbytes if self._last_batch is not None else 0

    @torch.inference_mode()
    def forward(
        self, sessions: list[KVSession], inputs: list[list[int]], keep: int | None = None
    ) -> list[torch.Tensor] | torch.Tensor:
        """Feed `inputs[i]` after session i's computed KV.

        Each input continues at the session's kv_len: a prefix of session.pending() (a prefill
        chunk), or all of it followed by extra (candidate) tokens that join the history.
        Returns logits [n_i, head] of every input position per session (head = vocab unless
        the model has a restricted head, see `head_ids`); with `keep`, one
        tensor [B, keep, head] of each session's last `keep` positions (a verify needs γ+1,
        a draft step 1), and the LM head runs only for those: at a 50k–250k vocabulary the
        head over a long pending prefix would cost more than the rest of the pass. Logits
        stay on the model's device, float32.
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
        max_new = max(lengths)
        # built on Python lists, one tensor each (a draft step is one token a session: a few
        # small torch ops per session would cost more than the lists)
        input_ids = torch.tensor(
            [[*tokens, *[0] * (max_new - len(tokens))] for tokens in inputs], dtype=torch.long
        )
        positions = torch.tensor([range(c, c + max_new) for c in cached], dtype=torch.long)
        kept = _kept_positions(lengths, max_new, keep)
        reused: BatchKV | None = None
        if self._kv_like is not None:  # attention writes and reads each session's own buffers
            for session, n in zip(sessions, lengths):
                session.reserve(session.kv_len + n, self._kv_like)
            rows = session_attention.SessionRows(sessions, lengths, self._attention_kernel)
            state, written = {"use_cache": False, "specdec_rows": rows}, True
        else:
            state, reused, written = self._padded_state(sessions, cached, lengths)
        input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        kept = kept.to(self.device) if isinstance(kept, torch.Tensor) else kept
        if self._lean is not None and "specdec_rows" in state:
            logits = self._lean(input_ids, positions, kept, state["specdec_rows"])
        else:
            logits = self.model(
                input_ids=input_ids, position_ids=positions, logits_to_keep=kept, **state
            ).logits
        logits = logits.float()  # [B, max_new or keep, vocab]
        cache = state.get("past_key_values")
        start_col = reused.width if reused is not None else 0
        for i, session in enumerate(sessions):
            start = session.kv_len
            if written:
                session.kv_len += lengths[i]
                session.writes += 1
            else:  # the batch pass wrote a cache of its own: copy the new columns out
                new = slice(start_col, start_col + lengths[i])
                session.append_kv(
                    [layer.keys[i, :, new] for layer in cache.layers],
                    [layer.values[i, :, new] for layer in cache.layers],
                )
            session.tokens[start : start + lengths[i]] = inputs[i]
        if reused is not None:
            reused.advance(lengths, max_new)
        if keep is None:
            return [logits[i, : lengths[i]] for i in range(batch)]
        return logits

    def _padded_state(
        self, sessions: list[KVSession], cached: list[int], lengths: list[int]
    ) -> tuple[dict, BatchKV | None, bool]:
        """The model's cache arguments without per-session attention, the batch copy used and
        whether the pass writes the sessions' own buffers: a lone session's buffers are its
        cache (written in place), else a padded batch copy of the cached KV (reused when the
        same sessions come back) with its mask, or right-padded inputs alone."""
        max_cached, max_new = max(cached), max(lengths)
        if len(sessions) == 1 and cached[0] > 0:
            sessions[0].reserve(cached[0] + max_new)
            return (
                {"past_key_values": self._session_cache(sessions[0]), "use_cache": True},
                None,
                True,
            )
        if max_cached > 0:
            reused = self._batch_kv(sessions, max_cached, max_new)
            cache, attention = reused.cache(), reused.mask(lengths, max_new)
        else:  # nothing cached yet
            reused, cache = None, DynamicCache(config=self.model.config)
            attention = (torch.arange(max_new)[None] < torch.tensor(lengths)[:, None]).long()
        mask = attention.to(self.device)
        return {"past_key_values": cache, "use_cache": True, "attention_mask": mask}, reused, False

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


HEAD_FILE = "head.safetensors"


def head_token_ids(model_dir: str, vocab_size: int) -> torch.Tensor | None:
    """The checked token ids of a directory's `head.safetensors`, or None without one."""
    path = os.path.join(model_dir, HEAD_FILE)
    if not os.path.exists(path):
        return None
    ids = load_file(path).get("token_ids")
    if ids is None or ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"model: {HEAD_FILE} needs a non-empty 1-D tensor 'token_ids'")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError(f"model: {HEAD_FILE} token_ids must be distinct ids below {vocab_size}")
    return ids


def _restrict_head(model, model_dir: str, vocab_size: int) -> torch.Tensor | None:
    """Replace the LM head by its rows for the tokens of `head.safetensors`, if present;
    returns those token ids (on the model's device), or None for a full head."""
    ids = head_token_ids(model_dir, vocab_size)
    if ids is None:
        return None
    full = model.get_output_embeddings()
    head = torch.nn.Linear(full.in_features, ids.numel(), bias=False)
    head = head.to(device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(full.weight[ids.to(full.weight.device)])
    model.set_output_embeddings(head)
    return ids.to(full.weight.device)


def _kept_positions(lengths: list[int], max_new: int, keep: int | None) -> int | torch.Tensor:
    """`logits_to_keep` for right-padded inputs: 0 = every position; else each session's last
    `keep` input positions, as [B, keep] (a plain count when every input is the longest)."""
    if keep is None:
        return 0
    if all(n == max_new for n in lengths) and keep <= max_new:
        return keep
    return torch.tensor([[max(0, n - keep + j) for j in range(keep)] for n in lengths])

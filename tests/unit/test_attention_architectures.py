"""Attention over each session's own KV on the architectures users bring: tiny random Qwen2,
Qwen3, Mistral and Gemma qualify and batch exactly like a fresh forward; Mistral with a
sliding window, Gemma 2 (soft-capping, sliding windows) and Gemma 3 (layer types) keep the
padded batch, and batch exactly too."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tokenizer, fresh_logits, save_architecture

from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime, RuntimeSettings

ATOL = 1e-4
# name: (config class, extra config, whether attention over the sessions' own KV applies)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", {}, True),
    "qwen3": ("Qwen3Config", {"head_dim": 16}, True),
    "mistral": ("MistralConfig", {"sliding_window": None}, True),
    "gemma": ("GemmaConfig", {"head_dim": 16}, True),
    "mistral-window": ("MistralConfig", {"sliding_window": 64}, False),
    "gemma2": ("Gemma2Config", {"head_dim": 16}, False),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16}, False),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_batched_forward_equals_a_fresh_forward(name, tokenizer, tmp_path):
    config_class, extra, qualifies = ARCHITECTURES[name]
    save_architecture(config_class, extra, tokenizer, str(tmp_path))
    runtime = ModelRuntime(RuntimeSettings(str(tmp_path), device="cpu", threads=1))
    assert runtime.session_attention is qualifies

    gen = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    sessions = []
    for i, n in enumerate((40, 7, 19)):
        session = KVSession(str(i))
        session.sync(draw(n))
        sessions.append(session)
    runtime.forward(sessions, [s.pending() for s in sessions])  # one ragged prefill
    blocks = [draw(n) for n in (3, 5, 1)]
    histories = [list(s.tokens) for s in sessions]
    out = runtime.forward(sessions, blocks)
    for logits, history, block in zip(out, histories, blocks):
        fresh = fresh_logits(runtime, history + block)
        assert torch.allclose(logits, fresh[-len(block) :], atol=ATOL), name

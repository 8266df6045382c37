"""The committed demo pair loads through the standard HF code and the tokenizer round-trips
held-out code exactly."""

from __future__ import annotations

import os
import sysconfig

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "models")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(MODELS, "target"))


def test_models_load_and_share_the_vocabulary(tokenizer):
    target = AutoModelForCausalLM.from_pretrained(os.path.join(MODELS, "target"))
    draft = AutoModelForCausalLM.from_pretrained(os.path.join(MODELS, "draft"))
    assert target.config.vocab_size == draft.config.vocab_size >= len(tokenizer)
    assert target.config.model_type == "llama"
    assert sum(p.numel() for p in draft.parameters()) * 4 < sum(
        p.numel() for p in target.parameters()
    )
    draft_tokenizer = AutoTokenizer.from_pretrained(os.path.join(MODELS, "draft"))
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_tokenizer_round_trips_held_out_code(tokenizer):
    with open(os.path.join(MODELS, "heldout_files.txt"), encoding="utf-8") as f:
        files = [line.strip() for line in f if line.strip()]
    assert files
    stdlib = sysconfig.get_paths()["stdlib"]
    checked = 0
    for rel in files[:10]:
        path = os.path.join(stdlib, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()[:20_000]
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, rel
        assert len(ids) < len(text)  # it compresses: a real BPE, not bytes
        checked += 1
    assert checked >= 3

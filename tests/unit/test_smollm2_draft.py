"""The committed draft for SmolLM2 loads through plain Hugging Face code, shares SmolLM2's
vocabulary exactly, and its restricted head names distinct in-vocabulary tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdec.text.tokenizer import load_tokenizer, vocab_fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRAFT = os.path.join(ROOT, "models", "smollm2-draft")


@pytest.mark.slow
def test_the_draft_loads_and_shares_smollm2s_vocabulary(smollm2_dir):
    draft = AutoModelForCausalLM.from_pretrained(DRAFT)
    target_config = AutoModelForCausalLM.from_pretrained(smollm2_dir).config
    assert draft.config.vocab_size == target_config.vocab_size == 49152
    assert vocab_fingerprint(load_tokenizer(DRAFT)) == vocab_fingerprint(
        load_tokenizer(smollm2_dir)
    )
    assert load_tokenizer(DRAFT).chat_template == load_tokenizer(smollm2_dir).chat_template
    ids = load_file(os.path.join(DRAFT, "head.safetensors"))["token_ids"]
    assert ids.dtype == torch.int64 and ids.unique().numel() == ids.numel() == 16384
    assert int(ids.min()) >= 0 and int(ids.max()) < 49152
    params = sum(p.numel() for p in draft.parameters())
    assert params * 5 < sum(
        p.numel() for p in AutoModelForCausalLM.from_config(target_config).parameters()
    )
    training = json.loads(Path(DRAFT, "training.json").read_text())
    assert training["head_tokens"] == 16384 and training["parameters"] == params
    heldout = json.loads(Path(DRAFT, "heldout_prompts.json").read_text())
    assert len(heldout) >= 16 and all(isinstance(q, str) and q for q in heldout)

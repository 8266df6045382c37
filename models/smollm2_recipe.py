"""The SmolLM2 draft's recipe: every fixed number of models/smollm2_draft.py's stages, and the
file writes that let each stage resume (a shard is written whole or not at all)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

SEED = 1234
SEQ = 256
TOPK = 32
HEAD = 16384
GEN_BATCH = 24
GEN_NEW = 160
TRAIN_BATCH = 16
TRAIN_STEPS = 1200
LR = 2e-3
GAMMA, EVAL_NEW = 4, 96
DRAFT_CFG = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def atomic_save_json(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)

"""Train the draft for SmolLM2-135M-Instruct by distillation, reproducibly and resumably.

    python models/smollm2_draft.py --out models/smollm2-draft [--threads 2]

Stages (each resumes from what it already wrote under models/work/smollm2-draft/):
  1. data     - chat prompts (templates x topics; held-out topics kept apart), plain text
                (.md/.rst documentation installed on this machine) and code (CPython stdlib),
                split by stable hash into train / held-out
  2. generate - SmolLM2's own chat answers to the training prompts (sampled, T 0.8, top-p 0.95),
                batched, one shard per batch
  3. teacher  - SmolLM2's top-32 next-token log-probabilities at every position of every
                training window (chat answers, text, code), one shard per chunk
  4. head     - the FR-Spec head: the HEAD most frequent tokens of the training data (the
                teacher's own choices counted twice); the draft's LM head covers only those
  5. train    - a 2-layer Llama (hidden 256) whose embedding starts as the PCA projection of
                SmolLM2's embedding, LM head tied to it; soft cross-entropy against the
                teacher's top-32 (restricted to the head), fixed steps, checkpoints
  6. eval     - held-out greedy acceptance at gamma 4 (chat and text), per-token latency of
                both models, the target's probability mass outside the head -> metrics.json
  7. export   - OUT/: a Hugging Face directory (fp16 safetensors, SmolLM2's tokenizer) plus
                head.safetensors with the kept token ids and heldout_prompts.json

Every stage is a pure function of its inputs and fixed seeds; wall time is not a budget.

Modules: smollm2_recipe (the fixed numbers), smollm2_data (1), smollm2_distill (2-5),
smollm2_eval (6); export and the driver are here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.smollm2_data import stage_data  # noqa: E402
from models.smollm2_distill import (  # noqa: E402
    stage_generate,
    stage_head,
    stage_teacher,
    stage_train,
    windows,
)
from models.smollm2_eval import HeadDraft, stage_eval  # noqa: E402
from models.smollm2_recipe import (  # noqa: E402
    DRAFT_CFG,
    HEAD,
    TRAIN_BATCH,
    TRAIN_STEPS,
    atomic_save_json,
    log,
)
from specdec.catalog import SMOLLM2  # noqa: E402
from specdec.engine.convert import ensure  # noqa: E402
from specdec.engine.kernels import pack_linears  # noqa: E402

# --- 7. export ------------------------------------------------------------------------------


def write_heldout_prompts(out: Path, data: dict) -> None:
    """The held-out chat questions, for benchmarks (`specdec bench` renders them)."""
    atomic_save_json(data["chat_heldout"], out / "heldout_prompts.json")


def stage_export(out: Path, draft, head: torch.Tensor, target_dir: Path, info: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.float16).save_pretrained(out)
    draft.to(torch.float32)
    save_file({"token_ids": head.to(torch.int64).contiguous()}, str(out / "head.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(target_dir / name, out / name)
    atomic_save_json(info, out / "training.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "smollm2-draft")
    ap.add_argument("--work", type=Path, default=ROOT / "models" / "work" / "smollm2-draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chat-prompts", type=int, default=1600)
    ap.add_argument("--text-tokens", type=int, default=300_000)
    ap.add_argument("--code-tokens", type=int, default=80_000)
    ap.add_argument("--steps", type=int, default=TRAIN_STEPS)
    ap.add_argument("--stop-after", choices=["data", "generate", "teacher", "train", "eval"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    from transformers import AutoModelForCausalLM

    from specdec.text.tokenizer import load_tokenizer

    target_dir = ensure(SMOLLM2.name, progress=log)
    tokenizer = load_tokenizer(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    # the teacher runs as the target worker serves it (packed CPU kernels: generation,
    # teacher logits and the latency in the model card); make_draft reads its embedding only
    log("target:", pack_linears(target, "auto"), "linear layers on packed kernels")
    data = stage_data(args.work)
    if args.stop_after == "data":
        return 0
    generated = stage_generate(args.work, target, tokenizer, data["chat_train"], args.chat_prompts)
    if args.stop_after == "generate":
        return 0
    wins = windows(tokenizer, data, generated, args.text_tokens, args.code_tokens)
    shards = stage_teacher(args.work, target, tokenizer, wins)
    if args.stop_after == "teacher":
        return 0
    head = stage_head(args.work, shards, target.config.vocab_size)
    draft = stage_train(args.work, target, shards, head, args.steps)
    if args.stop_after == "train":
        return 0
    served = HeadDraft(draft, head)
    metrics = stage_eval(args.work, target, tokenizer, data, served, args.threads)
    info = {
        "target": SMOLLM2.requirement + " " + SMOLLM2.filename,
        "draft_config": DRAFT_CFG,
        "head_tokens": HEAD,
        "train_steps": args.steps,
        "train_batch": TRAIN_BATCH,
        "chat_answers": len(generated),
        "chat_answer_tokens": sum(len(a) for _, a in generated),
        "windows": len(wins),
        "parameters": sum(p.numel() for p in draft.parameters()),
        "metrics": metrics,
        "seconds_this_run": round(time.monotonic() - started),
    }
    stage_export(args.out, draft, head, target_dir, info)
    write_heldout_prompts(args.out, data)
    log("exported", args.out, json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

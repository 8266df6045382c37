"""Build the specdec demo model pair (target + draft) from scratch, reproducibly.

    python models/train.py --out models [--target-steps 640 --draft-steps 352 --threads 2]

Stages (each resumes from checkpoints under OUT/work/ when re-run after an interruption):
  1. corpus    - CPython stdlib .py files, split by file (stable hash) into train / held-out
  2. tokenizer - byte-level BPE, vocab 8192, special token <|endoftext|> (BOS/EOS/PAD)
  3. target    - Llama ~31M params (16 layers x 384), next-token cross-entropy on 256-token windows
  4. draft     - Llama ~1.3M params, distilled from the (fp16-exported) target's logits (KL, T=1)
  5. eval      - held-out loss, per-token latency, greedy acceptance at gamma=4 -> OUT/metrics.json

Budgets are fixed numbers of STEPS of BATCH x SEQ tokens (not wall time), and every batch is a pure
function of (step, salt), so a rerun - or a resume after an interruption - does identical work.

Modules: code_pair_corpus (1, 2 and the batches), code_pair_training (3, 4),
code_pair_eval (5); the run's recipe and the driver are here.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.code_pair_corpus import VOCAB, build_tokenizer_and_data, log  # noqa: E402
from models.code_pair_eval import N_PROMPTS, evaluate  # noqa: E402
from models.code_pair_training import (  # noqa: E402
    ce_loss,
    done,
    export,
    load,
    make_model,
    run_meta,
    train,
)

# Deep and narrow on purpose: on CPU the per-layer overhead dominates batch-1 latency, so 16 layers
# of 384 make the target >= 10x slower per token than the 1-layer draft at ~31M parameters.
TARGET_CFG = dict(
    hidden_size=384,
    num_hidden_layers=16,
    num_attention_heads=6,
    num_key_value_heads=6,
    intermediate_size=1024,
)
DRAFT_CFG = dict(
    hidden_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=384,
)
TARGET_STEPS = 640  # 1.31M tokens; ~60-75 min on 2 idle cores
DRAFT_STEPS = 352  # 0.72M tokens; ~12 min (the teacher's forward dominates)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=N_PROMPTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out, work = args.out, args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    data = build_tokenizer_and_data(out, work)

    t_steps, d_steps = args.target_steps, args.draft_steps
    target = make_model(TARGET_CFG, data["eos"])
    t_meta = run_meta(target, t_steps, 8e-4)
    if not (out / "target" / "model.safetensors").exists() or not done(work, "target", t_meta):
        log(
            f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M params, {t_steps} steps"
        )
        info = train("target", target, t_steps, 8e-4, ce_loss, data["train"], 1, work)
        export(target, out / "target", {"arch": TARGET_CFG, "train": info})
        (work / "target.done").write_text(json.dumps(t_meta, sort_keys=True) + "\n")
    del target

    draft = make_model(DRAFT_CFG, data["eos"])
    d_meta = {**run_meta(draft, d_steps, 2e-3), "teacher": t_meta}
    if not (out / "draft" / "model.safetensors").exists() or not done(work, "draft", d_meta):
        teacher = load(out / "target")  # distill from the fp16 weights actually shipped
        for p in teacher.parameters():
            p.requires_grad_(False)
        log(
            f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M params, {d_steps} steps"
        )

        def kd_loss(model, x):
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(input_ids=x[:, :-1]).logits.float(), -1).reshape(
                    -1, VOCAB
                )
            d_logp = F.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1).reshape(-1, VOCAB)
            return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")

        info = train("draft", draft, d_steps, 2e-3, kd_loss, data["train"], 2, work)
        info["objective"] = "KL(target || draft), temperature 1"
        export(draft, out / "draft", {"arch": DRAFT_CFG, "train": info})
        (work / "draft.done").write_text(json.dumps(d_meta, sort_keys=True) + "\n")
        del teacher

    m = evaluate(out, data, args.eval_prompts)
    log(
        f"done in {(time.time() - t_all) / 60:.1f} min (this invocation): alpha_hat "
        f"{m['greedy_acceptance']['alpha_hat']}, latency ratio {m['latency_ratio_target_over_draft']}"
    )


if __name__ == "__main__":
    main()

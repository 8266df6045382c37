"""Training of the code pair (models/train.py): the Llama models, the resumable AdamW loop, the
run identity that checkpoints and finished-stage markers carry, and fp16 export / load."""

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from models.code_pair_corpus import BATCH, SEED, SEQ, VOCAB, atomic_save, get_batch, log


# ----------------------------------------------------------------------------- models / training
def make_model(cfg, eos):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    conf = LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        **cfg,
    )
    return LlamaForCausalLM(conf)


def train(name, model, steps, lr, loss_fn, stream, salt, work):
    """AdamW + linear warmup + cosine decay to 10%; checkpoints every 25 steps, resumes (only
    a checkpoint of the same run: architecture, steps and learning rate)."""
    ckpt = work / f"{name}.ckpt"
    meta = run_meta(model, steps, lr)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    step, elapsed = 0, 0.0
    if ckpt.exists() and torch.load(ckpt).get("meta") != meta:
        log(f"{name}: {ckpt} is from another run; starting over")
        ckpt.unlink()
    if ckpt.exists():
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed = st["step"], st["elapsed"]
        log(f"{name}: resumed at step {step}/{steps}")
    warm = max(1, min(100, steps // 10))
    model.train()
    t0, ema = time.time() - elapsed, None
    while step < steps:
        frac = (
            step / warm
            if step < warm
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
        )
        for gr in opt.param_groups:
            gr["lr"] = lr * frac
        loss = loss_fn(model, get_batch(stream, step, salt))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == steps:
            el = time.time() - t0
            log(
                f"{name} step {step}/{steps} loss {ema:.3f} lr {lr * frac:.2e} "
                f"{step * BATCH * SEQ / el:.0f} tok/s elapsed {el / 60:.1f} min"
            )
        if step % 25 == 0 or step == steps:
            atomic_save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "meta": meta,
                    "elapsed": time.time() - t0,
                },
                ckpt,
            )
    return {
        "steps": steps,
        "tokens": steps * BATCH * SEQ,
        "seconds": round(time.time() - t0, 1),
        "batch": BATCH,
        "seq_len": SEQ,
        "peak_lr": lr,
    }


def run_meta(model, steps, lr):
    """What identifies a training run (a checkpoint or a finished model belongs to it)."""
    return {"config": model.config.to_diff_dict(), "steps": steps, "lr": lr, "seed": SEED}


def done(work, name, meta):
    """Whether `name` was finished by the same run (its marker holds the run's meta)."""
    marker = work / f"{name}.done"
    return marker.exists() and marker.read_text().strip() == json.dumps(meta, sort_keys=True)


def ce_loss(model, x):
    logits = model(input_ids=x[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))


def export(model, d, info):
    """Save in float16 safetensors next to the tokenizer; record training info."""
    model.eval().half().save_pretrained(d)  # transformers 5 always writes safetensors
    (Path(d) / "training.json").write_text(json.dumps(info, indent=1))


def load(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

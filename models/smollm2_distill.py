"""Stages 2-5 of the SmolLM2 draft: SmolLM2's own chat answers, its top-32 next-token
log-probabilities over every training window, the FR-Spec head, and the draft distilled from
them (soft cross-entropy restricted to the head, checkpointed every 100 steps)."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from models.smollm2_data import chat_ids, left_pad
from models.smollm2_recipe import (
    DRAFT_CFG,
    GEN_BATCH,
    GEN_NEW,
    HEAD,
    LR,
    SEED,
    SEQ,
    TOPK,
    atomic_save,
    log,
)

# --- 2. generate ----------------------------------------------------------------------------


@torch.inference_mode()
def stage_generate(work: Path, target, tokenizer, prompts: list[str], limit: int) -> list:
    folder = work / "generated"
    folder.mkdir(exist_ok=True)
    prompts = prompts[:limit]
    eos = tokenizer.eos_token_id
    batches = [prompts[i : i + GEN_BATCH] for i in range(0, len(prompts), GEN_BATCH)]
    for b, batch in enumerate(batches):
        shard = folder / f"{b:04d}.pt"
        if shard.exists():
            continue
        started = time.monotonic()
        rows = [chat_ids(tokenizer, p) for p in batch]
        ids, mask = left_pad(rows, eos)
        torch.manual_seed(SEED + b)
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            top_k=0,
            max_new_tokens=GEN_NEW,
            pad_token_id=eos,
        )
        seqs = []
        for i, row in enumerate(rows):
            answer = out[i, ids.shape[1] :].tolist()
            if eos in answer:
                answer = answer[: answer.index(eos) + 1]
            seqs.append((row, answer))
        atomic_save(seqs, shard)
        made = sum(len(a) for _, a in seqs)
        log(f"generate {b + 1}/{len(batches)}: {made} tokens in {time.monotonic() - started:.0f} s")
    return [s for f in sorted(folder.glob("*.pt")) for s in torch.load(f)]


# --- 3. teacher -----------------------------------------------------------------------------


def windows(tokenizer, data: dict, generated: list, text_tokens: int, code_tokens: int):
    """Training windows as (ids, loss-from) pairs: chat sequences (loss on the answer only),
    then text and code cut into SEQ-token windows, up to the given token budgets."""
    out = [(row + answer, len(row) - 1) for row, answer in generated if answer]
    rng = random.Random(SEED)
    for key, budget in (("text_train", text_tokens), ("code_train", code_tokens)):
        docs = list(data[key])
        rng.shuffle(docs)
        used = 0
        for _, body in docs:
            ids = tokenizer(body)["input_ids"]
            for start in range(0, max(1, len(ids) - 32), SEQ):
                piece = ids[start : start + SEQ]
                if len(piece) < 64:
                    continue
                out.append((piece, 0))
                used += len(piece)
            if used >= budget:
                break
    return out


@torch.inference_mode()
def stage_teacher(work: Path, target, tokenizer, wins: list) -> list[Path]:
    folder = work / "teacher"
    folder.mkdir(exist_ok=True)
    chunk = 16
    shards = []
    eos = tokenizer.eos_token_id
    for c in range(0, len(wins), chunk):
        shard = folder / f"{c // chunk:05d}.pt"
        shards.append(shard)
        if shard.exists():
            continue
        started = time.monotonic()
        part = [(ids[:SEQ], start) for ids, start in wins[c : c + chunk]]
        width = max(len(ids) for ids, _ in part)
        x = torch.full((len(part), width), eos, dtype=torch.long)
        loss_mask = torch.zeros(len(part), width, dtype=torch.bool)
        for i, (ids, start) in enumerate(part):
            x[i, : len(ids)] = torch.tensor(ids)
            loss_mask[i, start : len(ids) - 1] = True
        attention = torch.arange(width)[None] < torch.tensor([len(i) for i, _ in part])[:, None]
        logits = target(input_ids=x, attention_mask=attention.long()).logits.float()
        top = torch.log_softmax(logits, dim=-1).topk(TOPK, dim=-1)
        atomic_save(
            {
                "x": x.to(torch.int32),
                "mask": loss_mask,
                "ids": top.indices.to(torch.int32),
                "logp": top.values.to(torch.float16),
            },
            shard,
        )
        if c // chunk % 20 == 0:
            log(
                f"teacher {c // chunk + 1}/{math.ceil(len(wins) / chunk)}: "
                f"{int(attention.sum())} tokens in {time.monotonic() - started:.1f} s"
            )
    return shards


# --- 4. head --------------------------------------------------------------------------------


def stage_head(work: Path, shards: list[Path], vocab: int) -> torch.Tensor:
    path = work / "head.pt"
    if path.exists():
        return torch.load(path)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for shard in shards:
        s = torch.load(shard)
        counts += torch.bincount(s["x"][s["mask"]].long().flatten(), minlength=vocab)
        counts += 2 * torch.bincount(s["ids"][..., 0][s["mask"]].long(), minlength=vocab)
    head = counts.topk(HEAD).indices.sort().values
    atomic_save(head, path)
    return head


# --- 5. train -------------------------------------------------------------------------------


def make_draft(target):
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = target.config.to_dict()
    for key in ("architectures", "_name_or_path", "_model_name_or_path", "dtype"):
        base.pop(key, None)
    cfg = LlamaConfig(**{**base, **DRAFT_CFG, "tie_word_embeddings": True})
    torch.manual_seed(SEED)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    emb = target.get_input_embeddings().weight.detach().float()
    _, _, v = torch.linalg.svd(emb - emb.mean(0), full_matrices=False)
    projected = emb @ v[: cfg.hidden_size].T
    projected *= 0.02 / projected.std()
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(projected)
    draft.tie_weights()
    return draft


def head_logits(draft, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    hidden = draft.model(input_ids=x).last_hidden_state
    return hidden @ draft.get_input_embeddings().weight[head].T


def kd_loss(draft, shard: dict, slot: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy against the teacher's top-32 restricted to the head."""
    x, mask = shard["x"].long(), shard["mask"]
    logq = torch.log_softmax(head_logits(draft, x, shard["head"]), dim=-1)  # [B, T, H]
    ids = slot[shard["ids"].long()]  # head slot of each teacher id, -1 outside
    p = shard["logp"].float().exp() * (ids >= 0)
    picked = logq.gather(-1, ids.clamp(min=0))
    per_pos = -(p * picked).sum(-1)
    return per_pos[mask].sum() / mask.sum().clamp(min=1)


def stage_train(work: Path, target, shards: list[Path], head: torch.Tensor, steps: int):
    ckpt_path = work / "draft.ckpt"
    draft = make_draft(target)
    opt = torch.optim.AdamW(draft.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    step = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path)
        draft.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        log(f"train: resumed at step {step}")
    slot = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    slot[head] = torch.arange(len(head))
    order = list(range(len(shards)))
    started, tokens = time.monotonic(), 0
    draft.train()
    while step < steps:
        epoch, index = divmod(step, len(order))
        perm = order[:]
        random.Random(SEED + epoch).shuffle(perm)
        shard = torch.load(shards[perm[index]])
        shard["head"] = head
        lr = LR * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = kd_loss(draft, shard, slot)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(shard["mask"].sum())
        if step % 100 == 0 or step == steps:
            atomic_save(
                {"model": draft.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt_path
            )
            rate = tokens / (time.monotonic() - started)
            log(f"train step {step}/{steps} loss {loss.item():.3f} ({rate:.0f} tokens/s)")
    draft.eval()
    return draft

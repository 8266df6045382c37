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
"""

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SEED = 1234
SEQ = 256
BATCH = 8
VOCAB = 8192
EOS = "<|endoftext|>"
MAX_FILE_BYTES = 300_000  # skip a few huge generated files (e.g. pydoc_data/topics.py)
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
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
GAMMA, N_PROMPTS, PROMPT_LEN, GEN_LEN = 4, 40, 64, 128


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def atomic_save(obj, path):
    tmp = Path(str(path) + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- corpus
def corpus_files():
    """Sorted (relative path, text) of stdlib .py files, minus tests/site-packages/huge files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if SKIP_DIRS & set(rel.split("/")[:-1]) or not p.is_file():
            continue
        raw = p.read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            continue
        try:
            out.append((rel, raw.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def is_heldout(rel):
    """~5% of files, chosen by a stable hash of the relative path."""
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 20 == 0


# ----------------------------------------------------------------------------- tokenizer + data
def build_tokenizer_and_data(out, work):
    """Train the BPE on the train split, save it to OUT/{target,draft}, tokenize both splits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    data_path = work / "data.pt"
    files = corpus_files()
    train = [(r, t) for r, t in files if not is_heldout(r)]
    held = [(r, t) for r, t in files if is_heldout(r)]
    (out / "heldout_files.txt").write_text("".join(r + "\n" for r, _ in held))
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        t0 = time.time()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=[EOS],
            min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([t for _, t in train], trainer)
        tok.save(str(tok_path))
        log(f"tokenizer trained in {time.time() - t0:.0f}s on {len(train)} files")
    tok = Tokenizer.from_file(str(tok_path))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    for name in ("target", "draft"):
        hf.save_pretrained(out / name)
    if data_path.exists():
        return torch.load(data_path)
    eos = tok.token_to_id(EOS)

    def encode(docs):
        enc = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
        for (rel, text), e in zip(docs, enc):
            assert tok.decode(e.ids, skip_special_tokens=False) == text, f"round-trip failed: {rel}"
        return [torch.tensor([eos] + e.ids, dtype=torch.int16) for e in enc]

    tr, he = encode(train), encode(held)
    data = {
        "train": torch.cat(tr),
        "heldout": torch.cat(he),
        "heldout_docs": he,
        "eos": eos,
        "chars": {"train": sum(len(t) for _, t in train), "heldout": sum(len(t) for _, t in held)},
        "files": {"train": len(train), "heldout": len(held)},
    }
    atomic_save(data, data_path)
    log(
        f"data: {data['files']} files, {len(data['train'])} train / {len(data['heldout'])} held-out tokens"
    )
    return data


def get_batch(stream, step, salt):
    """Deterministic random 257-token windows: depends only on (step, salt)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + salt * 7_919 + step)
    starts = torch.randint(0, len(stream) - SEQ - 1, (BATCH,), generator=g)
    return torch.stack([stream[s : s + SEQ + 1] for s in starts.tolist()]).long()


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


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_loss(model, stream, max_chunks=96):
    """Mean next-token CE over non-overlapping 257-token windows of the held-out stream."""
    n = min(max_chunks, (len(stream) - 1) // (SEQ + 1))
    x = stream[: n * (SEQ + 1)].long().view(n, SEQ + 1)
    losses = [ce_loss(model, x[i : i + 8]).item() * len(x[i : i + 8]) for i in range(0, n, 8)]
    return sum(losses) / n, n * SEQ


@torch.no_grad()
def latency(models, ctx, steps=300):
    """Median ms per forward at batch 1 with a KV cache of len(ctx), 1 thread, models interleaved.
    Each entry of `models` is (name, model, tokens per forward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    caches = {n: m(ctx, use_cache=True).past_key_values for n, m, _ in models}
    times = {n: [] for n, _, _ in models}
    for _ in range(steps):
        for n, m, k in models:
            c = caches[n]
            c.crop(
                ctx.shape[1] - c.get_seq_length()
            )  # crop takes a negative count in transformers 5
            inp = ctx[:, -k:]
            t = time.perf_counter()
            m(inp, past_key_values=c, use_cache=True)
            times[n].append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return {n: round(statistics.median(v[20:]) * 1000, 3) for n, v in times.items()}


@torch.no_grad()
def greedy(model, ids, n):
    """Plain greedy continuation with a KV cache (the lossless reference output)."""
    out = model(ids, use_cache=True)
    toks = []
    for _ in range(n):
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt.item())
        out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return toks


@torch.no_grad()
def acceptance(target, draft, docs, n_prompts):
    """Simulate greedy speculative decoding at gamma=GAMMA. Since greedy spec decoding emits exactly
    the target's greedy output, each round the draft proposes GAMMA argmax tokens from the current
    prefix and the target 'checks' them against its own greedy continuation; a round emits
    accepted + 1 tokens (the correction, or the bonus token when all GAMMA are accepted)."""
    g = torch.Generator().manual_seed(SEED + 1)
    eligible = [d for d in docs if len(d) >= PROMPT_LEN + 64]
    accepted = rejected = 0
    lengths = []
    for _ in range(n_prompts):
        doc = eligible[torch.randint(len(eligible), (1,), generator=g).item()]
        off = torch.randint(1, len(doc) - PROMPT_LEN, (1,), generator=g).item()
        prompt = doc[off : off + PROMPT_LEN].long().tolist()
        ref = greedy(target, torch.tensor([prompt]), GEN_LEN)
        pos = 0
        while pos < GEN_LEN:
            k = min(GAMMA, GEN_LEN - pos)
            seq = prompt + ref[:pos]
            prop = []
            for _ in range(k):
                prop.append(draft(torch.tensor([seq + prop])).logits[0, -1].argmax().item())
            a = 0
            while a < k and prop[a] == ref[pos + a]:
                a += 1
            accepted += a
            rejected += a < k
            lengths.append(a + 1)
            pos += a + 1
    return {
        "alpha_hat": round(accepted / max(1, accepted + rejected), 4),
        "mean_accept_len": round(sum(lengths) / len(lengths), 4),
        "rounds": len(lengths),
        "gamma": GAMMA,
        "prompts": n_prompts,
        "prompt_len": PROMPT_LEN,
        "gen_len": GEN_LEN,
    }


def evaluate(out, data, n_prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "target")
    for doc in data["heldout_docs"][:50]:  # exact round-trip through the saved HF tokenizer
        text = tok.decode(doc[1:].long().tolist())
        assert tok(text, add_special_tokens=False)["input_ids"] == doc[1:].tolist(), (
            "tokenizer mismatch"
        )
    target, draft = load(out / "target"), load(out / "draft")
    m = {
        "data": {
            "files": data["files"],
            "chars": data["chars"],
            "tokens": {"train": len(data["train"]), "heldout": len(data["heldout"])},
        }
    }
    for name, model in (("target", target), ("draft", draft)):
        loss, ntok = heldout_loss(model, data["heldout"])
        info = json.loads((out / name / "training.json").read_text())
        size = sum(f.stat().st_size for f in (out / name).iterdir())
        m[name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "arch": info["arch"],
            "heldout_loss": round(loss, 4),
            "heldout_eval_tokens": ntok,
            "train": info["train"],
            "dir_bytes": size,
        }
        log(f"{name}: held-out loss {loss:.4f}")
    ctx = data["heldout"][:200].long().view(1, -1)
    lat = latency(
        [("target", target, 1), ("draft", draft, 1), ("target_verify5", target, GAMMA + 1)], ctx
    )
    m["latency_ms_1thread"] = lat
    m["latency_ratio_target_over_draft"] = round(lat["target"] / lat["draft"], 2)
    log(f"latency (ms, 1 thread): {lat}")
    m["greedy_acceptance"] = acceptance(target, draft, data["heldout_docs"], n_prompts)
    log(f"acceptance: {m['greedy_acceptance']}")
    m["total_model_bytes"] = m["target"]["dir_bytes"] + m["draft"]["dir_bytes"]
    m["env"] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "train_threads": torch.get_num_threads(),
    }
    (out / "metrics.json").write_text(json.dumps(m, indent=1) + "\n")
    return m


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

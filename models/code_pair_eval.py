"""Evaluation of the code pair (models/train.py): held-out loss, per-token latency at batch 1 and
greedy acceptance at gamma=GAMMA -> OUT/metrics.json."""

import json
import statistics
import sys
import time

import torch

from models.code_pair_corpus import SEED, SEQ, log
from models.code_pair_training import ce_loss, load

GAMMA, N_PROMPTS, PROMPT_LEN, GEN_LEN = 4, 40, 64, 128


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

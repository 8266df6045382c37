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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.catalog import SMOLLM2  # noqa: E402
from specdec.engine.convert import ensure  # noqa: E402
from specdec.engine.kernels import pack_linears  # noqa: E402

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
TOPICS = """photosynthesis|the water cycle|black holes|the French Revolution|machine learning|
vaccines|climate change|the stock market|volcanoes|the Roman Empire|electric cars|sleep|
the internet|coffee|honeybees|the moon landing|recycling|the human heart|democracy|
earthquakes|chess|the printing press|solar panels|the immune system|inflation|dinosaurs|
rainbows|the Great Wall of China|gravity|bread baking|meditation|the Olympic Games|
hurricanes|DNA|the Renaissance|bicycles|tea|the ocean tides|plate tectonics|jazz music|
cloud computing|the Amazon rainforest|public libraries|time zones|the periodic table|
marathon training|origami|the Silk Road|antibiotics|wind turbines|the speed of light|
penguins|credit scores|the Industrial Revolution|spreadsheets|composting|lightning|
the Eiffel Tower|video games|nuclear energy|bird migration|the Moon's phases|
a healthy breakfast|public speaking|learning a new language|saving money|job interviews|
gardening|the metric system|volunteering|writing a resume|traffic lights|
password security|email etiquette|sorting algorithms|binary search|recursion|
hash tables|linked lists|unit testing|version control with git|regular expressions|
SQL joins|REST APIs|Python decorators|list comprehensions|exceptions in Python|
reading a CSV file|prime numbers|Fibonacci numbers|matrix multiplication|
the Pythagorean theorem|probability|compound interest|the scientific method|
coral reefs|glaciers|the Sahara desert|elephants|octopuses|the Milky Way|Mars|
the Titanic|Ancient Egypt|Shakespeare|Mozart|Leonardo da Vinci|the Moon|tornadoes|
wolves|mushrooms|chocolate|pizza|the violin|football|yoga|camping|first aid|
the seasons|fractions|the alphabet|maps|telescopes|submarines|airplanes|trains|
bridges|skyscrapers|batteries|magnets|sound waves|microscopes|robots|satellites"""
TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Tell me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "Why is {t} important?",
    "Can you describe {t} to a ten-year-old?",
    "Give me a brief history of {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "How would you explain {t} to a friend?",
    "List some common misconceptions about {t}.",
    "Summarize what everyone should know about {t}.",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the words in a sentence",
    "finds the largest element of a list",
    "merges two sorted lists",
    "removes duplicates from a list",
    "computes the factorial of n",
    "checks whether a string is a palindrome",
    "converts Celsius to Fahrenheit",
    "sums the digits of an integer",
    "flattens a nested list",
    "computes the average of a list of numbers",
    "finds the common elements of two lists",
    "sorts a list of dictionaries by a key",
    "reads a text file and counts its lines",
    "capitalizes every word of a sentence",
    "returns the second largest number in a list",
]
CODE_TEMPLATES = ["Write a Python function that {t}.", "How do I write code that {t} in Python?"]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def stable_bucket(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


# --- 1. data --------------------------------------------------------------------------------


def chat_prompts() -> tuple[list[str], list[str]]:
    topics = [t.strip() for t in TOPICS.replace("\n", "").split("|") if t.strip()]
    train, heldout = [], []
    for topic in topics:
        side = heldout if stable_bucket(topic) < 12 else train
        side.extend(tpl.format(t=topic) for tpl in TEMPLATES)
    for task in CODE_TASKS:
        side = heldout if stable_bucket(task) < 15 else train
        side.extend(tpl.format(t=task) for tpl in CODE_TEMPLATES)
    random.Random(SEED).shuffle(train)
    random.Random(SEED + 1).shuffle(heldout)
    return train, heldout


def documents() -> dict[str, list[tuple[str, str]]]:
    """(name, text) of plain-text docs and of stdlib code, each split train / held-out."""
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [site, Path(sys.base_prefix) / "lib", Path("/usr/share/doc")]
    text_files = sorted(
        {p for r in roots if r.exists() for ext in ("*.md", "*.rst") for p in r.rglob(ext)}
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code_files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not {"site-packages", "test", "tests", "idle_test"} & set(p.parts)
    )
    out = {"text_train": [], "text_heldout": [], "code_train": [], "code_heldout": []}
    for kind, files in (("text", text_files), ("code", code_files)):
        seen = set()
        for path in files:
            try:
                body = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not 2_000 <= len(body) <= 200_000 or body in seen:
                continue
            seen.add(body)
            side = "heldout" if stable_bucket(path.name + str(len(body))) < 5 else "train"
            out[f"{kind}_{side}"].append((str(path), body))
    return out


def stage_data(work: Path) -> dict:
    path = work / "data.pt"
    if path.exists():
        return torch.load(path)
    train, heldout = chat_prompts()
    data = {"chat_train": train, "chat_heldout": heldout, **documents()}
    atomic_save(data, path)
    log("data:", {k: len(v) for k, v in data.items()})
    return data


# --- 2. generate ----------------------------------------------------------------------------


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


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


# --- 6. eval --------------------------------------------------------------------------------


class HeadDraft(torch.nn.Module):
    """The draft as served: its LM head restricted to the kept tokens."""

    def __init__(self, draft, head):
        super().__init__()
        self.draft, self.head = draft, head
        self.weight = draft.get_input_embeddings().weight[head].detach().clone()

    def step(self, ids, cache):
        out = self.draft.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.last_hidden_state[:, -1] @ self.weight.T, out.past_key_values


@torch.inference_mode()
def greedy_continuations(target, tokenizer, prompts: list[list[int]], n: int) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    out = []
    for i in range(0, len(prompts), 8):
        rows = prompts[i : i + 8]
        ids, mask = left_pad(rows, eos)
        gen = target.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=eos
        )
        for r in range(len(rows)):
            cont = gen[r, ids.shape[1] :].tolist()
            out.append(cont[: cont.index(eos) + 1] if eos in cont else cont)
    return out


@torch.inference_mode()
def acceptance(served: HeadDraft, prompts, continuations) -> dict:
    """Greedy speculative rounds at GAMMA over the target's own greedy continuations."""
    from transformers import DynamicCache

    accepted = rejected = rounds = 0
    for prompt, cont in zip(prompts, continuations):
        done = 0
        while done < len(cont):
            cache = DynamicCache()
            logits, cache = served.step(torch.tensor([prompt + cont[:done]]), cache)
            guess = []
            for _ in range(min(GAMMA, len(cont) - done)):
                token = int(served.head[logits.argmax(-1)])
                guess.append(token)
                logits, cache = served.step(torch.tensor([[token]]), cache)
            n = 0
            while n < len(guess) and guess[n] == cont[done + n]:
                n += 1
            accepted += n
            rejected += n < len(guess)
            rounds += 1
            done += n + 1
    return {
        "alpha_hat": accepted / max(1, accepted + rejected),
        "mean_acceptance_length": (accepted + rounds) / max(1, rounds),
        "rounds": rounds,
    }


@torch.inference_mode()
def step_latency_ms(step_fn, steps: int = 60) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


@torch.inference_mode()
def latencies(target, served: HeadDraft) -> dict:
    from transformers import DynamicCache

    torch.set_num_threads(1)
    ids = torch.randint(0, 8000, (1, 200))
    cache_t = target(input_ids=ids, use_cache=True).past_key_values
    one = torch.tensor([[42]])

    def target_step():
        target(input_ids=one, past_key_values=cache_t, use_cache=True, logits_to_keep=1)
        cache_t.crop(-1)

    cache_d = DynamicCache()
    _, cache_d = served.step(ids, cache_d)

    def draft_step():
        served.step(one, cache_d)
        cache_d.crop(-1)

    t, d = step_latency_ms(target_step), step_latency_ms(draft_step)
    return {"target_step_ms": round(t, 2), "draft_step_ms": round(d, 2), "c": round(d / t, 4)}


@torch.inference_mode()
def out_of_head_mass(target, tokenizer, prompts, continuations, head) -> float:
    """Mean target probability (T = 1) outside the head over held-out continuation positions."""
    inside = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    inside[head] = True
    masses = []
    for prompt, cont in zip(prompts, continuations):
        logits = target(input_ids=torch.tensor([prompt + cont])).logits[0, len(prompt) - 1 : -1]
        p = torch.softmax(logits.float(), dim=-1)
        masses.append(p[:, ~inside].sum(-1))
    return float(torch.cat(masses).mean())


def stage_eval(work: Path, target, tokenizer, data: dict, served: HeadDraft, threads: int) -> dict:
    path = work / "metrics.json"
    if path.exists():
        return json.loads(path.read_text())
    torch.set_num_threads(threads)
    chat = [chat_ids(tokenizer, p) for p in data["chat_heldout"][:48]]
    text = []
    for _, body in data["text_heldout"][:24] + data["code_heldout"][:12]:
        ids = tokenizer(body)["input_ids"]
        if len(ids) >= 96:
            text.append(ids[:64])
    results = {}
    for name, prompts in (("chat", chat), ("text", text)):
        started = time.monotonic()
        conts = greedy_continuations(target, tokenizer, prompts, EVAL_NEW)
        results[name] = {
            **acceptance(served, prompts, conts),
            "prompts": len(prompts),
            "generated_tokens": sum(len(c) for c in conts),
            "out_of_head_mass": out_of_head_mass(target, tokenizer, prompts, conts, served.head),
        }
        log(f"eval {name}: {results[name]} ({time.monotonic() - started:.0f} s)")
    results["latency_1_thread"] = latencies(target, served)
    atomic_save_json(results, path)
    return results


def atomic_save_json(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


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

"""Stage 6 (eval) of the SmolLM2 draft: held-out greedy acceptance at gamma 4 (chat and text),
per-token latency of both models, and the target's probability mass outside the head."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from models.smollm2_data import chat_ids, left_pad
from models.smollm2_recipe import EVAL_NEW, GAMMA, atomic_save_json, log

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

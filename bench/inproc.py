"""In-process measurements, each run in its own subprocess so its thread count is its own.

    python -m bench.inproc JOB.json RESULT.json

Jobs (JOB["job"]):
- "costs": per-token latencies at batch 1 with a KV cache, the target at `target_threads`
  intra-op threads and the draft at `draft_threads` (as the stack's workers have them; both
  default to `threads`): one target step, one draft step, and one target forward of γ+1
  tokens (verify) for γ = 1..max_gamma, each a pass of the workers' own runtime (as
  "batch_costs" at one session). Gives c = draft/target and v(γ) = verify/target.
- "batch_costs": the same per-pass costs at batch N (the concurrency of the run's rows), as
  the stack's workers run them (`ModelRuntime`: their linear kernels and batched attention,
  and the SPECDEC_DEVICE / SPECDEC_DTYPE / SPECDEC_BATCH_ATTENTION they read, their threads
  as above): one target pass of N sessions with k new tokens each (k = 1 .. γ+1) and
  one draft step of N sessions. Gives the bound at concurrency N (`bench.report`).
- "hf": the in-process peers a user would pick instead of specdec — Hugging Face `generate`
  with the target alone, and assisted generation (`assistant_model=draft`, HF's default
  assistant settings) — one request after another at batch size 1, every token timed with a
  streamer (time to first token, time per output token, rounds of assisted generation).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch


class ScatteredHead(torch.nn.Module):
    """A restricted LM head (`head.safetensors`) as Hugging Face code needs it: logits over
    the whole vocabulary, −inf outside the kept tokens. The same draft the stack serves
    (same rows, same q̃ support), at the restricted head's cost plus one fill and scatter."""

    def __init__(self, full: torch.nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.vocab = full.out_features
        self.ids = ids.to(full.weight.device)
        self.weight = torch.nn.Parameter(full.weight.detach()[ids].clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = hidden @ self.weight.T
        out = kept.new_full((*kept.shape[:-1], self.vocab), float("-inf"))
        out[..., self.ids] = kept
        return out


def placement() -> tuple[torch.device, torch.dtype]:
    """Where the peers and the per-token costs run: the device and dtype the stack's workers
    get from the same environment (SPECDEC_DEVICE, SPECDEC_DTYPE; `bench.run --device/--dtype`
    sets both), so a comparison never puts the stack and its peers on different hardware."""
    from specdec.engine.model import resolve_device, resolve_dtype

    device = resolve_device(os.environ.get("SPECDEC_DEVICE", "auto"))
    return device, resolve_dtype(os.environ.get("SPECDEC_DTYPE", "auto"), device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock time covers it (no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load(model_dir: str, linear_kernel: str = "default"):
    """A model as HF code runs it, on `placement()`; `linear_kernel` as the workers' flag
    (kernels.pack_linears, which packs only float32 on a CPU)."""
    from transformers import AutoModelForCausalLM

    from specdec.engine.kernels import pack_linears
    from specdec.engine.model import head_token_ids

    device, dtype = placement()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = head_token_ids(model_dir, int(model.config.vocab_size))
    if ids is not None:  # the same checked head the draft worker serves
        model.set_output_embeddings(ScatteredHead(model.get_output_embeddings(), ids))
    pack_linears(model, linear_kernel)
    return model


def measure_costs(job: dict) -> dict:
    """Median ms of a target step, a draft step and target verifies of γ+1 tokens at batch 1,
    each one pass of the workers' own runtime (`measure_batch_costs` at one session: their
    forward, kernels, KV bookkeeping, device and threads), so the bound built on them is what
    the workers' passes allow with nothing of serving around them. (Until 2026-12-07 these were
    HF's own forward with the workers' linear kernel, slower than the workers' lean forward:
    on SmolLM2 the stack beat that bound by up to 15 %.)"""
    one = measure_batch_costs({"linear_kernel": "default", **job, "batches": [1]})
    passes = one["batches"]["1"]["pass_ms"]
    step, draft = passes["1"], one["batches"]["1"]["draft_step_ms"]
    verify = {g: passes[str(g + 1)] for g in range(1, job["max_gamma"] + 1)}
    return {
        "threads": one["threads"],
        "context_tokens": one["context_tokens"],
        "reps": job["reps"],
        "forward": "the workers' runtime (ModelRuntime)",
        "target_step_ms": step,
        "draft_step_ms": draft,
        "verify_ms": verify,
        "c": draft / step,
        "v": {g: ms / step for g, ms in verify.items()},
    }


def model_threads(job: dict) -> tuple[int, int]:
    """Intra-op threads of the target and of the draft: the job's target_threads and
    draft_threads, as the stack's workers run them, else its `threads` for both."""
    default = int(job.get("threads", 1))
    return int(job.get("target_threads", default)), int(job.get("draft_threads", default))


def ragged_sessions(runtime, histories: list[list[int]], name: str = "s") -> list:
    """One `KVSession` per history, each prefilled alone on `runtime` (a `ModelRuntime`)."""
    from specdec.engine.kv import KVSession

    sessions = []
    for i, history in enumerate(histories):
        session = KVSession(f"{name}-{i}")
        session.sync(history)
        runtime.forward([session], [session.pending()], keep=1)
        sessions.append(session)
    return sessions


def timed_pass(runtime, sessions: list, block: list[int]) -> float:
    """Seconds of one batched forward of `block` after every session's KV (as a verify of
    len(block) positions), then each session cropped back to its length before it."""
    start = time.perf_counter()
    runtime.forward(sessions, [block] * len(sessions), keep=len(block))
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    elapsed = time.perf_counter() - start
    for session in sessions:
        session.crop(session.kv_len - len(block))
    return elapsed


@torch.inference_mode()
def measure_batch_costs(job: dict) -> dict:
    """Median ms of a target pass of N sessions with k new tokens each, k = 1..max_gamma+1, and
    of a draft step of N sessions, for each N in job["batches"]. The sessions hold ragged
    contexts around len(job["context"]) (as a batch of requests at different points does),
    and every pass is rolled back after it, so each repetition sees the same lengths."""
    from specdec.engine.model import ModelRuntime, RuntimeSettings

    def runtime(model_dir: str) -> ModelRuntime:
        # the device, dtype and attention the stack's workers get from the same environment
        # (SPECDEC_<FLAG>: bench.gpu_check puts the workers on CUDA that way)
        settings = RuntimeSettings(
            model_dir,
            device=os.environ.get("SPECDEC_DEVICE", "auto"),
            dtype=os.environ.get("SPECDEC_DTYPE", "auto"),
            threads=1,
            linear_kernel=job["linear_kernel"],
            batch_attention=os.environ.get("SPECDEC_BATCH_ATTENTION", "auto"),
            attention_kernel=os.environ.get("SPECDEC_ATTENTION_KERNEL", "auto"),
            model_forward=os.environ.get("SPECDEC_MODEL_FORWARD", "auto"),
        )
        return ModelRuntime(settings)

    target, draft = runtime(job["target_model"]), runtime(job["draft_model"])
    target_threads, draft_threads = model_threads(job)
    context, max_gamma, reps = job["context"], job["max_gamma"], job["reps"]
    out = {}
    for n in job["batches"]:
        # ragged: lengths spread ±n/2·3 around the context's
        histories = [
            (context * 2)[i : i + max(1, len(context) - 3 * (n // 2) + 3 * i)] for i in range(n)
        ]
        groups = {
            name: ragged_sessions(m, histories, name)
            for name, m in (("target", target), ("draft", draft))
        }
        cases = [(f"target_{k}", target, groups["target"], k) for k in range(1, max_gamma + 2)]
        cases.append(("draft_1", draft, groups["draft"], 1))
        times: dict[str, list[float]] = {name: [] for name, *_ in cases}
        for rep in range(reps + job["warmup"]):
            for name, model, group, k in cases:  # interleaved, so drift hits every case alike
                torch.set_num_threads(target_threads if model is target else draft_threads)
                elapsed = timed_pass(
                    model, group, [context[(rep + j) % len(context)] for j in range(k)]
                )
                if rep >= job["warmup"]:
                    times[name].append(elapsed)
        ms = {name: 1000.0 * statistics.median(t) for name, t in times.items()}
        out[str(n)] = {
            "pass_ms": {str(k): ms[f"target_{k}"] for k in range(1, max_gamma + 2)},
            "draft_step_ms": ms["draft_1"],
        }
    threads = {"target": target_threads, "draft": draft_threads}
    return {"threads": threads, "context_tokens": len(context), "batches": out}


class TokenClock:
    """A `generate` streamer that records when each batch of new tokens arrives."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, tokens in this put)

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        self.arrivals.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def generation_kwargs(mode: dict, max_new_tokens: int, pad_id: int) -> dict:
    from transformers import GenerationConfig

    sampling = mode["temperature"] > 0
    extra = {"temperature": mode["temperature"], "top_p": mode["top_p"]} if sampling else {}
    if sampling:
        extra["top_k"] = 0  # HF's default top_k=50 would change the distribution
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        eos_token_id=None,  # see no_eos(): every contender generates exactly max_new_tokens
        pad_token_id=pad_id,
        **extra,
    )
    return {"generation_config": config}


def no_eos(*models) -> None:
    """Generate past EOS, like specdec's ignore_eos, so every request yields the same count.

    `generate` fills unset fields from the model's own generation config, so EOS is cleared there.
    """
    for model in models:
        model.generation_config.eos_token_id = None


@torch.inference_mode()
def one_request(model, prompt, kwargs, assistant, seed: int) -> dict:
    torch.manual_seed(seed)
    clock = TokenClock()
    ids = torch.tensor([prompt], device=model.device)
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        streamer=clock,
        assistant_model=assistant,
        **kwargs,
    )
    synchronize(model.device)
    end = time.perf_counter()
    generated = out[0, len(prompt) :].tolist()
    first = clock.arrivals[0][0] if clock.arrivals else end
    return {
        "start": start,
        "latency_s": end - start,
        "ttft_s": first - start,
        "generated_tokens": len(generated),
        "token_ids": generated,
        "target_forwards": len(clock.arrivals),  # one streamer put per target forward
    }


def run_peers(job: dict) -> dict:
    """Every (mode, peer) warmed up, then the prompts round-robin over all of them.

    Interleaving spreads any disturbance from other processes on a shared machine evenly
    over the contenders instead of letting it land on whichever ran at the time. Each
    request also records the CPU share other processes took while it ran.
    """
    from bench.interference import CpuWatch

    kernel = job.get("linear_kernel", "default")
    target, draft = load(job["target_model"], kernel), load(job["draft_model"], kernel)
    no_eos(target, draft)
    pad_id = int(job["pad_token_id"])
    peers = (("hf_target", None), ("hf_assisted", draft))
    combos = [(mode, peer, assistant) for mode in job["modes"] for peer, assistant in peers]
    for mode, _, assistant in combos:
        warm = generation_kwargs(mode, min(16, job["max_new_tokens"]), pad_id)
        one_request(target, job["prompts"][0], warm, assistant, seed=0)
    results: dict = {mode["name"]: {} for mode in job["modes"]}
    for mode, peer, _ in combos:
        results[mode["name"]][peer] = {"requests": []}
    for i, prompt in enumerate(job["prompts"]):
        for mode, peer, assistant in combos:
            kwargs = generation_kwargs(mode, job["max_new_tokens"], pad_id)
            best = None
            for attempt in range(1 + job.get("retries", 0)):  # repeat disturbed requests
                watch = CpuWatch()
                record = one_request(target, prompt, kwargs, assistant, seed=1000 + i)
                record["other_cpu"], record["repeats"] = watch.others(), attempt
                if best is None or (record["other_cpu"] or 0.0) < (best["other_cpu"] or 0.0):
                    best = {**record, "repeats": attempt}
                if (record["other_cpu"] or 0.0) <= job.get("max_other_cpu", 1.0):
                    break
            best["repeats"] = attempt
            results[mode["name"]][peer]["requests"].append(best)
    for mode, peer, _ in combos:
        entry = results[mode["name"]][peer]
        records = entry["requests"]
        entry["wall_s"] = sum(r["latency_s"] for r in records)  # service time, back to back
        entry["repeats"] = sum(r["repeats"] for r in records)
        shares = [r["other_cpu"] for r in records if r["other_cpu"] is not None]
        entry["other_cpu"] = (
            sum(x * r["latency_s"] for x, r in zip(shares, records)) / entry["wall_s"]
            if shares
            else None
        )
        tokens = sum(r["generated_tokens"] for r in records)
        print(
            f"  {peer:<12} {mode['name']:<8} {tokens / entry['wall_s']:7.1f} tok/s "
            f"({len(records)} requests, sequential)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "threads": torch.get_num_threads(),
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "peers": results,
    }


def main(argv: list[str]) -> None:
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    threads = int(job["threads"])
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    if job["job"] == "costs":
        result = measure_costs(job)
    elif job["job"] == "batch_costs":
        result = measure_batch_costs(job)
    elif job["job"] == "hf":
        result = run_peers(job)
    else:
        raise SystemExit(f"unknown job {job['job']!r}")
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`python -m bench.gpu_check greedy`: the real stack's greedy output against Hugging Face
`generate` on the same device and dtype, with near-ties judged from a float32 forward (see
`bench/gpu_check.py`)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

from bench.gpu_env import (
    TOLERANCE,
    prompts_for,
    resolve_pair,
    result,
    stop_on_sigterm,
    torch_threads,
)


def first_difference(a: list[int], b: list[int]) -> int | None:
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    return diff


def compare(reference: list[int], got: list[int], logits_at, tol: float) -> dict:
    """One output against its reference. `logits_at(prefix)` gives the float32 logits after
    prompt + prefix (the judge of a near-tie). Verdict: identical, near-tie (the first
    difference is between two tokens within tol logits) or differs."""
    d = first_difference(reference, got)
    if d is None:
        return {"verdict": "identical", "first_difference": None}
    entry = {"first_difference": d, "reference_token": None, "got_token": None, "gap": None}
    if d >= min(len(reference), len(got)):
        return {**entry, "verdict": "differs", "why": "lengths differ"}
    logits = logits_at(reference[:d])
    ref_tok, got_tok = reference[d], got[d]
    gap = abs(float(logits[ref_tok]) - float(logits[got_tok]))
    entry.update(reference_token=ref_tok, got_token=got_tok, gap=gap)
    entry["judge_argmax"] = int(logits.argmax())
    entry["verdict"] = "near-tie" if gap <= tol else "differs"
    return entry


def describe(entry: dict) -> str:
    if entry["first_difference"] is None:
        return entry["verdict"]
    gap = "" if entry.get("gap") is None else f", logit gap {entry['gap']:.3g}"
    return f"{entry['verdict']} at token {entry['first_difference']}{gap}"


def verdict_ok(entries: list[dict]) -> bool:
    return bool(entries) and all(e["verdict"] in ("identical", "near-tie") for e in entries)


class Judge:
    """The target in float32 on the device: logits after a prompt and a prefix."""

    def __init__(self, target: str, device, model=None):
        self.target, self.device, self.model = target, device, model

    def logits(self, prompt: list[int], prefix: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.target, dtype=torch.float32)
            self.model.to(self.device).eval()
        with torch.inference_mode():
            ids = torch.tensor([prompt + prefix], device=self.device)
            return self.model(ids).logits[0, -1].float().cpu()


def hf_greedy(model, prompts, max_new_tokens: int, pad_id: int, device) -> list[list[int]]:
    import torch

    from bench.inproc import generation_kwargs, no_eos

    no_eos(model)
    kwargs = generation_kwargs({"temperature": 0.0, "top_p": 1.0}, max_new_tokens, pad_id)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def perturb(references: list[list[int]], prompts, judge: Judge) -> list[list[int]]:
    """The negative control: in each reference, the middle token becomes its least likely one."""
    perturbed = []
    for prompt, ref in zip(prompts, references):
        p = len(ref) // 2
        worst = int(judge.logits(prompt, ref[:p]).argmin())
        perturbed.append(ref[:p] + [worst] + ref[p + 1 :])
    return perturbed


def stack_greedy(address: str, prompts, gamma: int, max_new_tokens: int) -> list[list[int]]:
    """Every prompt at once through the coordinator (greedy, fixed γ, ignore_eos)."""
    import grpc

    from bench.serving import request_for
    from specdec.v1 import coordinator_pb2_grpc

    mode = {"temperature": 0.0, "top_p": 1.0}
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def one(i: int) -> list[int]:
            request = request_for(prompts[i], mode, gamma, max_new_tokens, seed=1000 + i)
            return list(stub.Generate(request, timeout=300).token_ids)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, range(len(prompts))))


def cmd_greedy(args) -> int:
    began = time.monotonic()
    stop_on_sigterm()
    from specdec.launcher.stack import Stack, StackError, StackSettings

    pair = resolve_pair(args.pair, args.target, args.draft)
    print(f"pair {pair['name']}: target {pair['target']}, draft {pair['draft']}", flush=True)
    if pair["note"]:
        print(f"  note: {pair['note']}", flush=True)
    worker = ["--device", args.device, "--dtype", args.dtype]
    stack = Stack(
        StackSettings(
            pair["target"],
            pair["draft"],
            port=0,
            log_level="warning",
            target_threads=1,
            draft_threads=1,
            target_args=worker,
            draft_args=worker,
            startup_timeout_s=args.startup_timeout_s,
        )
    )
    started: dict = {}

    def start() -> None:  # the stack starts first, while Hugging Face makes the references
        try:
            t0 = time.monotonic()
            stack.start(progress=lambda _m: None)
            started["s"] = time.monotonic() - t0
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            started["error"] = exc

    runner = threading.Thread(target=start, daemon=True)
    runner.start()
    try:
        torch_threads(1)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from specdec.engine.model import DTYPES

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print(f"gpu_check: --device {args.device} but this torch has no CUDA", flush=True)
            return 2
        device = torch.device(args.device)
        tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
        gammas = [int(g) for g in args.gammas.split(",")]
        tokenizer = AutoTokenizer.from_pretrained(pair["target"])
        prompts = prompts_for(pair, tokenizer, args.prompts)
        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=DTYPES[args.dtype])
        model.to(device).eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        references = hf_greedy(model, prompts, args.max_new_tokens, int(pad), device)
        hf_s = time.monotonic() - t0
        print(
            f"HF generate (do_sample=False) on {device} {args.dtype}: {len(prompts)} prompts x "
            f"{args.max_new_tokens} tokens in {hf_s:.1f} s",
            flush=True,
        )
        judge = Judge(pair["target"], device, model if args.dtype == "float32" else None)
        perturbed = perturb(references, prompts, judge)
        if args.perturb_reference:
            references = perturbed
            print(
                "NEGATIVE CONTROL: the middle reference token of every prompt was replaced by "
                "its least likely token; this check must FAIL",
                flush=True,
            )
        runner.join()
        if isinstance(started.get("error"), StackError):
            first = str(started["error"]).splitlines()[0]
            print(f"the stack failed to start:\n{started['error']}", flush=True)
            return result(False, f"greedy {args.device} {args.dtype}: {first}")
        if "error" in started:
            raise started["error"]
        print(
            f"stack up on --device {args.device} --dtype {args.dtype} in {started['s']:.1f} s "
            f"({time.monotonic() - began:.1f} s since this check began)",
            flush=True,
        )
        entries, controls = [], []
        for gamma in gammas:
            t0 = time.monotonic()
            outputs = stack_greedy(stack.address, prompts, gamma, args.max_new_tokens)
            wall = time.monotonic() - t0
            for i, (ref, got) in enumerate(zip(references, outputs)):
                logits_at = lambda prefix, i=i: judge.logits(prompts[i], prefix)  # noqa: E731
                entry = compare(ref, got, logits_at, tol)
                entry.update(prompt=i, gamma=gamma, reference=ref, output=got)
                entries.append(entry)
                print(f"  γ={gamma} prompt {i}: {describe(entry)}", flush=True)
                if not args.perturb_reference and entry["verdict"] == "identical":
                    controls.append(compare(perturbed[i], got, logits_at, tol))  # must differ
            print(f"  γ={gamma}: {len(prompts)} concurrent requests in {wall:.1f} s", flush=True)
    finally:
        t0 = time.monotonic()
        stack.stop()
        # a start still in progress (interrupted early) may spawn a child after that stop:
        # stop again until it has given up (it stops what it started once a child dies)
        while runner.is_alive() and time.monotonic() - t0 < 60:
            runner.join(timeout=1)
            stack.stop()
        print(f"stack stopped in {time.monotonic() - t0:.1f} s", flush=True)
    counts = {v: sum(e["verdict"] == v for e in entries) for v in ("identical", "near-tie")}
    ok = verdict_ok(entries)
    if not args.perturb_reference:
        # the built-in negative control: the same outputs against the perturbed references
        caught = sum(c["verdict"] == "differs" for c in controls)
        control_ok = bool(controls) and caught == len(controls)
        print(
            f"control: the same outputs against perturbed references: {caught}/{len(controls)} "
            f"reported as differing ({'as required' if control_ok else 'THE CHECK CANNOT FAIL'})",
            flush=True,
        )
        ok = ok and control_ok
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"greedy-{args.device.replace(':', '')}-{args.dtype}"
        name += "-perturbed" if args.perturb_reference else ""
        record = {"pair": pair, "device": args.device, "dtype": args.dtype, "tol": tol}
        record.update(gammas=gammas, prompts=prompts, entries=entries, ok=ok)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return result(
        ok,
        f"greedy {args.device} {args.dtype} ({pair['name']} pair, γ {args.gammas}): "
        f"{counts['identical']}/{len(entries)} identical to HF, {counts['near-tie']} near-tie "
        f"(tol {tol:g})" + (", negative control" if args.perturb_reference else ""),
    )

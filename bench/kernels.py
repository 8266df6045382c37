"""Per-token costs of a model pair under each CPU linear kernel (`--linear-kernel`).

    python -m bench.kernels [--pair smollm2|code|both] [--threads 1] [--out results/kernels]

For each pair and kernel (torch's own MKL `F.linear`, prepacked oneDNN, and the compiled
streamed kernel: `--linear-kernel` default, packed, compiled), in a fresh
subprocess with `--threads` torch threads: a target step, a draft step and target forwards of
γ+1 tokens at batch 1 with a KV cache (bench.inproc's "costs" job, the one the full benchmark
uses for its performance model), then c and v(γ). Also one pass of each batch size the
target worker meets under load (B sessions × γ+1 = 5 tokens). Prints a markdown table and
writes `kernels.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.contenders import PAIRS
from bench.inproc import load
from bench.measure import subprocess_job

KERNELS = ("default", "packed", "compiled")  # --linear-kernel
BATCHES = (4, 16)


@torch.inference_mode()
def batch_pass_ms(model, batch: int, reps: int = 8) -> float:
    """Median ms of one forward of `batch` sessions × 5 new tokens after a 112-token cache."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(batch)
    vocab = int(model.config.vocab_size)
    context = torch.randint(100, vocab, (batch, 112), generator=gen)
    times = []
    for _ in range(reps + 2):
        cache = DynamicCache(config=model.config)
        model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
        block = torch.randint(100, vocab, (batch, 5), generator=gen)
        start = time.perf_counter()
        model(input_ids=block, past_key_values=cache, use_cache=True, logits_to_keep=5)
        times.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=[*PAIRS, "both"], default="both")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/kernels")
    args = p.parse_args(argv)
    from specdec.engine.convert import resolve_model

    torch.set_num_threads(args.threads)
    pairs = list(PAIRS) if args.pair == "both" else [args.pair]
    rng = random.Random(0)
    context = [rng.randrange(100, 8000) for _ in range(112)]
    results = []
    for pair in pairs:
        target, draft, _ = PAIRS[pair]
        target = resolve_model(target)
        for kernel in KERNELS:
            job = {
                "job": "costs",
                "threads": args.threads,
                "target_model": target,
                "draft_model": draft,
                "context": context,
                "max_gamma": 6,
                "reps": 40,
                "warmup": 5,
                "linear_kernel": kernel,
            }
            costs = subprocess_job(job, timeout_s=900)
            model = load(target, kernel)  # once for every batch size
            costs["batch_pass_ms"] = {b: batch_pass_ms(model, b) for b in BATCHES}
            del model
            results.append({"pair": pair, "kernel": kernel, **costs})
            print(f"  {pair} {kernel}: step {costs['target_step_ms']:.1f} ms", file=sys.stderr)
    head = "| pair | kernel | target step | draft step | c | " + " | ".join(
        f"v({g})" for g in range(1, 7)
    )
    head += " | " + " | ".join(f"{b} × 5 tokens" for b in BATCHES) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        v = " | ".join(f"{r['v'][g]:.2f}" for g in r["v"])
        batches = " | ".join(f"{r['batch_pass_ms'][b]:.1f}" for b in BATCHES)
        lines.append(
            f"| {r['pair']} | {r['kernel']} | {r['target_step_ms']:.1f} | "
            f"{r['draft_step_ms']:.2f} | {r['c']:.3f} | {v} | {batches} |"
        )
    table = "\n".join(lines)
    print(f"Per-token costs (ms), {args.threads} torch thread(s), KV cache of 112 tokens:\n")
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "cpus": os.cpu_count(), "torch": torch.__version__}
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "kernels.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How the contenders are measured: `bench.inproc` jobs in a fresh interpreter (the HF peers,
the in-process costs) and every specdec contender through the whole stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from bench import metrics
from bench.contenders import LABELS, MODES, OFF_ALL_THREADS, SPECDEC
from bench.interference import CpuWatch
from bench.rows import key, make_row, progress_line
from bench.serving import BenchStack


def subprocess_job(job: dict, timeout_s: float) -> dict:
    """Run a bench.inproc job in a fresh interpreter with its own thread count — its OpenMP
    threads pinned one CPU each where the stack's target worker is (`pinned`, as
    `--cpu-bind` decides it at that many threads): same placement for every contender."""
    with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        env = job_env(job)
        subprocess.run(
            [sys.executable, "-m", "bench.inproc", job_path, result_path],
            check=True,
            timeout=timeout_s,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        with open(result_path) as f:
            return json.load(f)


def job_env(job: dict) -> dict[str, str]:
    """The environment of a job's interpreter: its thread count, and where `pinned`, libgomp
    binding its initial thread and each pool thread to a CPU of their own."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(job["threads"]),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cpus = pinned(job.get("cpu_bind", "off"), job["threads"])
    if cpus:
        env.update(OMP_PROC_BIND="true", OMP_PLACES=",".join(f"{{{c}}}" for c in cpus))
    return env


def pinned(cpu_bind: str, threads: int) -> list[int]:
    """The CPUs a worker at `threads` threads and `--cpu-bind cpu_bind` pins its model's
    threads to, on this machine and device ([]: none)."""
    import torch

    from specdec.worker.threads import allowed_cpus, bind_plan

    device = os.environ.get("SPECDEC_DEVICE", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return bind_plan(cpu_bind, threads, device, allowed_cpus())


def in_process(args, context: list[int], job: str, **extra) -> dict:
    """One `bench.inproc` job on the pair (each model at its worker's threads in the stack, the
    workers' linear kernels, γ up to 8), with the share of the CPU other processes took
    meanwhile."""
    watch = CpuWatch()
    result = subprocess_job(
        {
            "job": job,
            "threads": max(args.target_threads, args.draft_threads),
            "target_threads": args.target_threads,
            "draft_threads": args.draft_threads,
            "target_model": args.target_model,
            "draft_model": args.draft_model,
            "context": context,
            "max_gamma": 8,
            "linear_kernel": args.linear_kernel,
            "cpu_bind": args.cpu_bind,
            **extra,
        },
        timeout_s=args.timeout_s,
    )
    result["other_cpu"] = watch.others()
    return result


def run_rate(run: dict) -> float:
    """A load's aggregate tokens/s."""
    return sum(len(r["token_ids"]) for r in run["requests"]) / run["wall_s"]


def measure_run(args, bench_stack, mode, gamma, concurrency, log) -> tuple[dict, float, int]:
    """One load through `bench_stack`, repeated while other processes disturbed it: (the
    least disturbed run, other processes' CPU share meanwhile, times it was repeated)."""
    best = None
    for attempt in range(1 + args.retries):  # repeat disturbed measurements
        watch = CpuWatch()
        run = bench_stack.measure(mode, gamma, concurrency)
        share = watch.others() or 0.0
        if best is None or share < best[1]:
            best = (run, share, attempt)
        if share <= args.max_other_cpu:
            break
        log(f"  disturbed (other processes {100 * share:.0f}% CPU); again")
    return best


def median_run(runs: list, rate) -> tuple[object, list[float]]:
    """The run of median `rate(run)` (the lower middle one of an even count) and every run's
    rate, in the order measured."""
    rates = [rate(run) for run in runs]
    order = sorted(range(len(runs)), key=rates.__getitem__)
    return runs[order[(len(runs) - 1) // 2]], rates


def stack_row(
    name, mode, concurrency, measured: list[tuple[dict, float, int]]
) -> tuple[dict, dict]:
    """A contender's row (and its raw entry) from its repeats: the median one by aggregate
    tokens/s, with every repeat's rate under `runs`."""
    (run, share, repeats), rates = median_run(measured, lambda m: run_rate(m[0]))
    row = make_row(name, mode["name"], concurrency, run["requests"], run["wall_s"])
    row["other_cpu"], row["repeats"], row["runs"] = share, repeats, rates
    row["acceptance"] = metrics.acceptance(run["requests"])
    row["passes"] = metrics.passes(run["requests"])
    row.update({k: row["acceptance"][k] for k in ("acceptance_rate", "mean_acceptance_length")})
    return row, {**key(row), "wall_s": run["wall_s"], "requests": run["requests"]}


def measure_rows(args, bench_stack, contenders, rows, raw, total, log) -> None:
    """Every (mode, concurrency, contender) through `bench_stack`, `--repeats` times (the
    contenders in reverse order every other time), each row the median repeat's."""
    started = time.monotonic()
    cells = [(mode, c) for mode in MODES for c in args.concurrency]
    measured: dict[tuple, list] = {}
    for repeat in range(args.repeats):
        order = contenders if repeat % 2 == 0 else contenders[::-1]
        for mode, concurrency in cells:
            for name, gamma in order:
                m = measure_run(args, bench_stack, mode, gamma, concurrency, log)
                measured.setdefault((name, mode["name"], concurrency), []).append(m)
                if args.repeats > 1:
                    log(
                        f"  repeat {repeat + 1}/{args.repeats}: {LABELS[name]} {mode['name']} "
                        f"conc {concurrency}: {run_rate(m[0]):.1f} tok/s"
                    )
    for mode, concurrency in cells:
        for name, _gamma in contenders:
            row, entry = stack_row(
                name, mode, concurrency, measured[name, mode["name"], concurrency]
            )
            rows.append(row)
            raw.append(entry)
            log(progress_line(len(rows), total, row, time.monotonic() - started))


def run_stack(args, prompts, costs, rows, raw, total, log) -> list[dict]:
    """Every specdec contender through the whole stack (`--split`), the direct round breakdown
    on it; then, where the split leaves the target fewer than `--threads`, speculation off on
    a stack whose target worker has all of them (as a user without a draft would deploy it)."""
    from bench.breakdown import breakdown

    warmups = [(mode, gamma) for _name, gamma in SPECDEC for mode in MODES]
    bench_stack = BenchStack(args, prompts, log, warmups)
    try:
        bench_stack.start()
        measure_rows(args, bench_stack, SPECDEC, rows, raw, total, log)
        log("round breakdown: the stack's workers driven directly (greedy, one session)")
        stack = bench_stack.stack
        rounds = breakdown(
            stack.draft_addresses[0],
            stack.target_addresses[0],
            prompts[0],
            [0, 2, 4, 6],
            args.max_new_tokens,
            costs,
        )
        for r in rounds:
            log(
                f"  γ={r['gamma']}: round {r['round_ms']:.1f} ms = draft forward "
                f"{r['draft_forward_ms']:.1f} + draft RPC {r['draft_rpc_ms']:.1f} + target forward "
                f"{r['target_forward_ms']:.1f} + verify RPC {r['target_rpc_ms']:.1f}"
            )
    finally:
        bench_stack.stop()
    if args.target_threads >= args.threads:
        return rounds  # the stack's own speculation off is that row
    log(f"speculation off on a stack whose target worker has all {args.threads} threads")
    solo = BenchStack(args, prompts, log, [(mode, 0) for mode in MODES], args.threads)
    try:
        solo.start()
        measure_rows(args, solo, [(OFF_ALL_THREADS, 0)], rows, raw, total, log)
    finally:
        solo.stop()
    return rounds

"""specdec against the peers a user would pick instead, side by side, in one run.

    python -m bench.run [--quick] [--pair smollm2|code|both] [--out results/bench]
                                                           (also: specdec bench ...)

Pairs: `smollm2` — SmolLM2-135M-Instruct (converted from its wheel) with the committed draft
trained for it, on held-out chat prompts rendered with its chat template; `code` — the small
code pair under models/ on held-out standard-library slices. Default: both, one after the
other, each into its own folder under --out.

Contenders, on each pair and its held-out prompts, for greedy and for sampling
(temperature 0.8, top-p 0.95), at concurrency 1, 4 and 16 (--quick: 1 and 4):
  1. HF `generate` with the target alone (in-process, autoregressive baseline);
  2. HF assisted generation (`assistant_model=draft`, HF's default assistant settings);
  3. specdec with speculation off (num_speculative_tokens = 0), through the whole stack;
  4. specdec with fixed γ = 2, 4, 6;
  5. specdec adaptive (num_speculative_tokens unset);
  6. where `--split` leaves the target fewer than `--threads`: specdec with speculation off
     on a second stack whose target worker has all of them (as a user without a draft
     deploys it).
Same CPUs for everyone: the HF peers run in a subprocess with `--threads` (2) torch threads,
one model after the other; the stack's split is `--split T+D:P[:B]` — target worker T threads
(`--cpu-bind B`, default auto), draft worker D, coordinator `--pipeline P` — by default all
`--threads` for the target (pinned where those are all the machine's CPUs), 1 for the draft
and pipelining off: at one request the draft's steps and the target's pass take
turns, as HF's do, and on shared cores this split beat one core each at every concurrency
(`specdec bench split`, docs/benchmarks.md "One OpenMP pool a worker"). Where the target
worker pins its threads (`--cpu-bind`, by default where it has all the machine's CPUs), the
HF peers and the in-process costs run pinned alike (libgomp's OMP_PROC_BIND, one CPU a
thread). The HF peers serve at batch size 1, so
concurrent requests queue behind each other (reported as sequential service).
Same device and dtype for everyone: `--device`/`--dtype` (default: the workers' SPECDEC_DEVICE
and SPECDEC_DTYPE, else auto: CUDA in bfloat16 where there is one, else the CPU in float32)
place the workers, the HF peers and the in-process costs alike.
Next to them, in-process: the per-token costs at batch 1 (the model bound at concurrency 1)
and, for each concurrency above 1, the target's pass of N sessions × 1..γ+1 new tokens and the
draft's step of N sessions (the bound under load, `bench.report.batch_bound_for`).
Writes results.json, results.md and PNG plots under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench import metrics
from bench.contenders import MODES, PAIRS, SPECDEC, chat_prompts
from bench.interference import CpuWatch
from bench.measure import in_process, median_run, pinned, run_stack, subprocess_job
from bench.prompts import heldout_prompts
from bench.rows import greedy_check, make_row, other_cpu, progress_line, strip
from specdec.serving.settings import add_flags
from specdec.worker.settings import WorkerSettings
from specdec.worker.threads import format_cpus


def parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run (< 5 minutes)")
    parser.add_argument("--out", default=env("SPECDEC_OUT", "results/bench"))
    parser.add_argument("--pair", choices=[*PAIRS, "both"], default=env("SPECDEC_PAIR", "both"))
    parser.add_argument("--target-model", help="instead of the pair's target")
    parser.add_argument("--draft-model", help="instead of the pair's draft")
    parser.add_argument("--prompts", type=int, help="prompts per run (default 16, quick 4)")
    parser.add_argument("--max-new-tokens", type=int, help="default 128, quick 64")
    parser.add_argument("--concurrency", help="comma-separated (default 1,4,16, quick 1,4)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per contender")
    parser.add_argument(
        "--split",
        help="the stack's T+D:P[:B]: target threads + draft threads : --pipeline "
        "[: the target's --cpu-bind, auto or off] (default: --threads + 1 : off : auto)",
    )
    # the workers' own --device, --dtype and --linear-kernel (same env, choices, checks):
    # bench.run gives them to the workers, the HF peers and the per-token costs alike
    add_flags(parser, WorkerSettings, only=("device", "dtype", "linear_kernel"))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit of each run")
    parser.add_argument(
        "--max-other-cpu",
        type=float,
        default=0.10,
        help="repeat a measurement during which other processes used more of the CPU than this",
    )
    parser.add_argument("--retries", type=int, default=2, help="repeats of a disturbed measurement")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every contender this many times, alternating the order; each row is the "
        "median run (every run's tok/s listed in the report)",
    )
    parser.add_argument(
        "--hf-linear-kernel",
        choices=["default", "packed"],
        default="default",
        help="the HF peers' linear layers: default = torch's own, as a user runs HF; "
        "packed = the stack's prepacked oneDNN kernels, to separate kernels from serving",
    )
    parser.add_argument(
        "--peers-only",
        action="store_true",
        help="measure the HF peers only (e.g. with --hf-linear-kernel packed) into peers.json",
    )
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.quick else 16)
    args.max_new_tokens = args.max_new_tokens or (64 if args.quick else 128)
    args.concurrency = [
        int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,4,16")).split(",")
    ]
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from bench.split import parse_split

    try:
        split = parse_split(args.split or f"{args.threads}+1:off")
    except ValueError as exc:
        parser.error(str(exc).replace("--splits", "--split"))
    args.target_threads, args.draft_threads, args.pipeline, args.cpu_bind = split
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.engine.convert import resolve_model

    args = parse(argv)
    # one placement for every contender: the workers read SPECDEC_<FLAG>, and so do the HF
    # peers and the in-process costs (bench.inproc.placement) in their subprocesses
    os.environ["SPECDEC_DEVICE"], os.environ["SPECDEC_DTYPE"] = args.device, args.dtype
    hf_logging.set_verbosity_error()  # e.g. "sequence longer than the model" on whole files
    pairs = list(PAIRS) if args.pair == "both" else [args.pair]
    for pair in pairs:
        target, draft, prompts = PAIRS[pair]
        run = argparse.Namespace(**vars(args))
        run.pair, run.prompt_source = pair, prompts
        run.target_model = resolve_model(args.target_model or target)
        run.draft_model = args.draft_model or draft
        run.out = str(Path(args.out) / pair)
        bench_pair(run, argv)
    return 0


def service_rate(measured: dict) -> float:
    """An HF peer's tokens/s over its requests, one at a time."""
    requests = measured["requests"]
    return sum(r["generated_tokens"] for r in requests) / sum(r["latency_s"] for r in requests)


def bench_pair(args, argv) -> None:
    from transformers import AutoTokenizer

    from bench.report import analyse, write_outputs

    started = time.monotonic()

    def log(msg: str) -> None:
        print(msg, flush=True)

    for d in (args.target_model, args.draft_model):
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise SystemExit(f"{d!r} holds no trained model (config.json); train it: make models")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    if args.prompt_source == "chat":
        prompts, prompt_info = chat_prompts(tokenizer, args.draft_model, args.prompts)
    else:
        prompts, prompt_info = heldout_prompts(tokenizer, args.prompts, 64, args.prompt_source)
    log(f"== pair {args.pair}: target {args.target_model}, draft {args.draft_model}")
    solo = args.target_threads < args.threads  # the extra speculation-off stack
    total = len(MODES) * len(args.concurrency) * (2 + solo + len(SPECDEC))
    log(
        f"specdec bench{' --quick' if args.quick else ''}: {args.prompts} held-out prompts, "
        f"{args.max_new_tokens} new tokens, concurrency {args.concurrency}, "
        f"{os.cpu_count()} CPUs; HF peers {args.threads} threads, stack target "
        f"{args.target_threads} + draft {args.draft_threads} threads, --pipeline {args.pipeline}"
    )

    log(
        f"measuring per-token costs in-process (target {args.target_threads} thread(s), draft "
        f"{args.draft_threads}): target step, draft step, verify(γ+1)"
    )
    context = [t for p in prompts for t in p][: 64 + args.max_new_tokens // 2]
    costs = in_process(args, context, "costs", reps=30 if args.quick else 100, warmup=5)
    v_text = ", ".join(f"v({g})={x:.2f}" for g, x in costs["v"].items())
    log(
        f"  target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.2f} ms, "
        f"c={costs['c']:.3f}; {v_text} (other processes {other_cpu(costs)})"
    )
    # the sessions in flight at each concurrency: no more than there are prompts
    in_flight = {str(c): min(c, len(prompts)) for c in args.concurrency}
    batches = sorted({n for n in in_flight.values() if n > 1})
    if batches:
        log(f"measuring per-pass costs at batch {batches} in-process, as the workers run them")
        costs["batch"] = in_process(
            args, context, "batch_costs", batches=batches, reps=5 if args.quick else 15, warmup=2
        )
        costs["batch"]["in_flight"] = in_flight
        for n, b in costs["batch"]["batches"].items():
            passes = ", ".join(f"{k}: {ms:.1f}" for k, ms in b["pass_ms"].items())
            log(
                f"  batch {n}: target pass ms by new tokens a session {{{passes}}}, draft step "
                f"{b['draft_step_ms']:.2f} ms (other processes {other_cpu(costs['batch'])})"
            )

    cpus = pinned(args.cpu_bind, args.threads)
    log(
        f"HF peers in a subprocess ({args.threads} threads, "
        f"{'pinned to CPUs ' + format_cpus(cpus) if cpus else 'not pinned'}), one request at a time"
    )
    watch = CpuWatch()
    job = {
        "job": "hf",
        "threads": args.threads,
        "target_model": args.target_model,
        "draft_model": args.draft_model,
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        "modes": list(MODES),
        "linear_kernel": args.hf_linear_kernel,
        "cpu_bind": args.cpu_bind,
        "max_other_cpu": args.max_other_cpu,
        "retries": args.retries,
    }
    hf_runs = [subprocess_job(job, timeout_s=args.timeout_s * 4) for _ in range(args.repeats)]
    hf = hf_runs[0]
    # each peer's median run of the repeats, once: its rows at every concurrency and raw entry
    peers = {
        (mode["name"], peer): median_run(
            [run["peers"][mode["name"]][peer] for run in hf_runs], service_rate
        )
        for mode in MODES
        for peer in ("hf_target", "hf_assisted")
    }
    hf_other_cpu = watch.others()
    rows: list[dict] = []
    raw: list[dict] = []
    for mode in MODES:
        for concurrency in args.concurrency:
            for peer in ("hf_target", "hf_assisted"):
                entry, rates = peers[mode["name"], peer]
                measured = entry["requests"]
                queued, wall = metrics.sequential_service(measured, concurrency)
                row = make_row(peer, mode["name"], concurrency, queued, wall)
                row["other_cpu"] = entry.get("other_cpu", hf_other_cpu)
                row["repeats"], row["runs"] = entry.get("repeats", 0), rates
                forwards = sum(r["target_forwards"] for r in measured)
                tokens = sum(r["generated_tokens"] for r in measured)
                row["acceptance_rate"] = None
                row["mean_acceptance_length"] = tokens / forwards if peer == "hf_assisted" else None
                rows.append(row)
                service_s = sum(r["latency_s"] for r in measured)
                log(progress_line(len(rows), total, row, service_s) + "  [sequential service]")
    for mode in MODES:
        for peer in ("hf_target", "hf_assisted"):
            measured = peers[mode["name"], peer][0]
            raw.append({"contender": peer, "mode": mode["name"], "concurrency": 1, **measured})

    if args.peers_only:
        (out / "peers.json").write_text(json.dumps({"command": argv, "rows": rows}, indent=1))
        log(f"peers only: wrote {out / 'peers.json'}")
        return
    log(
        f"specdec stack: target worker {args.target_threads} thread(s), draft worker "
        f"{args.draft_threads}, coordinator --pipeline {args.pipeline}"
    )
    rounds = run_stack(args, prompts, costs, rows, raw, total, log)

    checks = {}
    for entry in raw:
        if entry["mode"] == "greedy" and entry["contender"] != "hf_target":
            reference = next(
                r["requests"]
                for r in raw
                if r["contender"] == "hf_target" and r["mode"] == "greedy"
            )
            checks[f"{entry['contender']}@{entry['concurrency']}"] = greedy_check(
                reference, entry["requests"]
            )
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.run", *(sys.argv[1:] if argv is None else argv)]),
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "device": hf.get("device", "cpu"),
            "dtype": hf.get("dtype", "float32"),
        },
        "threads": {
            "hf_peers": args.threads,
            "stack_target_worker": args.target_threads,
            "stack_draft_worker": args.draft_threads,
            "stack_pipeline": args.pipeline,
            "off_all_threads_target_worker": args.threads,
            "cost_measurement": "each model at its worker's threads",
        },
        "linear_kernels": {
            "stack_and_costs": args.linear_kernel,
            "hf_peers": args.hf_linear_kernel,
        },
        "pair": args.pair,
        "target_model": args.target_model,
        "draft_model": args.draft_model,
        "prompts": {**prompt_info, "count": len(prompts)},
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "modes": list(MODES),
        "hf_assistant_defaults": {
            "num_assistant_tokens": 20,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.4,
        },
        "disturbance": {"max_other_cpu": args.max_other_cpu, "retries": args.retries},
        "repeats": args.repeats,
        "duration_s": time.monotonic() - started,
    }
    for entry in raw:
        entry["requests"] = strip(entry["requests"])
    result = analyse(meta, costs, rows, checks, rounds)
    result["raw"] = raw
    paths = write_outputs(result, out)
    log(f"done in {meta['duration_s'] / 60:.1f} min; wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    sys.exit(main())

"""The Python half of `bench/gpu_check.sh`: GPU readiness checks, one subcommand per step.

    python -m bench.gpu_check env     [--device cuda] [--out DIR]   # python, torch, CUDA, modules
    python -m bench.gpu_check pair                                  # the pair `auto` resolves to
    python -m bench.gpu_check greedy  [--device cuda] [--dtype float32] [--gammas 2,4] ...
    python -m bench.gpu_check math    [--device cuda] [--vocabs ...] [--batches ...]
    python -m bench.gpu_check math    --device cpu --vocabs 512 --batches 1,4 --bench-cases
    python -m bench.gpu_check bench-math --out DIR -- --quick --threads 1   # python -m bench.math
    python -m bench.gpu_check bench --device cuda --pair smollm2 --out DIR  # python -m bench.run

`greedy` starts the real stack (embedded Redis, draft and target workers with
`--device/--dtype`, a coordinator: real processes, gRPC on loopback), sends every prompt at
each γ concurrently (so the target batches their verifies) and compares each output, token
for token, with Hugging Face `generate(do_sample=False)` of the target loaded on the same
device in the same dtype. A difference is tolerated only where it is a numerical near-tie:
at the first differing position, the two tokens' logits under a float32 forward of the target
(same device) are within `--tol` of each other (default 1e-3 for float32, 0.25 for float16,
0.5 for bfloat16; `--tol 0` demands identity). `--perturb-reference` (or
GPU_CHECK_PERTURB_REFERENCE=1) is the negative control: the reference token in the middle of
each prompt's output is replaced by its least likely token, so the check must report FAIL.

`math` runs the workers' hot path of bench/math.py (`propose_step`, `verify_logits`) on
`--device` with the same LLM-like inputs bench/math.py builds, checks it returns the same
tokens as on the CPU and times it (CUDA-synchronised medians); for the sampling cases also
in fixed shapes (`--sampling-graphs`: one CUDA graph a call on a GPU), checked and timed the
same way.

Every subcommand ends with one line `RESULT PASS …` or `RESULT FAIL …`; exit 0 on PASS,
1 on FAIL, 2 when CUDA was required and is missing, 3 when modules the stack needs are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.gpu_env import TOLERANCE, cmd_env, cmd_pair, result, run_module
from bench.gpu_greedy import cmd_greedy
from bench.gpu_math import cmd_math

# --- python -m bench.math and python -m bench.run, summarised ------------------------------


def cmd_bench_math(args) -> int:
    """python -m bench.math (CPU: it has no device option), then its slowest verify."""
    rc = run_module("bench.math", [*args.args, "--out", args.out])
    path = Path(args.out) / "math.json"
    if rc != 0 or not path.is_file():
        return result(False, f"python -m bench.math exited {rc}")
    rows = json.loads(path.read_text())["rows"]
    worst = max(rows, key=lambda r: r["verify_ms"])
    return result(
        bool(rows),
        f"bench.math on the CPU: {len(rows)} cases; slowest verify {worst['verify_ms']:.1f} ms "
        f"(vocab {worst['vocab']:,} x batch {worst['batch']}, {worst['mode']})",
    )


def bench_summary(path: Path) -> int:
    if not path.is_file():
        return result(False, f"bench.run wrote no {path}")
    data = json.loads(path.read_text())
    checks = data.get("greedy_checks", {})
    same = sum(c["identical"] for c in checks.values())
    total = sum(c["requests"] for c in checks.values())
    for name, c in sorted(checks.items()):
        print(f"  greedy {name}: {c['identical']}/{c['requests']} identical to HF (CPU)")
    rates = []
    for row in data.get("rows", []):
        print(
            f"  {row['label']:<26} {row['mode']:<8} conc {row['concurrency']:>2}: "
            f"{row['tokens_per_s']:.1f} tok/s"
        )
        if row["concurrency"] == 1 and row["mode"] == "greedy":
            rates.append(f"{row['contender']} {row['tokens_per_s']:.0f}")
    return result(
        True,
        f"bench.run: greedy outputs {same}/{total} identical to HF (same device and dtype); "
        f"tok/s at concurrency 1: " + ", ".join(rates),
    )


def cmd_bench(args) -> int:
    """python -m bench.run --pair P --quick --device D --dtype T: the workers, the HF peers
    and the per-token costs all on the device, in the dtype."""
    argv = ["--pair", args.pair, "--quick", "--threads", "2", "--out", args.out]
    argv += ["--device", args.device, "--dtype", args.dtype, *args.args]
    rc = run_module("bench.run", argv)
    if rc != 0:
        return result(False, f"python -m bench.run exited {rc}")
    return bench_summary(Path(args.out) / args.pair / "results.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="python, torch, CUDA and the modules the stack needs")
    env.add_argument("--device", default="cuda")
    env.add_argument("--out", default="")

    pair = sub.add_parser("pair", help="print the pair `auto` resolves to (smollm2 or code)")
    pair.add_argument("--pair", default="auto", choices=["auto", "smollm2", "code"])

    g = sub.add_parser("greedy", help="the stack's greedy output against HF generate")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    g.add_argument("--pair", default="auto", choices=["auto", "smollm2", "code"])
    g.add_argument("--target", default="", help="a target model directory instead of the pair")
    g.add_argument("--draft", default="", help="with --target: its draft")
    g.add_argument("--gammas", default="2,4")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--tol", type=float, default=None, help="near-tie tolerance in logits")
    g.add_argument(
        "--perturb-reference",
        action="store_true",
        default=os.environ.get("GPU_CHECK_PERTURB_REFERENCE", "") not in ("", "0"),
        help="negative control: perturb the reference, the check must FAIL "
        "[env GPU_CHECK_PERTURB_REFERENCE=1]",
    )
    g.add_argument("--startup-timeout-s", type=float, default=180.0)
    g.add_argument("--out", default="")

    m = sub.add_parser("math", help="bench/math.py's hot path on --device against the CPU")
    m.add_argument("--device", default="cuda")
    m.add_argument("--vocabs", default="8192,49152,128256,262144")
    m.add_argument("--batches", default="1,16,64")
    m.add_argument("--repeat", type=int, default=10)
    m.add_argument(
        "--bench-cases",
        action="store_true",
        help="first run bench/math.py's own cases (CPU, dense reference too) at these sizes",
    )
    m.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the sampling math in fixed shapes (--sampling-graphs; CUDA graphs on a GPU)",
    )
    m.add_argument(
        "--stress",
        type=int,
        default=0,
        help="then N random rounds in fixed shapes against the CPU's eager path (`stress`)",
    )
    m.add_argument("--out", default="")

    bm = sub.add_parser("bench-math", help="python -m bench.math ARGS --out DIR, summarised")
    bm.add_argument("--out", default="results/gpu_check/math")
    bm.add_argument("args", nargs=argparse.REMAINDER, help="after --: bench.math's flags")

    br = sub.add_parser("bench", help="python -m bench.run --quick, everyone on --device")
    br.add_argument("--device", default="cuda")
    br.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    br.add_argument("--pair", default="smollm2", choices=["smollm2", "code"])
    br.add_argument("--out", default="results/gpu_check/bench")
    br.add_argument("args", nargs=argparse.REMAINDER, help="after --: more bench.run flags")

    args = p.parse_args(argv)
    if getattr(args, "args", None) and args.args[0] == "--":
        args.args = args.args[1:]
    commands = {
        "env": cmd_env,
        "pair": cmd_pair,
        "greedy": cmd_greedy,
        "math": cmd_math,
        "bench-math": cmd_bench_math,
        "bench": cmd_bench,
    }
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        print(f"gpu_check: {args.command} interrupted (a timeout or Ctrl-C)", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())

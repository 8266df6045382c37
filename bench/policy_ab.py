"""The adaptive policy of this checkout against another revision's, side by side under load.

    python -m bench.policy_ab --baseline REV [--concurrency 16] [--prompts 24] [--tokens 128]
                              [--repeats 3] [--target-model models/target]
                              [--draft-model models/draft] [--out results/policy_ab]

One stack of this checkout (target and draft worker 1 thread each, Redis, its coordinator),
plus a coordinator of git revision REV (checked out into a temporary worktree, with this
checkout's generated protobuf modules) on the same workers and Redis: only the coordinator
differs. In turn, per repeat and mode (greedy; T = 0.8, top-p 0.95): REV's adaptive γ, this
checkout's adaptive γ, and this checkout at γ = 0, 2 and 4 (`bench.serving.run_load`:
closed-loop clients, `--concurrency` in flight, held-out code-pair prompts, EOS ignored).
Both coordinators keep their state from run to run, as a serving coordinator does. Each
entry is the aggregate tokens/s, median over the repeats (the machine drifts by ±15 %
between runs of the same configuration: single runs prove nothing here).
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.pipeline import MODES, held_out, pair_arguments
from bench.report import save
from bench.serving import run_load_sync
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worktree(revision: str, into: str) -> str:
    """REV checked out under `into`, with this checkout's generated specdec/v1 modules (they
    are git-ignored; the wire protocol must be the same for the comparison to hold)."""
    path = os.path.join(into, "baseline")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "-q", "--detach", path, revision], check=True
    )
    for generated in glob.glob(os.path.join(ROOT, "specdec", "v1", "*_pb2*.py*")):
        shutil.copy(generated, os.path.join(path, "specdec", "v1"))
    return path


def main(argv: list[str] | None = None) -> int:
    p = pair_arguments("policy-ab", __doc__, 24, 3, "results/policy_ab")
    p.add_argument("--baseline", required=True, help="git revision whose coordinator to compare")
    p.add_argument("--concurrency", type=int, default=16)
    p.set_defaults(tokens=128)
    args = p.parse_args(argv)
    prompts = held_out(args)
    rates: dict[str, list[float]] = {}
    settings = StackSettings(
        args.target_model, args.draft_model, port=0, draft_threads=1, target_threads=1
    )
    with tempfile.TemporaryDirectory() as scratch, Stack(settings) as stack:
        path = worktree(args.baseline, scratch)
        try:
            port = free_port()
            baseline = subprocess.Popen(
                [sys.executable, "-m", "coordinator", *stack._coordinator_args(port)],
                cwd=path,
                env={**os.environ, "PYTHONPATH": path},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            time.sleep(10)  # its start (it warms up with the first requests below)
            old, new = f"{settings.host}:{port}", stack.address
            configs = [(f"{args.baseline} adaptive", old, None), ("adaptive", new, None)]
            configs += [(f"γ={g}", new, g) for g in (0, 2, 4)]
            for _, address, _ in configs[:2]:
                run_load_sync(address, prompts[:16], MODES["sampling"], None, 16, 16, 300)
            for repeat in range(args.repeats):
                for mode, sampling in MODES.items():
                    for name, address, gamma in configs:
                        run = run_load_sync(
                            address, prompts, sampling, gamma, args.tokens, args.concurrency, 900
                        )
                        tokens = sum(len(r["token_ids"]) for r in run["requests"])
                        rates.setdefault(f"{mode}/{name}", []).append(tokens / run["wall_s"])
                        print(
                            f"repeat {repeat} {mode} {name}: {rates[f'{mode}/{name}'][-1]:.1f} tok/s",
                            flush=True,
                        )
            baseline.terminate()
            baseline.wait(30)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)
    lines = [
        f"# Adaptive policy A/B: this checkout against {args.baseline}, concurrency "
        f"{args.concurrency}, {args.prompts} held-out prompts × {args.tokens} tokens, target and "
        f"draft 1 thread each, median of {args.repeats} runs (aggregate tok/s)",
        "",
        "| mode | "
        + " | ".join(name for name, _, _ in configs)
        + " | adaptive / γ=0 | adaptive / best fixed |",
        "|---|" + "---:|" * (len(configs) + 2),
    ]
    for mode in MODES:
        median = {name: statistics.median(rates[f"{mode}/{name}"]) for name, _, _ in configs}
        best = max(median[name] for name in median if name.startswith("γ="))
        cells = " | ".join(f"{median[name]:.1f}" for name, _, _ in configs)
        lines.append(
            f"| {mode} | {cells} | {median['adaptive'] / median['γ=0']:.2f}× | "
            f"{median['adaptive'] / best:.2f}× |"
        )
    save(args.out, "policy_ab", "\n".join(lines), {"args": vars(args), "rates": rates})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

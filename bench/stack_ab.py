"""Whole stacks of this checkout and of another revision, taking turns under the same load.

    python -m bench.stack_ab --baseline REV [--concurrency 16] [--gammas 0,2,adaptive]
                             [--modes greedy,sampling] [--prompts 16] [--tokens 128]
                             [--repeats 4] [--split 1+1:auto] [--target-model models/target]
                             [--draft-model models/draft] [--out results/stack_ab]
                             (also: specdec bench stack-ab)

For a change of the serving itself (the workers' streams, the batcher), which
`bench.policy_ab` (only the coordinator differs) cannot compare: per repeat, a stack of REV
(its coordinator, workers and their code, from a temporary worktree with this checkout's
generated protobuf modules) and a stack of this checkout, in alternating order, each with
its own embedded Redis, the same split of the cores (`--split T+D:P[:B]` as `bench.split`,
default 1+1:auto: target and draft worker 1 thread each), the same model files (this
checkout's). Per stack, after a short warm-up, each (mode, γ) runs once
(`bench.serving.run_load`: closed-loop clients, `--concurrency` in flight, held-out prompts,
EOS ignored; `bench.pipeline.load_on_stack`, as `bench.attention_ab`). Each entry is the aggregate tokens/s, median over the repeats, with every
repeat listed (on a shared machine single runs prove nothing).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile

from bench.pipeline import gamma_list, held_out, load_on_stack, pair_arguments
from bench.policy_ab import ROOT, worktree
from bench.report import save
from bench.split import parse_split
from specdec.launcher.stack import StackSettings


def measure(args, prompts, code_dir: str) -> dict[str, float]:
    """One stack from `code_dir` ("" = this checkout): tokens/s per "mode/γ"."""
    target, draft, pipeline, bind = parse_split(args.split)
    settings = StackSettings(
        os.path.abspath(args.target_model),
        os.path.abspath(args.draft_model),
        port=0,
        draft_threads=draft,
        target_threads=target,
        coordinator_args=["--pipeline", pipeline],
        target_args=["--cpu-bind", bind],
        code_dir=code_dir,
    )
    results = load_on_stack(
        settings,
        prompts,
        args.modes.split(","),
        gamma_list(args.gammas),
        args.tokens,
        args.concurrency,
    )
    return {
        f"{mode}/{'adaptive' if gamma is None else gamma}": rate
        for (mode, gamma), (rate, _) in results.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = pair_arguments("stack-ab", __doc__, 16, 4, "results/stack_ab")
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gammas", default="0,2,adaptive")
    p.add_argument("--modes", default="greedy,sampling")
    p.add_argument(
        "--split",
        default="1+1:auto",
        help="both stacks' T+D:P[:B], as bench.split (bench.run's stack: 2+1:off)",
    )
    p.set_defaults(tokens=128)
    args = p.parse_args(argv)
    try:
        parse_split(args.split)
    except ValueError as exc:
        p.error(str(exc))
    prompts = held_out(args)
    runs: dict[str, list[dict[str, float]]] = {args.baseline: [], "this checkout": []}
    with tempfile.TemporaryDirectory() as scratch:
        path = worktree(args.baseline, scratch)
        try:
            for repeat in range(args.repeats):
                order = [(args.baseline, path), ("this checkout", "")]
                for name, code in order if repeat % 2 == 0 else order[::-1]:
                    runs[name].append(measure(args, prompts, code))
                    print(f"repeat {repeat} {name}: {runs[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)
    old, new = runs[args.baseline], runs["this checkout"]
    lines = [
        f"# Whole stacks: this checkout against {args.baseline}, concurrency "
        f"{args.concurrency}, {args.prompts} held-out prompts × {args.tokens} tokens, split "
        f"{args.split} (target + draft threads : --pipeline [: the target's --cpu-bind]), "
        f"alternating, median of {args.repeats} (aggregate tok/s)",
        "",
        f"| mode/γ | {args.baseline} | this checkout | ratio | {args.baseline} runs | "
        "this checkout's runs |",
        "|---|---:|---:|---:|---|---|",
    ]
    for key in old[0]:
        a = statistics.median(r[key] for r in old)
        b = statistics.median(r[key] for r in new)
        lines.append(
            f"| {key} | {a:.1f} | {b:.1f} | {b / a:.3f}× | "
            f"{', '.join(f'{r[key]:.0f}' for r in old)} | {', '.join(f'{r[key]:.0f}' for r in new)} |"
        )
    save(args.out, "stack_ab", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

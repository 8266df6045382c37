"""How a stack's CPU threads are best split between its target and draft workers.

    python -m bench.split [--splits 1+1:auto,2+1:off,2+1:auto] [--concurrency 1,4,16]
                          [--gammas 0,4,adaptive] [--modes greedy,sampling] [--prompts 8]
                          [--tokens 128] [--repeats 2] [--target-model models/target]
                          [--draft-model models/draft] [--out results/split]
                          (also: specdec bench split)

A split `T+D:P[:B]` is a stack whose target worker has T torch threads and `--cpu-bind B`
(auto, the default, or off), its draft worker D threads, and its coordinator `--pipeline P`. Per repeat, one stack of each split, in alternating order,
each with its own embedded Redis and the same model files; per stack and concurrency, after a
warm-up, each (mode, γ) runs once (`bench.pipeline.loads_on_stack`: closed-loop clients,
held-out prompts, EOS ignored). Each entry is the aggregate tokens/s, median over the
repeats, with every repeat listed. On a machine with as many cores as the stack has threads
the answer is "all of them"; on fewer, the workers' threads take turns, and what pays depends
on whether they run at the same time (pipelined rounds, concurrent sessions) or in turn
(docs/benchmarks.md, "One OpenMP pool a worker").
"""

from __future__ import annotations

import os
import statistics

from bench.pipeline import gamma_list, held_out, loads_on_stack, pair_arguments
from bench.report import save
from specdec.launcher.stack import StackSettings


def parse_split(text: str) -> tuple[int, int, str, str]:
    """`T+D:P[:B]` → (target threads, draft threads, pipeline, the target's --cpu-bind)."""
    threads, pipeline, *bind = text.split(":") + ([] if ":" in text else [""])
    target, _, draft = threads.partition("+")
    if not (
        target.isdigit() and draft.isdigit() and pipeline in ("auto", "on", "off")
    ) or bind not in ([], ["auto"], ["off"]):
        raise ValueError(f"--splits: {text!r} is not T+D:P[:B] (e.g. 2+1:off, 2+1:off:off)")
    if int(target) < 1 or int(draft) < 1:
        raise ValueError(f"--splits: {text!r}: each worker needs at least one thread")
    return int(target), int(draft), pipeline, bind[0] if bind else "auto"


def main(argv: list[str] | None = None) -> int:
    p = pair_arguments("split", __doc__, 8, 2, "results/split")
    p.add_argument("--splits", default="1+1:auto,2+1:off,2+1:auto")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--gammas", default="0,4,adaptive")
    p.add_argument("--modes", default="greedy,sampling")
    p.set_defaults(tokens=128)
    args = p.parse_args(argv)
    try:
        splits = {text: parse_split(text) for text in args.splits.split(",")}
    except ValueError as exc:
        p.error(str(exc))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = held_out(args)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in splits}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = list(splits) if repeat % 2 == 0 else list(splits)[::-1]
        for name in order:
            target, draft, pipeline, bind = splits[name]
            settings = StackSettings(
                os.path.abspath(args.target_model),
                os.path.abspath(args.draft_model),
                port=0,
                target_threads=target,
                draft_threads=draft,
                coordinator_args=["--pipeline", pipeline],
                target_args=["--cpu-bind", bind],
            )
            results = loads_on_stack(
                settings,
                prompts,
                args.modes.split(","),
                gamma_list(args.gammas),
                args.tokens,
                concurrencies,
            )
            rates = {}
            for (mode, gamma, c), (rate, out) in results.items():
                key = f"{mode}/{'adaptive' if gamma is None else gamma}/{c}"
                rates[key] = rate
                if mode == "greedy":
                    outputs.setdefault(key, out)
                    assert out == outputs[key], f"{name} {key}: greedy outputs differ"
            runs[name].append(rates)
            print(f"repeat {repeat} {name}: { {k: round(v, 1) for k, v in rates.items()} }")
    names = list(splits)
    lines = [
        f"# Thread splits: {args.prompts} held-out prompts × {args.tokens} tokens, "
        f"{os.cpu_count()} CPUs, alternating, median of {args.repeats} (aggregate tok/s; "
        "T+D:P[:B] = target threads + draft threads : --pipeline [: the target's --cpu-bind])",
        "",
        "| mode/γ/concurrency | " + " | ".join(names) + " | best | runs |",
        "|---|" + "---:|" * len(names) + "---|---|",
    ]
    for key in runs[names[0]][0]:
        medians = {n: statistics.median(r[key] for r in runs[n]) for n in names}
        best = max(medians, key=medians.get)
        listed = "; ".join(f"{n}: {', '.join(f'{r[key]:.0f}' for r in runs[n])}" for n in names)
        cells = " | ".join(f"{medians[n]:.1f}" for n in names)
        lines.append(f"| {key} | {cells} | {best} | {listed} |")
    lines.append("")
    lines.append("Greedy outputs: every split's equal to the first's (checked per run).")
    save(args.out, "split", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two ways of a batch's attention, under load: by default attention over each session's
own KV against the padded batch copy (`--batch-attention auto` / `padded`); with `--compare
attention-kernel`, short blocks by the compiled kernel against torch's per-session calls
(`--attention-kernel auto` / `torch`).

    python -m bench.attention_ab [--compare batch-attention|attention-kernel]
                                 [--concurrency 16] [--prompts 24] [--tokens 128]
                                 [--gammas 0,4,adaptive] [--repeats 3] [--context 600]
                                 [--new 5] [--target-model models/target]
                                 [--draft-model models/draft] [--out results/attention_ab]

First, in one process (1 torch thread), one target forward pass of `--concurrency` sessions
(cached contexts of ~`--context` tokens, `--new` new tokens each: 5 is a γ = 4 verify) under
each setting: the same batch pass after pass, and two halves of it taking turns (what a batch
looks like when sessions drift out of step, arrive and finish); median of 10 passes.

Then two stacks of this checkout that differ only in that flag of their workers: for
`--batch-attention`, `auto` (attention reads each session's own KV buffers) and `padded` (each
session's cached KV left-padded into a batch copy, reused while the same sessions come back);
for `--attention-kernel`, `auto` (the compiled kernel) and `torch`. Target and draft
worker 1 thread each. Per repeat, one stack after the other (their order alternates), each
runs every mode (greedy; T = 0.8, top-p 0.95) and γ (`bench.serving.run_load`: closed-loop
clients, `--concurrency` in flight, held-out code-pair prompts, EOS ignored). Entries are
aggregate tokens/s, the median over the repeats; the report also says whether every greedy
output was the same token for token under both.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.inproc import ragged_sessions, timed_pass
from bench.pipeline import MODES, gamma_list, held_out, load_on_stack, pair_arguments
from bench.report import save
from specdec.engine.model import ModelRuntime, RuntimeSettings
from specdec.launcher.stack import StackSettings

# the flag compared -> (its RuntimeSettings field, the baseline value, the new one)
COMPARE = {
    "batch-attention": ("batch_attention", "padded", "auto"),
    "attention-kernel": ("attention_kernel", "torch", "auto"),
}


def label(gamma: int | None) -> str:
    return "adaptive" if gamma is None else f"γ={gamma}"


def per_pass(
    model_dir: str, compare: str, batch: int, context: int, new: int = 5
) -> dict[str, float]:
    """Median ms of one forward pass per setting: the same batch, and two halves in turn."""
    field, *values = COMPARE[compare]
    return {
        f"{case}/{value}": ms
        for value in values
        for case, ms in _passes(model_dir, {field: value}, batch, context, new).items()
    }


def _passes(model_dir: str, setting: dict, batch: int, context: int, new: int) -> dict:
    runtime = ModelRuntime(RuntimeSettings(model_dir, threads=1, **setting))
    gen = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(1, runtime.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    # ragged, around `context`; each pass rejects every candidate: same lengths again
    sessions = ragged_sessions(runtime, [draw(context + 13 * i - 6 * batch) for i in range(batch)])
    block = draw(new)
    halves = sessions[: batch // 2], sessions[batch // 2 :]
    cases = {
        "the same batch": lambda: timed_pass(runtime, sessions, block),
        "two halves in turn": lambda: (
            timed_pass(runtime, halves[0], block),
            timed_pass(runtime, halves[1], block),
        ),
    }
    times = {}
    for case, run in cases.items():
        samples = []
        for i in range(12):
            start = time.perf_counter()
            run()
            if i >= 2:
                samples.append(1000 * (time.perf_counter() - start))
        times[case] = statistics.median(samples)
    return times


def main(argv: list[str] | None = None) -> int:
    p = pair_arguments("attention-ab", __doc__, 24, 3, "results/attention_ab")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gammas", default="0,4,adaptive", help="comma-separated; adaptive = unset")
    p.add_argument("--context", type=int, default=600, help="cached tokens per session, per pass")
    p.add_argument("--new", type=int, default=5, help="new tokens per session, per pass")
    p.add_argument("--compare", choices=sorted(COMPARE), default="batch-attention")
    p.set_defaults(tokens=128)
    args = p.parse_args(argv)
    _, base, new = COMPARE[args.compare]
    settings_pair = (base, new)
    passes = per_pass(args.target_model, args.compare, args.concurrency, args.context, args.new)
    prompts = held_out(args)
    gammas = gamma_list(args.gammas)
    rates: dict[str, list[float]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for attention in settings_pair if repeat % 2 == 0 else settings_pair[::-1]:
            flags = [f"--{args.compare}", attention]
            settings = StackSettings(
                args.target_model,
                args.draft_model,
                port=0,
                draft_threads=1,
                target_threads=1,
                target_args=flags,
                draft_args=flags,
            )
            for (mode, gamma), (rate, outputs) in load_on_stack(
                settings, prompts, MODES, gammas, args.tokens, args.concurrency
            ).items():
                key = f"{mode}/{label(gamma)}/{attention}"
                rates.setdefault(key, []).append(rate)
                if mode == "greedy":
                    greedy.setdefault(f"{label(gamma)}/{attention}", outputs)
                print(f"repeat {repeat} {key}: {rate:.1f} tok/s", flush=True)
    same = all(
        greedy[f"{label(g)}/{a}"] == greedy[f"{label(gammas[0])}/{base}"]
        for g in gammas
        for a in settings_pair
    )
    lines = [
        f"# One verify pass of {args.concurrency} sessions (~{args.context} cached tokens, "
        f"{args.new} new each), 1 torch thread, median ms of 10 passes",
        "",
        f"| batch | --{args.compare} {base} | {new} | {new} / {base} |",
        "|---|---:|---:|---:|",
    ]
    for case in ("the same batch", "two halves in turn"):
        old_ms, new_ms = (passes[f"{case}/{a}"] for a in settings_pair)
        lines.append(f"| {case} | {old_ms:.1f} | {new_ms:.1f} | {new_ms / old_ms:.2f}× |")
    lines += [
        "",
        f"# --{args.compare} A/B: concurrency {args.concurrency}, {args.prompts} held-out "
        f"prompts × {args.tokens} tokens, target and draft worker 1 thread each, median of "
        f"{args.repeats} runs (aggregate tok/s)",
        "",
        f"| mode | γ | {base} | {new} | {new} / {base} |",
        "|---|---|---:|---:|---:|",
    ]
    for mode in MODES:
        for gamma in gammas:
            old_rate, new_rate = (
                statistics.median(rates[f"{mode}/{label(gamma)}/{a}"]) for a in settings_pair
            )
            lines.append(
                f"| {mode} | {label(gamma)} | {old_rate:.1f} | {new_rate:.1f} | "
                f"{new_rate / old_rate:.2f}× |"
            )
    lines += ["", f"Every greedy output identical under both and at every γ: {same}"]
    data = {"args": vars(args), "per_pass_ms": passes, "rates": rates}
    save(args.out, "attention_ab", "\n".join(lines), data)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What pipelined rounds give: the same requests through a stack with `--pipeline off` and one
with `--pipeline on` (and the default `auto`), one after the other.

    python -m bench.pipeline [--prompts 8] [--tokens 96] [--repeats 2]
                             [--target-model models/target] [--draft-model models/draft]
                             [--out results/pipeline]            (also: specdec bench pipeline)

The stacks alternate off, on, auto, off, on, auto, … (a drift of the machine shows in all),
each with the target and the draft worker on one thread. Per stack, at concurrency 1, the
held-out prompts of the code pair (64 tokens of the held-out standard-library files) with
greedy and with sampling (T = 0.8, top-p 0.95, seeded) at γ = 2, 4 and adaptive; per
configuration the aggregate decode rate (generated tokens / total time), the rounds and the
share of rounds whose candidates were drafted ahead (`GenerationStats.drafted_ahead`), and
whether the greedy outputs are the same in every stack (they must be: lossless either way).
"""

from __future__ import annotations

import argparse
import json
import statistics

from transformers import AutoTokenizer

from bench.prompts import heldout_prompts
from bench.report import save
from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings

MODES = {"greedy": {"temperature": 0.0}, "sampling": {"temperature": 0.8, "top_p": 0.95}}
GAMMAS = (2, 4, None)
STACKS = ("off", "on", "auto")


def measure(address: str, prompts: list[list[int]], tokens: int, gammas: tuple = GAMMAS) -> dict:
    """Every (mode, γ) over the prompts at concurrency 1, through the coordinator at
    `address`."""
    results = {}
    with Client(address, timeout_s=600) as client:
        client.generate(prompts[0], max_new_tokens=8, ignore_eos=True)  # warm-up
        for mode, sampling in MODES.items():
            for gamma in gammas:
                generated = rounds = ahead = drafts = drafted = 0
                seconds, outputs = 0.0, []
                for i, prompt in enumerate(prompts):
                    out = client.generate(
                        prompt,
                        max_new_tokens=tokens,
                        ignore_eos=True,
                        seed=i if mode == "sampling" else None,
                        num_speculative_tokens=gamma,
                        **sampling,
                    )
                    s = out.stats
                    generated += s.generated_tokens
                    rounds += s.rounds
                    ahead += s.drafted_ahead
                    drafts += s.drafts
                    drafted += s.draft_tokens
                    seconds += (s.total_time_ms - s.time_to_first_token_ms) / 1000
                    outputs.append(list(out.token_ids))
                results[f"{mode}/{gamma}"] = {
                    "tokens_per_s": (generated - len(prompts)) / seconds,
                    "rounds": rounds,
                    "drafted_ahead": ahead,
                    "drafts": drafts,  # rounds with candidates
                    "draft_tokens": drafted,
                    "outputs": outputs,
                }
    return results


def pair_arguments(
    command: str, doc: str, prompts: int, repeats: int, out: str
) -> argparse.ArgumentParser:
    """The flags every A/B bench of the code pair takes (this module's, bench.streams',
    bench.confidence's, bench.policy_ab's); the caller adds its own."""
    p = argparse.ArgumentParser(prog=f"specdec bench {command}", description=doc)
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--target-model", default="models/target")
    p.add_argument("--draft-model", default="models/draft")
    p.add_argument("--heldout", default="models/heldout_files.txt")
    p.add_argument("--out", default=out)
    return p


def gamma_list(text: str) -> tuple[int | None, ...]:
    """A --gammas value of an A/B bench: comma-separated γs, `adaptive` = unset (None)."""
    return tuple(None if g == "adaptive" else int(g) for g in text.split(","))


def load_on_stack(
    settings: StackSettings, prompts, modes, gammas, tokens: int, concurrency: int
) -> dict[tuple[str, int | None], tuple[float, list[list[int]]]]:
    """One stack of `settings`, warmed up, then per (mode, γ) one closed-loop load of the
    prompts (`bench.serving.run_load`, EOS ignored): aggregate tokens/s and the outputs. What
    an A/B bench of whole stacks runs on each of its stacks in turn."""
    results = loads_on_stack(settings, prompts, modes, gammas, tokens, (concurrency,))
    return {(mode, gamma): result for (mode, gamma, _), result in results.items()}


def loads_on_stack(
    settings: StackSettings, prompts, modes, gammas, tokens: int, concurrencies
) -> dict[tuple[str, int | None, int], tuple[float, list[list[int]]]]:
    """`load_on_stack` at each of `concurrencies` in turn, on one stack."""
    from bench.serving import run_load_sync

    results = {}
    with Stack(settings) as stack:
        for concurrency in concurrencies:
            # warm-up: each measured (mode, γ) once, at the load's concurrency, 16 tokens (as
            # `bench.serving.BenchStack`): the first run of a pass shape on the workers costs
            # far more (the kernels' first calls); a warm-up at another concurrency left the
            # first measured setting up to ~25 % slow (docs/benchmarks.md)
            for mode in modes:
                for gamma in gammas:
                    run_load_sync(
                        stack.address,
                        prompts[:concurrency],
                        MODES[mode],
                        gamma,
                        16,
                        concurrency,
                        300,
                    )
            for mode in modes:
                for gamma in gammas:
                    run = run_load_sync(
                        stack.address, prompts, MODES[mode], gamma, tokens, concurrency, 900
                    )
                    outputs = [r["token_ids"] for r in run["requests"]]
                    rate = sum(map(len, outputs)) / run["wall_s"]
                    results[mode, gamma, concurrency] = (rate, outputs)
    return results


def held_out(args) -> list[list[int]]:
    """The `--prompts` held-out prompts (64 tokens each) in the target's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    return heldout_prompts(tokenizer, args.prompts, 64, args.heldout)[0]


def main(argv: list[str] | None = None) -> int:
    args = pair_arguments("pipeline", __doc__, 8, 2, "results/pipeline").parse_args(argv)
    prompts = held_out(args)
    runs: dict[str, list[dict]] = {name: [] for name in STACKS}
    for repeat in range(args.repeats):
        for name in STACKS:
            settings = StackSettings(
                args.target_model,
                args.draft_model,
                port=0,
                coordinator_args=["--pipeline", name],
            )
            with Stack(settings) as stack:
                runs[name].append(measure(stack.address, prompts, args.tokens))
            rates = {k: round(v["tokens_per_s"], 1) for k, v in runs[name][-1].items()}
            print(f"repeat {repeat} --pipeline {name}: {json.dumps(rates)}", flush=True)
    lines = [
        f"# Pipelined rounds: {args.prompts} held-out prompts × {args.tokens} tokens, "
        f"concurrency 1, target and draft 1 thread each, median of {args.repeats} runs",
        "",
        "| mode | γ | tok/s off | tok/s on | on / off | drafted ahead (on) "
        "| tok/s auto | auto / off | drafted ahead (auto) | greedy outputs equal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key in runs["off"][0]:
        mode, gamma = key.split("/")
        rate = {n: statistics.median(r[key]["tokens_per_s"] for r in runs[n]) for n in STACKS}
        share = {
            n: sum(r[key]["drafted_ahead"] for r in runs[n])
            / sum(r[key]["rounds"] for r in runs[n])
            for n in STACKS
        }
        outputs = [r[key]["outputs"] for n in STACKS for r in runs[n]]
        same = "yes" if all(o == outputs[0] for o in outputs) else "no"
        label = "adaptive" if gamma == "None" else gamma
        lines.append(
            f"| {mode} | {label} | {rate['off']:.1f} | {rate['on']:.1f} | "
            f"{rate['on'] / rate['off']:.3f}× | {100 * share['on']:.0f} % | {rate['auto']:.1f} | "
            f"{rate['auto'] / rate['off']:.3f}× | {100 * share['auto']:.0f} % | "
            f"{same if mode == 'greedy' else '—'} |"
        )
    save(args.out, "pipeline", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

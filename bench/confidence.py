"""What cutting blocks short gives (coordinator --draft-confidence): the same requests through
coordinators of one stack that differ only in the threshold, alternating.

    python -m bench.confidence [--thresholds 0,0.3,0.6] [--gammas 4,6,adaptive]
                               [--prompts 6] [--tokens 96] [--repeats 3]
                               [--target-model models/target] [--draft-model models/draft]
                               [--out results/confidence]      (also: specdec bench confidence)

All coordinators share the workers and Redis (target and draft worker one thread each), so
only the threshold differs; they take turns, and each table entry is the median over the
repeats. Per (mode, γ) at concurrency 1 (`bench.pipeline.measure`: the held-out code-pair
prompts, greedy and sampling at T = 0.8, top-p 0.95, seeded): the decode rate, the ratio to
threshold 0 (whole blocks), the candidates a drafting round verified on average, and whether
the greedy outputs are identical (they must be: lossless either way).
"""

from __future__ import annotations

import json
import statistics

from bench.pipeline import gamma_list, held_out, measure, pair_arguments
from bench.report import save
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port


def main(argv: list[str] | None = None) -> int:
    p = pair_arguments("confidence", __doc__, 6, 3, "results/confidence")
    p.add_argument("--thresholds", default="0,0.3,0.6")
    p.add_argument("--gammas", default="4,6,adaptive")
    args = p.parse_args(argv)
    thresholds = [t.strip() for t in args.thresholds.split(",")]
    gammas = gamma_list(args.gammas)
    prompts = held_out(args)
    runs: dict[str, list[dict]] = {t: [] for t in thresholds}
    settings = StackSettings(args.target_model, args.draft_model, port=0)
    with Stack(settings) as stack:
        address = {}
        for t in thresholds:
            port = free_port()
            stack.add_coordinator(port, name=f"coordinator-{t}", extra=["--draft-confidence", t])
            address[t] = f"{stack.settings.host}:{port}"
        for repeat in range(args.repeats):
            for t in thresholds:
                runs[t].append(measure(address[t], prompts, args.tokens, gammas))
                rates = {k: round(v["tokens_per_s"], 1) for k, v in runs[t][-1].items()}
                print(f"repeat {repeat} --draft-confidence {t}: {json.dumps(rates)}", flush=True)
    base = thresholds[0]
    lines = [
        f"# Blocks cut short: {args.prompts} held-out prompts × {args.tokens} tokens, "
        f"concurrency 1, target and draft 1 thread each, median of {args.repeats} runs",
        "",
        "| mode | γ | "
        + " | ".join(f"tok/s at {t} | ×{base} | candidates/round" for t in thresholds)
        + " | greedy outputs equal |",
        "|---|---|" + "---:|---:|---:|" * len(thresholds) + "---|",
    ]
    for key in runs[base][0]:
        mode, gamma = key.split("/")
        rate = {t: statistics.median(r[key]["tokens_per_s"] for r in runs[t]) for t in thresholds}
        per_round = {
            t: sum(r[key]["draft_tokens"] for r in runs[t])
            / max(sum(r[key]["drafts"] for r in runs[t]), 1)
            for t in thresholds
        }
        outputs = [r[key]["outputs"] for t in thresholds for r in runs[t]]
        same = "yes" if all(o == outputs[0] for o in outputs) else "no"
        cells = " | ".join(
            f"{rate[t]:.1f} | {rate[t] / rate[base]:.3f}× | {per_round[t]:.2f}" for t in thresholds
        )
        label = "adaptive" if gamma == "None" else gamma
        lines.append(f"| {mode} | {label} | {cells} | {same if mode == 'greedy' else '—'} |")
    save(args.out, "confidence", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

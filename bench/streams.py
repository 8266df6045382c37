"""What worker call streams give: the same requests through two coordinators of one stack,
one carrying Propose and Verify on a stream per worker (`--worker-streams`, the default) and
one making unary calls (`--no-worker-streams`), alternating.

    python -m bench.streams [--prompts 6] [--tokens 96] [--repeats 3]
                            [--target-model models/target] [--draft-model models/draft]
                            [--out results/streams]              (also: specdec bench streams)

Both coordinators share the workers and Redis (target and draft worker one thread each), so
only the transport differs; they alternate streams, unary, streams, … and each table entry
is the median over the repeats. Per (mode, γ) at concurrency 1 (`bench.pipeline.measure`:
the held-out code-pair prompts, greedy and sampling at T = 0.8, top-p 0.95, seeded; γ = 2, 4
and adaptive): the decode rate and whether the greedy outputs are identical (they must be).
"""

from __future__ import annotations

import argparse
import json
import statistics

from transformers import AutoTokenizer

from bench.pipeline import measure
from bench.prompts import heldout_prompts
from bench.report import save
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench streams", description=__doc__)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-model", default="models/target")
    p.add_argument("--draft-model", default="models/draft")
    p.add_argument("--heldout", default="models/heldout_files.txt")
    p.add_argument("--out", default="results/streams")
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    prompts, _ = heldout_prompts(tokenizer, args.prompts, 64, args.heldout)
    runs: dict[str, list[dict]] = {"streams": [], "unary": []}
    with Stack(StackSettings(args.target_model, args.draft_model, port=free_port())) as stack:
        unary = free_port()
        stack.add_coordinator(unary, extra=["--no-worker-streams"])
        address = {"streams": stack.address, "unary": f"{stack.settings.host}:{unary}"}
        for repeat in range(args.repeats):
            for name, runs_of in runs.items():
                runs_of.append(measure(address[name], prompts, args.tokens))
                rates = {k: round(v["tokens_per_s"], 1) for k, v in runs_of[-1].items()}
                print(f"repeat {repeat} {name}: {json.dumps(rates)}", flush=True)
    lines = [
        f"# Worker call streams: {args.prompts} held-out prompts × {args.tokens} tokens, "
        f"concurrency 1, target and draft 1 thread each, median of {args.repeats} runs",
        "",
        "| mode | γ | tok/s unary | tok/s streams | streams / unary | greedy outputs equal |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key in runs["unary"][0]:
        mode, gamma = key.split("/")
        rate = {n: statistics.median(r[key]["tokens_per_s"] for r in runs[n]) for n in runs}
        outputs = [r[key]["outputs"] for n in runs for r in runs[n]]
        same = "yes" if all(o == outputs[0] for o in outputs) else "no"
        lines.append(
            f"| {mode} | {'adaptive' if gamma == 'None' else gamma} | {rate['unary']:.1f} | "
            f"{rate['streams']:.1f} | {rate['streams'] / rate['unary']:.3f}× | "
            f"{same if mode == 'greedy' else '—'} |"
        )
    save(args.out, "streams", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

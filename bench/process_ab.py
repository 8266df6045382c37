"""The sampling rows' processing (`specdec.core.processed.process`) of this checkout against
another revision's, in one process, taking turns.

    python -m bench.process_ab --baseline REV [--threads 1] [--rounds 12] [--out results/process_ab]
                                                              (also: specdec bench process-ab)

REV's `specdec/core/processed.py` (from git) is loaded as a module next to this checkout's;
for each vocabulary (8k, 49k, 128k, 262k) and kind of row (`llm_like`, as `bench.math` makes
them; flat: Gaussian logits, σ = 1.5, every nucleus past the window), 16 rows at T = 0.8,
top-p 0.95 are processed by each in turn, `--rounds` times; each figure is the best call (this
machine's spread between runs is larger than the differences timed). Also checked: both give
the same τ on every row, and how far their log Z differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import specdec.core.processed as current
from bench.math import llm_like
from specdec.core.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
VOCABS = (8192, 49152, 128256, 262144)
ROWS = 16
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


def revision_module(revision: str, scratch: str):
    """REV's processed.py as a module."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:specdec/core/processed.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(scratch) / "baseline_processed.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_processed", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def rows_of(kind: str, vocab: int) -> torch.Tensor:
    if kind == "llm_like":
        return llm_like(ROWS, vocab, 1).float()
    return (torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(1)) * 1.5).float()


def compare(baseline, rounds: int) -> list[dict]:
    out = []
    for vocab in VOCABS:
        for kind in ("llm_like", "flat"):
            logits = rows_of(kind, vocab)
            sides = {
                "baseline": (baseline, baseline.ProcessorParams.of([PARAMS] * ROWS)),
                "this": (current, current.ProcessorParams.of([PARAMS] * ROWS)),
            }
            best = dict.fromkeys(sides, float("inf"))
            for _ in range(rounds):
                for name, (module, params) in sides.items():
                    start = time.perf_counter()
                    module.process(logits, params)
                    best[name] = min(best[name], 1000 * (time.perf_counter() - start))
            a = sides["baseline"][0].process(logits, sides["baseline"][1])
            b = current.process(logits, sides["this"][1])
            out.append(
                {
                    "vocab": vocab,
                    "rows": kind,
                    "past_window": int((b.top_z[:, -1] >= b.tau).sum()),
                    "baseline_ms": best["baseline"],
                    "this_ms": best["this"],
                    "ratio": best["this"] / best["baseline"],
                    "tau_equal": bool(torch.equal(a.tau, b.tau)),
                    "max_log_z_difference": float((a.log_z - b.log_z).abs().max()),
                }
            )
    return out


def markdown(rows: list[dict], baseline: str, threads: int) -> str:
    lines = [
        f"`process` of {ROWS} rows (T = 0.8, top-p 0.95), {threads} thread(s), best call; "
        f"{baseline} against this checkout.",
        "",
        "| vocab | rows | past the window | baseline ms | this ms | this / baseline "
        "| τ equal | max abs log Z difference |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']:,} | {r['rows']} | {r['past_window']} | {r['baseline_ms']:.2f} "
            f"| {r['this_ms']:.2f} | {r['ratio']:.2f}× | {'yes' if r['tau_equal'] else 'NO'} "
            f"| {r['max_log_z_difference']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench process-ab", description=__doc__)
    p.add_argument("--baseline", required=True, help="git revision to compare with")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", default="results/process_ab")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        rows = compare(revision_module(args.baseline, scratch), args.rounds)
    table = markdown(rows, args.baseline, args.threads)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "process_ab.json").write_text(json.dumps(rows, indent=2))
    (out / "process_ab.md").write_text(table + "\n")
    return 0 if all(r["tau_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

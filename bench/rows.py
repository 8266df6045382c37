"""One result row per contender × mode × concurrency, its progress line, and the greedy
check of every contender's outputs against HF's target-only greedy output."""

from __future__ import annotations

from bench import metrics
from bench.contenders import LABELS


def progress_line(i: int, total: int, row: dict, seconds: float) -> str:
    acc = row.get("acceptance_rate")
    return (
        f"[{i:>2}/{total}] {LABELS[row['contender']]:<26} {row['mode']:<8} conc {row['concurrency']:>2}  "
        f"{row['tokens_per_s']:7.1f} tok/s  {row['tokens_per_s_per_request']:6.1f}/req  "
        f"TPOT p50 {row['tpot_ms_p50']:6.1f} ms  TTFT p50 {row['ttft_ms_p50']:7.1f} ms  "
        f"accept {'  n/a' if acc is None else f'{acc:.2f}'}  ({seconds:.0f} s, "
        f"other processes {other_cpu(row)})"
    )


def other_cpu(row: dict) -> str:
    share = row.get("other_cpu")
    text = "n/a" if share is None else f"{100 * share:.0f}% CPU"
    return text + (f", {row['repeats']} repeated" if row.get("repeats") else "")


def strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "token_ids"} for r in records]


def greedy_check(reference: list[dict], records: list[dict]) -> dict:
    """How many greedy outputs equal HF's target-only greedy output, token for token."""
    first_diff = []
    for ref, rec in zip(reference, records):
        a, b = ref["token_ids"], rec["token_ids"]
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        first_diff.append(diff)
    return {
        "identical": sum(d is None for d in first_diff),
        "requests": len(first_diff),
        "first_difference": first_diff,
    }


def key(row: dict) -> dict:
    return {k: row[k] for k in ("contender", "mode", "concurrency")}


def make_row(
    contender: str, mode: str, concurrency: int, records: list[dict], wall_s: float
) -> dict:
    return {
        "contender": contender,
        "label": LABELS[contender],
        "mode": mode,
        "concurrency": concurrency,
        "service": "sequential (batch size 1)" if contender.startswith("hf_") else "concurrent",
        **metrics.timing(records, wall_s),
    }

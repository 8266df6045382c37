"""The chaos benchmark's verdict and report (`bench.chaos`): each session under faults against
its fault-free run, token for token; greedy divergences explained by the target's own
logits (a float near-tie, or not); time per output token; the markdown table."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.chaos import Outcome, Request


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(refs: list[dict[int, Outcome]], waves: list[dict[int, Outcome]], reqs) -> dict:
    """Each wave's sessions against the fault-free runs.

    Lost and repeated tokens are counted from what the streams carried: chunk offsets that
    skipped or overlapped what the client had, and sessions that ended short of their length.
    A session that is whole but *differs* from both fault-free runs diverged: for a greedy
    one that is a failure; a sampled one can also diverge without any fault, when batching
    flips the last bits of a logit at a near-tie (a documented limit of lossless), so its
    count is compared with how often the fault-free runs diverge from each other."""
    exact = short = unfinished = overlaps = gaps = 0
    diverged = {"greedy": 0, "sampled": 0}
    mismatches = []
    for wave, got in enumerate(waves):
        for i in refs[0]:
            g, req = got[i], reqs[i]
            overlaps += g.repeated
            gaps += g.gaps
            if not g.finished:
                unfinished += 1
                why = g.finish_reason or g.error
                mismatches.append({"wave": wave, "request": i, "unfinished": why})
                continue
            short += max(0, req.max_new_tokens - len(g.tokens))
            if any(g.tokens == ref[i].tokens for ref in refs):
                exact += 1
                continue
            diverged["greedy" if req.temperature == 0 else "sampled"] += 1
            closest = max((ref[i].tokens for ref in refs), key=lambda t: common_prefix(t, g.tokens))
            at = common_prefix(closest, g.tokens)
            mismatches.append(
                {
                    "wave": wave,
                    "request": i,
                    "temperature": req.temperature,
                    "at": at,
                    "target_only_rounds": g.target_only_rounds,
                    "resumes": g.resumes,
                    "prefix": closest[:at],
                    "tokens": [closest[at], g.tokens[at]] if at < len(g.tokens) else [],
                }
            )
    sessions = len(refs[0]) * len(waves)
    return {
        "sessions": sessions,
        "finished": sessions - unfinished,
        "exact": exact,
        "tokens_lost": gaps + short,
        "tokens_repeated": overlaps,
        "diverged": diverged,
        "mismatches": mismatches[:200],
    }


# A greedy divergence is a float near-tie when the two tokens are the target's top two with a
# logit gap below this (float32 prefill-vs-step and batch differences are ~1e-5 here); a wrong
# token from a bug would not be the runner-up at such a margin.
NEAR_TIE = 1e-3


def explain_greedy(model_dir: str, reqs: list[Request], mismatches: list[dict]) -> list[dict]:
    """For each greedy divergence: the target's own top-two logit gap at that position (Hugging
    Face, batch 1, float32, the whole prefix at once) and whether the two tokens are those two."""
    greedy = [m for m in mismatches if m.get("temperature") == 0.0 and m.get("tokens")]
    if not greedy:
        return []
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    found = []
    with torch.no_grad():
        for m in greedy:
            ids = reqs[m["request"]].prompt_ids + m["prefix"]
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            gap = float(top.values[0] - top.values[1])
            found.append(
                {
                    "request": m["request"],
                    "wave": m["wave"],
                    "at": m["at"],
                    "logit_gap": gap,
                    "top_two": sorted(top.indices.tolist()) == sorted(m["tokens"]),
                    "near_tie": gap < NEAR_TIE
                    and sorted(top.indices.tolist()) == sorted(m["tokens"]),
                }
            )
    return found


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def tpot_ms(outcomes: list[Outcome]) -> dict:
    values = [t for o in outcomes if (t := o.tpot()) is not None]
    return {"p50": 1000 * percentile(values, 0.5), "p99": 1000 * percentile(values, 0.99)}


def ties(part: dict) -> str:
    found = part.get("greedy_divergences", [])
    gaps = ", ".join(f"{d['logit_gap']:.1e}" for d in found)
    return f"{sum(d['near_tie'] for d in found)}" + (f"; gaps {gaps}" if gaps else "")


def markdown(report: dict) -> str:
    r = report
    lines = [
        f"- Command: `{r['command']}` ({r['seconds']:.0f} s in all)",
        f"- Stack: redis-server (append-only file), {r['stack']}; models `{r['models']}`; "
        f"every worker 1 thread",
        f"- Requests: {r['sessions']} sessions ({r['concurrency']} at a time; under faults "
        f"{r['waves']} passes over them with new session ids while the faults lasted), "
        f"{r['max_new_tokens']} new tokens each, half greedy and half seeded sampling "
        f"(T 0.8), γ 2–4 fixed per session",
        "",
        "| | fault-free (2nd pass against the 1st) | under faults (against either) |",
        "|---|---:|---:|",
        f"| sessions finished | {r['reference']['finished']} / {r['reference']['sessions']} "
        f"| {r['chaos']['finished']} / {r['chaos']['sessions']} |",
        f"| tokens lost (skipped offsets, short sessions) | {r['reference']['tokens_lost']} "
        f"| {r['chaos']['tokens_lost']} |",
        f"| tokens repeated (overlapping offsets) | {r['reference']['tokens_repeated']} "
        f"| {r['chaos']['tokens_repeated']} |",
        f"| sessions equal to a fault-free run | {r['reference']['exact']} "
        f"| {r['chaos']['exact']} |",
        f"| greedy sessions that diverged (of them at a near-tie: top-two logit gap "
        f"< {NEAR_TIE:g}) | {r['reference']['diverged']['greedy']} ({ties(r['reference'])}) "
        f"| {r['chaos']['diverged']['greedy']} ({ties(r['chaos'])}) |",
        f"| sampled sessions that diverged (bound under faults: "
        f"{divergence_bound(r):.1f}) | {r['reference']['diverged']['sampled']} "
        f"| {r['chaos']['diverged']['sampled']} |",
        f"| resumes | {r['reference']['resumes']} | {r['chaos']['resumes']} |",
        f"| errors seen by clients (status: count) | {r['reference']['errors'] or '—'} "
        f"| {r['chaos']['errors'] or '—'} |",
        f"| time per output token p50 / p99, ms | {r['reference']['tpot_ms']['p50']:.1f} / "
        f"{r['reference']['tpot_ms']['p99']:.1f} | {r['chaos']['tpot_ms']['p50']:.1f} / "
        f"{r['chaos']['tpot_ms']['p99']:.1f} |",
        "",
        "Faults injected: "
        + ", ".join(f"{k} × {v}" for k, v in sorted(r["faults"].items()))
        + f" ({sum(r['faults'].values())} of {r['faults_planned']} planned).",
    ]
    return "\n".join(lines)


def divergence_bound(report: dict) -> float:
    """How many sampled sessions may diverge under faults: three times the fault-free
    runs' own rate (they diverge from each other by batching alone; estimated as
    (d + 1) / (n + 1), so a short run's zero is not taken for certain), plus three."""
    ref, chaos = report["reference"], report["chaos"]
    rate = (ref["diverged"]["sampled"] + 1) / (ref["sessions"] + 1)
    return 3 * rate * chaos["sessions"] + 3


def passed(report: dict) -> bool:
    """Every session finished whole (no token lost or repeated), a greedy session diverged
    only at a float near-tie of the target's own logits, sampled ones no more often than
    batching alone explains, and every planned fault ran."""
    chaos = report["chaos"]
    return (
        chaos["finished"] == chaos["sessions"]
        and chaos["tokens_lost"] == chaos["tokens_repeated"] == 0
        and len(chaos.get("greedy_divergences", [])) == chaos["diverged"]["greedy"]
        and all(d["near_tie"] for d in chaos.get("greedy_divergences", []))
        and chaos["diverged"]["sampled"] <= divergence_bound(report)
        and report["faults_planned"] == sum(report["faults"].values())
        and not report["injector_failure"]
    )

"""Speedups, performance-model bounds and goals from a run's rows; JSON, Markdown and plots."""

from __future__ import annotations

import json
from pathlib import Path

from bench import metrics

SPECULATING = ("specdec_g2", "specdec_g4", "specdec_g6", "specdec_adaptive")
ORDER = ("hf_target", "hf_assisted", "specdec_off", "specdec_off_all_threads", *SPECULATING)
FIXED_GAMMA = {"specdec_off": 0, "specdec_g2": 2, "specdec_g4": 4, "specdec_g6": 6}


def find(rows: list[dict], contender: str, mode: str, concurrency: int) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["contender"] == contender and r["mode"] == mode and r["concurrency"] == concurrency
        ),
        None,
    )


def bound_for(row: dict, costs: dict) -> dict:
    """Model bound (ρ = 0) for a specdec row, its measured decode rate, and the implied ρ.
    A fixed γ is its own; the adaptive policy's bound is over the γ mix of its rounds
    (`metrics.gamma_mix`), with the bound at its mean γ alongside (the earlier approximation)."""
    acc = row["acceptance"]
    fixed = FIXED_GAMMA.get(row["contender"])
    mix = {fixed: 1.0} if fixed is not None else metrics.gamma_mix(acc)
    alpha = acc["alpha"] or 0.0
    bound = metrics.model_bound(alpha, mix, costs)
    measured = row["decode_tokens_per_s_per_request"]
    step_s = costs["target_step_ms"] / 1000.0
    measured_speedup = measured * step_s
    # ρ that makes the model match: S = E / (cost + ρ)
    implied_rho = (
        bound["expected_tokens_per_round"] / measured_speedup - bound["cost_steps_per_round"]
    )
    gamma = bound["gamma"]
    at_mean = metrics.model_bound(alpha, gamma, costs)
    # the same moment's passes: the requests' own pass times against the bound's cost of a round
    passes = row.get("passes") or {}
    inprocess_ms = bound["cost_steps_per_round"] * costs["target_step_ms"]
    stack_ms = passes.get("pass_ms_per_round")
    return {
        **key(row),
        "alpha": alpha,
        "gamma": gamma,
        "gamma_mix": {str(g): p for g, p in sorted(mix.items())},
        "expected_tokens_per_round": bound["expected_tokens_per_round"],
        "c": costs["c"],
        "v": bound["cost_steps_per_round"] - costs["c"] * gamma,  # the mix's mean v(γ)
        "bound_speedup": bound["speedup"],
        "bound_tokens_per_s": bound["tokens_per_s"],
        "measured_decode_tokens_per_s": measured,
        "measured_over_bound": measured / bound["tokens_per_s"],
        "implied_rho": implied_rho,
        "implied_overhead_ms_per_round": implied_rho * costs["target_step_ms"],
        "bound_tokens_per_s_at_mean_gamma": at_mean["tokens_per_s"],
        "measured_over_bound_at_mean_gamma": measured / at_mean["tokens_per_s"],
        "inprocess_pass_ms_per_round": inprocess_ms,
        "stack_pass_ms_per_round": stack_ms,
        "stack_round_ms": passes.get("round_ms"),
        "stack_passes_over_inprocess": stack_ms / inprocess_ms if stack_ms else None,
        "in_passes": passes.get("in_passes"),
        "decode_only": passes.get("decode_only"),
    }


def batch_bound_for(row: dict, batch: dict, n: int) -> dict:
    """The bound (no network, no coordination, no verify math) of a specdec row with n
    sessions in flight, from the in-process passes at batch n (`bench.inproc`, "batch_costs"):
    the sessions in lock-step, each round one draft step of n sessions per candidate, then
    one target pass of n × (γ + 1) positions, so n·E(α̂, γ) tokens per round; speculation off
    is one pass of n × 1 a token. γ: the row's, or the adaptive policy's mix of rounds
    (`metrics.gamma_mix`: tokens and time averaged over it; a mean γ alone takes the pass time
    interpolated between whole γ)."""
    acc = row.get("acceptance") or {}
    fixed = FIXED_GAMMA.get(row["contender"])
    mix = {fixed: 1.0} if fixed is not None else metrics.gamma_mix(acc)
    alpha = acc.get("alpha") or 0.0
    passes = {int(k) - 1: ms for k, ms in batch["pass_ms"].items()}  # by γ
    off_ms = passes[0]

    def pass_at(gamma: float) -> float:
        low = min(int(gamma), max(passes) - 1)
        return passes[low] + (passes[low + 1] - passes[low]) * (gamma - low)

    pass_ms = sum(p * pass_at(g) for g, p in mix.items())
    gamma = sum(p * g for g, p in mix.items())
    draft_ms = gamma * batch["draft_step_ms"]
    tokens = sum(p * metrics.round_tokens(alpha, g) for g, p in mix.items())
    bound = n * tokens / ((pass_ms + draft_ms) / 1000.0)
    off_bound = n / (off_ms / 1000.0)
    # the passes the stack's sessions were in, by their own stats (each counts its batch's)
    stack_ms = (row.get("passes") or {}).get("pass_ms_per_round")
    return {
        **key(row),
        "sessions": n,
        "alpha": alpha,
        "gamma": gamma,
        "expected_tokens_per_round": tokens,
        "pass_ms": pass_ms,
        "draft_ms": draft_ms,
        "bound_tokens_per_s": bound,
        "bound_over_off_bound": bound / off_bound,
        "measured_tokens_per_s": row["tokens_per_s"],
        "measured_over_bound": row["tokens_per_s"] / bound,
        "stack_pass_ms": stack_ms,
        "stack_passes_over_inprocess": stack_ms / (pass_ms + draft_ms) if stack_ms else None,
    }


def key(row: dict) -> dict:
    return {k: row[k] for k in ("contender", "mode", "concurrency")}


def pooled_per_position(rows: list[dict], contender: str, mode: str) -> list[float]:
    """Acceptance per position over every concurrency of one contender and mode."""
    total_rounds, sums = 0, []
    for r in rows:
        if r["contender"] != contender or r["mode"] != mode or "acceptance" not in r:
            continue
        rounds = r["acceptance"]["rounds"]
        total_rounds += rounds
        for i, rate in enumerate(r["acceptance"]["accepted_per_position"]):
            sums += [0.0] * (i + 1 - len(sums))
            sums[i] += rate * rounds
    return [s / total_rounds for s in sums] if total_rounds else []


def goals(
    rows: list[dict], bounds: list[dict], concurrency: list[int], batch_bounds=()
) -> list[dict]:
    """The performance goals (issue 16's, docs/benchmarks.md "Goals"), each measured in this
    run: {goal, value, met}; the load goal also says how much the bound under load allows.
    A goal between two of the stack's rows also has `per_repeat`: the same ratio in each
    repeat (the contenders' i-th runs, measured side by side in repeat i), so that a reader
    sees whether a miss held in every repeat or lies within the run's spread; `met` stays the
    median rows'."""
    out = []

    def ratio(a, b):
        return a["tokens_per_s"] / b["tokens_per_s"] if a and b else float("nan")

    def add(goal: str, value: float, need: float, per_repeat=None) -> None:
        out.append({"goal": goal, "value": value, "met": value >= need})
        if per_repeat:
            out[-1]["per_repeat"] = per_repeat

    def ratios(pairs) -> list[float] | None:
        """Per repeat, the smallest ratio of the (a, b) row pairs' runs; None for a run of
        one repeat, or where a row has no runs or the rows' repeats differ in number."""
        runs = [(a.get("runs") or [], b.get("runs") or []) for a, b in pairs if a and b]
        counts = {len(x) for pair in runs for x in pair}
        if not runs or len(counts) != 1 or min(counts) < 2:
            return None
        return [min(x[i] / y[i] for x, y in runs) for i in range(counts.pop())]

    for mode, need in (("greedy", 1.25), ("sampling", 1.1)):
        got = ratio(find(rows, "specdec_adaptive", mode, 1), find(rows, "hf_assisted", mode, 1))
        add(f"conc 1 {mode}: adaptive ≥ {need}× HF assisted", got, need)
    for mode in ("greedy", "sampling"):
        # the serving overhead: speculation off with the target on HF's threads, where measured
        off = find(rows, "specdec_off_all_threads", mode, 1)
        named = "speculation off (target on HF's threads)" if off else "speculation off"
        got = ratio(off or find(rows, "specdec_off", mode, 1), find(rows, "hf_target", mode, 1))
        add(f"conc 1 {mode}: {named} ≥ 0.95× HF generate", got, 0.95)
    for b in bounds:
        if b["contender"] == "specdec_adaptive":
            add(
                f"conc 1 {b['mode']}: adaptive ≥ 90% of the model bound",
                b["measured_over_bound"],
                0.9,
            )
    top = max(concurrency)
    for mode in ("greedy", "sampling"):
        adaptive = find(rows, "specdec_adaptive", mode, top)
        add(
            f"conc {top} {mode}: adaptive ≥ 3× HF assisted (aggregate)",
            ratio(adaptive, find(rows, "hf_assisted", mode, top)),
            3.0,
        )
        ceiling = max(
            (
                b["bound_over_off_bound"]
                for b in batch_bounds
                if b["mode"] == mode and b["concurrency"] == top
            ),
            default=None,
        )
        allows = "" if ceiling is None else f" (the bound under load allows {ceiling:.2f}×)"
        off = find(rows, "specdec_off", mode, top)
        add(
            f"conc {top} {mode}: adaptive ≥ 1.3× speculation off{allows}",
            ratio(adaptive, off),
            1.3,
            ratios([(adaptive, off)]),
        )
    for mode in ("greedy", "sampling"):
        for c in concurrency:
            adaptive = find(rows, "specdec_adaptive", mode, c)
            fixed = [r for r in (find(rows, name, mode, c) for name in FIXED_GAMMA) if r]
            best = max(fixed, key=lambda r: r["tokens_per_s"], default=None)
            add(
                f"conc {c} {mode}: adaptive within 5% of the best fixed γ",
                ratio(adaptive, best),
                0.95,
                ratios([(adaptive, best)]),
            )
    pairs = [
        (find(rows, "specdec_adaptive", mode, c), find(rows, "specdec_off", mode, c))
        for mode in ("greedy", "sampling")
        for c in concurrency
    ]
    worst = min((ratio(a, b) for a, b in pairs), default=float("nan"))
    add("adaptive never below speculation off (any mode, any conc)", worst, 1.0, ratios(pairs))
    return out


def with_stack_rounds(rounds: list[dict], rows: list[dict]) -> list[dict]:
    """Add the stack's own round time (greedy, concurrency 1) and the coordinator's share."""
    names = {0: "specdec_off", 2: "specdec_g2", 4: "specdec_g4", 6: "specdec_g6"}
    for r in rounds:
        row = find(rows, names.get(r["gamma"], ""), "greedy", 1)
        if row is None or not row["decode_tokens_per_s_per_request"] or r["round_ms"] is None:
            continue
        per_round = row.get("mean_acceptance_length") or 1.0
        r["stack_round_ms"] = 1000.0 * per_round / row["decode_tokens_per_s_per_request"]
        r["coordinator_ms"] = r["stack_round_ms"] - r["round_ms"]
    return rounds


def analyse(meta: dict, costs: dict, rows: list[dict], checks: dict, rounds: list[dict]) -> dict:
    for row in rows:
        for peer in ("hf_target", "hf_assisted"):
            ref = find(rows, peer, row["mode"], row["concurrency"])
            row[f"speedup_vs_{peer}"] = row["tokens_per_s"] / ref["tokens_per_s"] if ref else None
    rows.sort(key=lambda r: (r["mode"] != "greedy", r["concurrency"], ORDER.index(r["contender"])))
    # the bounds' in-process costs are at the speculating stack's threads: its rows only
    bounded = {*FIXED_GAMMA, "specdec_adaptive"}
    bounds = [
        bound_for(r, costs) for r in rows if r["concurrency"] == 1 and r["contender"] in bounded
    ]
    batch = costs.get("batch", {})
    in_flight = batch.get("in_flight", {})
    batch_bounds = [
        batch_bound_for(r, batch["batches"][str(n)], n)
        for r in rows
        if r["contender"] in bounded and (n := in_flight.get(str(r["concurrency"]), 1)) > 1
    ]
    per_position = {
        f"{name}/{mode}": pooled_per_position(rows, name, mode)
        for name in SPECULATING
        for mode in ("greedy", "sampling")
    }
    return {
        "meta": meta,
        "costs": costs,
        "rows": rows,
        "bounds": bounds,
        "batch_bounds": batch_bounds,
        "acceptance_per_position_pooled": per_position,
        "greedy_checks": checks,
        "round_breakdown": with_stack_rounds(rounds, rows),
        "goals": goals(rows, bounds, meta["concurrency"], batch_bounds),
    }


def markdown(result: dict) -> str:
    from bench.tables import render

    return render(result)


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, conc = result["rows"], result["meta"]["concurrency"]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mode in zip(axes, ("greedy", "sampling")):
        for name in ORDER:
            if not any(r["contender"] == name for r in rows):
                continue  # e.g. the all-threads speculation off, not run at every split
            ys = [find(rows, name, mode, c) for c in conc]
            ys = [r["tokens_per_s"] if r else float("nan") for r in ys]
            style = "--" if name.startswith("hf_") else "-o"
            ax.plot(
                conc,
                ys,
                style,
                label=next(r["label"] for r in rows if r["contender"] == name),
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrent requests")
        ax.set_title(f"{mode}: aggregate tokens/s (HF peers: sequential service)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("generated tokens / s")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    paths.append(out / "tokens_per_s_vs_concurrency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    pooled = result["acceptance_per_position_pooled"]
    for ax, mode in zip(axes, ("greedy", "sampling")):
        for name in SPECULATING:
            rates = pooled.get(f"{name}/{mode}", [])
            if rates:
                label = next(r["label"] for r in rows if r["contender"] == name)
                ax.plot(range(1, len(rates) + 1), rates, "-o", label=label)
        ax.set_xlabel("candidate position")
        ax.set_title(f"{mode}: rounds accepting candidate i / all rounds", fontsize=10)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance per position")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(result: dict, out: Path) -> list[Path]:
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(result, indent=1, default=float) + "\n")
    md_path.write_text(markdown(result))
    return [json_path, md_path, *plots(result, out)]


def save(out: str | Path, name: str, report: str, data: dict) -> None:
    """Print a bench's markdown report and write it with its raw data under `out`
    (`name`.md, `name`.json)."""
    print(report)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(report + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))

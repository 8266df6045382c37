"""The Markdown report of one benchmark run (results.md)."""

from __future__ import annotations

import math


def fmt(x, digits: int = 1, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}{suffix}"


def share(row: dict) -> float | None:
    x = row.get("other_cpu")
    return None if x is None else 100.0 * x


def repeats(row: dict) -> str:
    return f" ({row['repeats']})" if row.get("repeats") else ""


def per_position(rates: list[float]) -> str:
    return " ".join(f"{r:.2f}".lstrip("0") for r in rates) if rates else "n/a"


# what the costs job ran before it ran the workers' own passes (results without "forward")
OLD_COSTS_FORWARD = "HF's forward with the workers' linear kernel"


def label_of(result: dict, contender: str) -> str:
    """A contender's label, as its rows have it."""
    return next(r["label"] for r in result["rows"] if r["contender"] == contender)


def cost_threads(costs: dict) -> str:
    """How many threads the in-process costs ran at (older results: one number)."""
    threads = costs.get("threads", 1)
    if isinstance(threads, dict):
        return f"target {threads['target']} thread(s), draft {threads['draft']}"
    return f"{threads} thread(s)"


def header(result: dict) -> list[str]:
    meta, costs = result["meta"], result["costs"]
    threads = meta["threads"]
    prompts = meta["prompts"]
    v = ", ".join(f"v({g})={x:.2f}" for g, x in costs["v"].items())
    device = meta["machine"].get("device", "cpu")
    on_cpu = device == "cpu"
    return [
        f"# specdec benchmark{' (--quick)' if meta['quick'] else ''}, {meta['date_utc']}",
        "",
        f"- Command: `{meta['command']}` ({meta['duration_s'] / 60:.1f} min)",
        f"- Machine: {meta['machine']['cpus']} CPU cores, {'no GPU' if on_cpu else f'models on {device}'} "
        f"({meta['machine']['platform']}), "
        f"Python {meta['machine']['python']}",
        f"- Threads: HF peers {threads['hf_peers']} torch threads in one process; specdec target worker "
        f"{threads['stack_target_worker']} + draft worker {threads['stack_draft_worker']}, "
        f"coordinator --pipeline {threads.get('stack_pipeline', 'auto')}, on the same "
        f"{meta['machine']['cpus']} cores. The coordinator, Redis "
        "and the benchmark client share the same cores and are not counted.",
        f"- Models: target `{meta['target_model']}`, draft `{meta['draft_model']}` "
        f"({meta['machine'].get('dtype', 'float32')}, {'CPU' if on_cpu else device})",
        f"- Prompts: {prompts['count']} held-out "
        + (
            "chat questions rendered with the target's chat template"
            if prompts.get("chat_template")
            else f"prompts of {prompts['prompt_tokens']} tokens"
        )
        + f" (from {prompts['source']}); {meta['max_new_tokens']} new tokens each, EOS ignored, "
        "so every contender generates the same number of tokens.",
        "- Sampling: greedy; and temperature 0.8, top-p 0.95 (top-k off). "
        "HF assisted generation uses HF's default assistant settings "
        f"({meta['hf_assistant_defaults']}).",
        f"- Per-token costs in-process ({cost_threads(costs)}, "
        f"{costs.get('forward', OLD_COSTS_FORWARD)}, KV cache of "
        f"{costs['context_tokens']} tokens): "
        f"target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.2f} ms, "
        f"c = {costs['c']:.3f}; {v}. Other processes used {fmt(share(costs), 0, '%')} of the "
        "machine meanwhile.",
        "- Other processes' CPU (last column): the share of all cores used by processes outside "
        "this benchmark while that configuration ran (for the HF peers: over their whole "
        "subprocess). The machine is shared; well above 0% means the row was disturbed. A "
        f"measurement (an HF request, a specdec configuration) during which others took more "
        f"than {100 * result['meta'].get('disturbance', {}).get('max_other_cpu', 1.0):.0f}% was "
        f"repeated up to {result['meta'].get('disturbance', {}).get('retries', 0)} times and the "
        "least disturbed attempt kept; the number of repeats is in parentheses.",
        *runs_line(meta),
        "",
    ]


def runs_line(meta: dict) -> list[str]:
    n = meta.get("repeats", 1)
    if n <= 1:
        return []
    return [
        f"- Runs: every contender measured {n} times (the stack's contenders in alternating "
        "order, the HF peers in a fresh subprocess each time); each row is its median run by "
        'aggregate tokens/s, every run\'s tokens/s under "Runs" below.'
    ]


def runs_table(result: dict) -> list[str]:
    """Every run's aggregate tokens/s per row (`--repeats` > 1), in the order measured."""
    rows = [r for r in result["rows"] if len(r.get("runs", [])) > 1]
    if not rows:
        return []
    lines = [
        "## Runs",
        "",
        "| mode | conc | contender | median | runs (tok/s) |",
        "|---|---:|---|---:|---|",
    ]
    for r in rows:
        listed = ", ".join(f"{x:.1f}" for x in r["runs"])
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['label']} | {fmt(r['tokens_per_s'])} | {listed} |"
        )
    return lines + [""]


def results_table(result: dict) -> list[str]:
    lines = [
        "## Results",
        "",
        "The HF peers generate one request at a time (batch size 1): at concurrency C their "
        "requests queue, so aggregate throughput is their sequential throughput, and TTFT and "
        "per-request tokens/s include the queueing delay computed from the measured service "
        "times (sequential service). Speedups are ratios of aggregate tokens/s measured in this "
        "run at the same mode and concurrency. For HF assisted generation the mean acceptance "
        "length is tokens per target forward; its acceptance rate is not exposed by HF (n/a).",
        "",
        "| mode | conc | contender | tok/s aggregate | tok/s per request | TPOT p50 ms | TPOT p95 ms "
        "| TTFT p50 ms | TTFT p95 ms | acceptance rate | mean acceptance length | acceptance per position "
        "| × HF target | × HF assisted | other processes' CPU (repeats) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        rates = r.get("acceptance", {}).get("accepted_per_position", [])
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['label']} | {fmt(r['tokens_per_s'])} "
            f"| {fmt(r['tokens_per_s_per_request'])} | {fmt(r['tpot_ms_p50'])} | {fmt(r['tpot_ms_p95'])} "
            f"| {fmt(r['ttft_ms_p50'], 0)} | {fmt(r['ttft_ms_p95'], 0)} | {fmt(r.get('acceptance_rate'), 2)} "
            f"| {fmt(r.get('mean_acceptance_length'), 2)} | {per_position(rates)} "
            f"| {fmt(r['speedup_vs_hf_target'], 2, '×')} | {fmt(r['speedup_vs_hf_assisted'], 2, '×')} "
            f"| {fmt(share(r), 0, '%')}{repeats(r)} |"
        )
    return lines + [""]


def bounds_table(result: dict) -> list[str]:
    costs = result["costs"]
    lines = [
        "## Performance-model bound (concurrency 1)",
        "",
        "Synchronous model (the coordinator drafts, then verifies): S = E / (γ·c + v(γ) + ρ) with "
        "E = (1 − α̂^(γ+1)) / (1 − α̂). The bound takes ρ = 0 (no network or coordination), α̂ "
        "measured in this run, c and v(γ) from the workers' own passes measured in-process; bound tokens/s = S / target step "
        f"({costs['target_step_ms']:.2f} ms). Measured = decode tokens/s per request (1 / mean TPOT). "
        "Implied ρ = the per-round overhead (in target steps, and in ms) that makes the model match "
        "the measurement. For the adaptive policy, whose rounds run different γ, E and the "
        "round's cost (γ·c + v) are averaged over its rounds' γ mix (`rounds_per_gamma`; γ and v "
        "below are the mix's means); the bound as if every round ran the mean γ follows the table.",
        "",
        "| mode | contender | α̂ | γ | E | v(γ) | bound speedup | bound tok/s | measured tok/s "
        "| measured / bound | implied ρ | overhead ms / round |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in result["bounds"]:
        label = label_of(result, b["contender"])
        lines.append(
            f"| {b['mode']} | {label} | {fmt(b['alpha'], 3)} | {fmt(float(b['gamma']), 2)} "
            f"| {fmt(b['expected_tokens_per_round'], 2)} | {fmt(b['v'], 2)} | {fmt(b['bound_speedup'], 2, '×')} "
            f"| {fmt(b['bound_tokens_per_s'])} | {fmt(b['measured_decode_tokens_per_s'])} "
            f"| {fmt(100 * b['measured_over_bound'], 0, '%')} | {fmt(b['implied_rho'], 2)} "
            f"| {fmt(b['implied_overhead_ms_per_round'], 1)} |"
        )
    for b in result["bounds"]:
        mix = b.get("gamma_mix") or {}
        if len(mix) > 1:
            shares = ", ".join(f"γ {g}: {100 * p:.0f} %" for g, p in mix.items())
            lines += [
                "",
                f"{b['mode']}, adaptive: rounds at {shares}. At its mean γ for every round the "
                f"bound would be {fmt(b['bound_tokens_per_s_at_mean_gamma'])} tok/s (measured "
                f"/ bound {fmt(100 * b['measured_over_bound_at_mean_gamma'], 0, '%')}).",
            ]
    return lines + [""]


def passes_table(result: dict) -> list[str]:
    """The bounded rows' time split by the requests' own stats (`bench.metrics.passes`): the
    same moment as each measurement, so host drift between the in-process costs and the stack
    shows as passes slower than in-process, and the rest is what the stack adds."""
    bounds = [b for b in result["bounds"] if b.get("stack_pass_ms_per_round")]
    if not bounds:
        return []
    lines = [
        "## Where the bounded rows' time went (concurrency 1, the requests' own stats)",
        "",
        "Per decode round of the row's median run (its requests one after another, after "
        "each one's first token; `bench.metrics.passes`): stack round = the requests' time / "
        "rounds; in the workers' passes = their own draft and target pass times "
        "(`draft_forward_ms` + `verify_forward_ms` of GenerationStats, less "
        "`first_token_forward_ms`; verify math included); in-process = the bound's cost of the "
        "same round (γ·c + v(γ) target steps, the mix's mean for the adaptive rows). In passes "
        "= the share of the decode the workers spent in passes: the stack's share of the bound "
        "its own passes allow, measured in the same moment (no host drift between the two). "
        "Passes / in-process > 1: the passes ran slower in the stack than in-process (the "
        "other processes on the cores, the host's speed then). Rows recorded before the "
        "first-token split count the whole requests (marked *).",
        "",
        "| mode | contender | stack round ms | in the workers' passes ms | in-process ms "
        "| passes / in-process | outside passes ms | in passes | measured / bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in bounds:
        label = label_of(result, b["contender"])
        outside = b["stack_round_ms"] - b["stack_pass_ms_per_round"]
        lines.append(
            f"| {b['mode']} | {label}{'' if b['decode_only'] else ' *'} "
            f"| {fmt(b['stack_round_ms'], 2)} "
            f"| {fmt(b['stack_pass_ms_per_round'], 2)} | {fmt(b['inprocess_pass_ms_per_round'], 2)} "
            f"| {fmt(b['stack_passes_over_inprocess'], 2, '×')} | {fmt(outside, 2)} "
            f"| {fmt(100 * b['in_passes'], 0, '%')} | {fmt(100 * b['measured_over_bound'], 0, '%')} |"
        )
    return lines + [""]


def batch_bounds_table(result: dict) -> list[str]:
    """The bound at each concurrency > 1 (`bench.report.batch_bound_for`), if measured."""
    bounds = result.get("batch_bounds") or []
    if not bounds:
        return []
    lines = [
        "## Performance-model bound under load (concurrency > 1)",
        "",
        "N sessions in flight in lock-step, from in-process passes as the workers run them (their threads): a "
        "round is γ draft steps of N sessions, then one target pass of N × (γ + 1) positions, "
        "and commits N·E(α̂, γ) tokens; speculation off is one pass of N × 1 a token. No "
        "network, coordination or verify math. α̂ measured in this run; for the adaptive policy "
        "tokens and time are averaged over its rounds' γ mix (γ, pass and draft ms below are the "
        "mix's means). bound / off = the most this γ can gain over speculation off "
        "on these workers; measured = aggregate tokens/s. Stack passes = the draft and target "
        "passes a session's decode round was in, by the requests' own stats (mean over "
        "session-rounds, each counting its whole batched pass), against the in-process target "
        "pass + draft ms: how much slower the same passes ran among the stack's other "
        "processes.",
        "",
        "| mode | contender | N | α̂ | γ | E | target pass ms | draft ms | bound tok/s "
        "| bound / off | measured tok/s | measured / bound | stack passes ms | stack / in-process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in bounds:
        label = label_of(result, b["contender"])
        lines.append(
            f"| {b['mode']} | {label} | {b['sessions']} | {fmt(b['alpha'], 3)} "
            f"| {fmt(float(b['gamma']), 2)} | {fmt(b['expected_tokens_per_round'], 2)} "
            f"| {fmt(b['pass_ms'], 1)} | {fmt(b['draft_ms'], 1)} | {fmt(b['bound_tokens_per_s'])} "
            f"| {fmt(b['bound_over_off_bound'], 2, '×')} | {fmt(b['measured_tokens_per_s'])} "
            f"| {fmt(100 * b['measured_over_bound'], 0, '%')} | {fmt(b.get('stack_pass_ms'), 1)} "
            f"| {fmt(b.get('stack_passes_over_inprocess'), 2, '×')} |"
        )
    return lines + [""]


def breakdown_table(result: dict) -> list[str]:
    lines = [
        "## Where a round's time goes (greedy, concurrency 1)",
        "",
        "The stack's draft and target workers driven directly by the benchmark, one session, as "
        "the coordinator drives them (median ms per round, first round excluded). Worker forward "
        "= the worker's own forward time; RPC + handling = client-side call time minus it "
        "(gRPC, protobuf, base checks, KV bookkeeping, sampling). In-process = the same passes "
        "of the workers' own runtime, in one process, at the workers' threads. Stack round = the full stack's time per round at concurrency 1 "
        "(TPOT × tokens per round); coordinator = stack round − direct round (Redis commit, "
        "streaming, asyncio scheduling).",
        "",
        "| γ | draft in-process | draft forward | draft RPC + handling | verify in-process "
        "| target forward | verify RPC + handling | direct round | stack round | coordinator |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.get("round_breakdown", []):
        lines.append(
            f"| {r['gamma']} | {fmt(r['inprocess_draft_ms'])} | {fmt(r['draft_forward_ms'])} "
            f"| {fmt(r['draft_rpc_ms'])} | {fmt(r['inprocess_verify_ms'])} | {fmt(r['target_forward_ms'])} "
            f"| {fmt(r['target_rpc_ms'])} | {fmt(r['round_ms'])} | {fmt(r.get('stack_round_ms'))} "
            f"| {fmt(r.get('coordinator_ms'))} |"
        )
    return lines + [""]


def goals_and_checks(result: dict) -> list[str]:
    lines = ["## Goals", ""]
    per_repeat = any("per_repeat" in g for g in result["goals"])
    if per_repeat:
        lines += [
            "Measured = the rows' (each the median run of its contender); per repeat = the same "
            "ratio from the contenders' runs of each repeat, measured side by side (goals between "
            "two of the stack's rows): a miss in every repeat is the stack's, one that some "
            "repeats meet lies within this run's spread.",
            "",
        ]
    columns = ["goal", "measured", *(["per repeat"] if per_repeat else []), "met"]
    lines += ["| " + " | ".join(columns) + " |", "|---|---:|" + "---|" * (len(columns) - 2)]
    for g in result["goals"]:
        cells = [g["goal"], fmt(g["value"], 2)]
        if per_repeat:
            cells.append(", ".join(fmt(x, 2) for x in g.get("per_repeat", [])) or "-")
        cells.append("yes" if g["met"] else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Greedy outputs against HF `generate` (target only)",
        "",
        "Greedy speculative decoding must reproduce the target's own greedy output. Identical "
        "requests out of all; where one differs, the first differing position (float32 results "
        "of a batched, padded forward can differ from batch-1 results in the last bits, which "
        "can flip a near-tie).",
        "",
        "| contender @ concurrency | identical | first differences |",
        "|---|---:|---|",
    ]
    for name, check in result["greedy_checks"].items():
        diffs = [d for d in check["first_difference"] if d is not None]
        lines.append(
            f"| {name} | {check['identical']}/{check['requests']} | {', '.join(map(str, diffs)) or '-'} |"
        )
    return lines + [""]


def definitions() -> list[str]:
    return [
        "## Definitions",
        "",
        "- tok/s aggregate: generated tokens of all requests / wall time of the run.",
        "- tok/s per request: mean over requests of generated tokens / request latency.",
        "- TTFT: request sent to first token received, measured by the client "
        "(GenerateStream for specdec, a streamer for HF).",
        "- TPOT: (latency − TTFT) / (tokens after the first arrival), per request; p50/p95 over requests.",
        "- acceptance rate = accepted / proposed candidates; mean acceptance length = "
        "(accepted + rounds) / rounds; acceptance per position i = rounds that accepted "
        "candidate i / rounds (rounds that proposed fewer candidates count as not accepted).",
        "",
    ]


def render(result: dict) -> str:
    lines = header(result) + results_table(result) + runs_table(result) + bounds_table(result)
    lines += passes_table(result)
    lines += batch_bounds_table(result) + breakdown_table(result)
    lines += goals_and_checks(result) + definitions()
    lines += [
        "Plots: `tokens_per_s_vs_concurrency.png`, `acceptance_per_position.png`.",
        "",
    ]
    return "\n".join(lines)

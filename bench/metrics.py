"""Per-configuration numbers from per-request records, and the performance-model bound.

Definitions (the same for every contender):
- aggregate tokens/s = generated tokens of the run / wall time of the run.
- per-request tokens/s = mean over requests of generated tokens / request latency.
- time to first token (TTFT) = request sent → first token received by the client.
- time per output token (TPOT) = (latency − TTFT) / (tokens − tokens in the first arrival),
  per request; p50 and p95 over requests.
- acceptance rate = accepted / proposed candidates; mean acceptance length = (accepted +
  rounds) / rounds (vLLM); acceptance per position i = rounds that accepted candidate i /
  rounds (vLLM's per-position rate; rounds that proposed fewer than i candidates count as not
  accepted); α̂ = accepted / (accepted + rounds that ended in a rejection).
"""

from __future__ import annotations

import statistics

from specdec.core import perf_model


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def tpot_s(record: dict) -> float:
    after_first = record["generated_tokens"] - max(record.get("first_chunk_tokens", 1), 1)
    if after_first <= 0:
        return float("nan")
    return (record["latency_s"] - record["ttft_s"]) / after_first


def timing(records: list[dict], wall_s: float) -> dict:
    tokens = sum(r["generated_tokens"] for r in records)
    tpots = [tpot_s(r) for r in records]
    tpots = [t for t in tpots if t == t]
    ttfts = [r["ttft_s"] for r in records]
    return {
        "requests": len(records),
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "tokens_per_s_per_request": statistics.fmean(
            r["generated_tokens"] / r["latency_s"] for r in records
        ),
        "decode_tokens_per_s_per_request": 1.0 / statistics.fmean(tpots) if tpots else 0.0,
        "tpot_ms_p50": 1000.0 * percentile(tpots, 50),
        "tpot_ms_p95": 1000.0 * percentile(tpots, 95),
        "ttft_ms_p50": 1000.0 * percentile(ttfts, 50),
        "ttft_ms_p95": 1000.0 * percentile(ttfts, 95),
    }


def rejection_rounds(stats: dict) -> int:
    """Rounds that ended in a rejection, recovered from α̂ = a / (a + r) of one request."""
    accepted, alpha = int(stats.get("accepted_tokens", 0)), float(stats.get("alpha", 0.0))
    if alpha > 0:
        return round(accepted * (1.0 - alpha) / alpha)
    return int(stats.get("rounds", 0)) if int(stats.get("draft_tokens", 0)) else 0


def acceptance(records: list[dict]) -> dict:
    """Acceptance summed over the requests of a run (specdec's per-request GenerationStats)."""
    stats = [r["stats"] for r in records]
    rounds = sum(int(s.get("rounds", 0)) for s in stats)
    proposed = sum(int(s.get("draft_tokens", 0)) for s in stats)
    accepted = sum(int(s.get("accepted_tokens", 0)) for s in stats)
    rejected = sum(rejection_rounds(s) for s in stats)
    width = max((len(s.get("accepted_per_position", [])) for s in stats), default=0)
    per_position = [0] * width
    for s in stats:
        for i, n in enumerate(s.get("accepted_per_position", [])):
            per_position[i] += int(n)
    gamma_sum = sum(
        float(s.get("mean_speculative_tokens", 0.0)) * int(s.get("rounds", 0)) for s in stats
    )
    per_gamma: list[int] = []
    for s in stats:
        for g, n in enumerate(s.get("rounds_per_gamma", [])):
            per_gamma += [0] * (g + 1 - len(per_gamma))
            per_gamma[g] += int(n)
    return {
        "rounds": rounds,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "rejection_rounds": rejected,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": (accepted + rounds) / rounds if rounds and proposed else None,
        "accepted_per_position": [n / rounds for n in per_position] if rounds else [],
        "alpha": accepted / (accepted + rejected) if accepted + rejected else None,
        "mean_gamma": gamma_sum / rounds if rounds else 0.0,
        "rounds_per_gamma": per_gamma,
    }


def passes(records: list[dict]) -> dict | None:
    """Where a run's decode time went, from each request's own stats: the workers' pass times
    for its rounds (`draft_forward_ms` + `verify_forward_ms`) against its time, both after the
    first token (less `first_token_forward_ms` and `time_to_first_token_ms`: the prompt's
    round, whose passes are many times a decode round's), summed over the requests (at
    concurrency 1 they ran one after another). Stats without the first-token split (recorded
    before it) give the whole requests' (`decode_only` False). None for a run recorded without
    the pass times (older stats, HF peers)."""
    stats = [r["stats"] for r in records]
    if not stats or any("verify_forward_ms" not in s for s in stats):
        return None
    decode_only = all("first_token_forward_ms" in s for s in stats)

    def total(name: str) -> float:
        return sum(float(s.get(name, 0.0)) for s in stats)

    time_ms = total("total_time_ms")
    passes_ms = total("draft_forward_ms") + total("verify_forward_ms")
    rounds = sum(int(s.get("rounds", 0)) for s in stats)
    if decode_only:  # every round after the first
        time_ms -= total("time_to_first_token_ms")
        passes_ms -= total("first_token_forward_ms")
        rounds -= sum(1 for s in stats if int(s.get("rounds", 0)))
    return {
        "decode_only": decode_only,
        "rounds": rounds,
        "time_ms": time_ms,
        "passes_ms": passes_ms,
        "in_passes": passes_ms / time_ms if time_ms > 0 else None,
        "round_ms": time_ms / rounds if rounds else None,
        "pass_ms_per_round": passes_ms / rounds if rounds else None,
    }


def gamma_mix(acc: dict) -> dict[int, float]:
    """The share of a run's rounds at each γ (from `rounds_per_gamma`); a run recorded without
    it (older stats) counts as all rounds at its mean γ."""
    per_gamma = acc.get("rounds_per_gamma") or []
    total = sum(per_gamma)
    if not total:
        return {acc.get("mean_gamma") or 0.0: 1.0}
    return {g: n / total for g, n in enumerate(per_gamma) if n}


def interpolate_v(v: dict, gamma: float) -> float:
    """v(γ) from the measured integer points, v(0) = 1, linear in between and beyond."""
    points = {0: 1.0, **{int(k): float(x) for k, x in v.items()}}
    keys = sorted(points)
    if gamma >= keys[-1]:
        lo, hi = keys[-2], keys[-1]
    else:
        lo = max(k for k in keys if k <= gamma)
        hi = min(k for k in keys if k > gamma)
    return points[lo] + (points[hi] - points[lo]) * (gamma - lo) / (hi - lo)


def round_tokens(alpha: float, gamma: float) -> float:
    """E of one round at γ (a round without candidates commits one token)."""
    return _expected(alpha, gamma) if gamma > 0 else 1.0


def round_model(alpha: float, gamma: float, costs: dict) -> tuple[float, float]:
    """(E, cost) of one round at γ: expected tokens, and time in target steps (γ·c + v(γ);
    a round without candidates is one step, one token)."""
    steps = gamma * costs["c"] + interpolate_v(costs["v"], gamma) if gamma > 0 else 1.0
    return round_tokens(alpha, gamma), steps


def model_bound(alpha: float | None, gamma: float | dict, costs: dict, rho: float = 0.0) -> dict:
    """Synchronous speedup S = E / (γ·c + v(γ) + ρ) and the tokens/s it allows at batch 1.

    The loop in coordinator/loop.py drafts and verifies one after the other, so the synchronous
    model applies. ρ = 0 gives the bound (no network, no coordination). `gamma` may be a mix
    {γ: share of rounds} (`gamma_mix`: the adaptive policy's rounds): then E and the round's
    cost are the mix's averages, S = Σ p·E(γ) / (Σ p·(γ·c + v(γ)) + ρ) — tokens over time of
    the rounds the policy ran. A fractional γ alone (a mean) is an approximation.
    """
    alpha = alpha or 0.0
    mix = gamma if isinstance(gamma, dict) else {gamma: 1.0}
    rounds = [(p, *round_model(alpha, g, costs)) for g, p in mix.items()]
    expected = sum(p * tokens for p, tokens, _ in rounds)
    cost = sum(p * steps for p, _, steps in rounds)
    speedup = expected / (cost + rho)
    return {
        "speedup": speedup,
        "tokens_per_s": speedup * 1000.0 / costs["target_step_ms"],
        "alpha": alpha,
        "gamma": sum(p * g for g, p in mix.items()),
        "rho": rho,
        "expected_tokens_per_round": expected,
        "cost_steps_per_round": cost,
    }


def _expected(alpha: float, gamma: float) -> float:
    """E = (1 − α^(γ+1)) / (1 − α), for a fractional γ as well."""
    if gamma == int(gamma):
        return perf_model.expected_tokens(alpha, int(gamma))
    if 1.0 - alpha < 1e-6:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def sequential_service(records: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """What C closed-loop clients see from a server that runs one request at a time.

    The HF peers generate at batch size 1, so concurrent requests queue: request j is sent when
    request j − C finishes and starts when request j − 1 finishes. From the measured service
    times this gives each request's queueing delay (added to its TTFT and latency) and the wall
    time (the sum of service times), so aggregate throughput equals sequential throughput.
    """
    done, out = [], []
    clock = 0.0
    for j, record in enumerate(records):
        sent = done[j - concurrency] if j >= concurrency else 0.0
        wait = clock - sent
        clock += record["latency_s"]
        done.append(clock)
        out.append(
            {**record, "latency_s": record["latency_s"] + wait, "ttft_s": record["ttft_s"] + wait}
        )
    return out, clock

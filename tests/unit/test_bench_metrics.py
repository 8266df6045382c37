"""The benchmark's arithmetic: per-request timing, acceptance sums, queueing of the HF peers,
and the performance-model bound (hand-computed cases)."""

import math

import pytest

from bench import metrics
from bench.tables import render


def record(latency, ttft, tokens, first=1, stats=None):
    return {
        "latency_s": latency,
        "ttft_s": ttft,
        "generated_tokens": tokens,
        "first_chunk_tokens": first,
        "stats": stats or {},
    }


def test_timing_of_a_run():
    runs = [record(1.1, 0.1, 11), record(2.2, 0.2, 21, first=1)]
    t = metrics.timing(runs, wall_s=2.5)
    assert t["tokens_per_s"] == pytest.approx(32 / 2.5)
    assert t["tokens_per_s_per_request"] == pytest.approx((11 / 1.1 + 21 / 2.2) / 2)
    # TPOT: (latency - ttft) / tokens after the first arrival = 0.1 s for both
    assert t["tpot_ms_p50"] == pytest.approx(100.0) and t["tpot_ms_p95"] == pytest.approx(100.0)
    assert t["ttft_ms_p50"] == pytest.approx(150.0)
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(metrics.percentile([], 50))
    # a request whose first arrival held every token has no TPOT
    assert math.isnan(metrics.tpot_s(record(1.0, 0.5, 4, first=4)))


def test_acceptance_sums_requests_and_recovers_rejections():
    a = {"rounds": 10, "draft_tokens": 40, "accepted_tokens": 24, "alpha": 24 / 30}
    a["accepted_per_position"] = [8, 7, 5, 4]
    a["mean_speculative_tokens"] = 4.0
    a["rounds_per_gamma"] = [0, 0, 0, 0, 10]
    b = {"rounds": 5, "draft_tokens": 10, "accepted_tokens": 5, "alpha": 0.5}
    b["accepted_per_position"] = [3, 2]
    b["mean_speculative_tokens"] = 2.0
    b["rounds_per_gamma"] = [1, 0, 4]
    acc = metrics.acceptance([record(1, 0.1, 10, stats=a), record(1, 0.1, 10, stats=b)])
    assert acc["rejection_rounds"] == 6 + 5
    assert acc["acceptance_rate"] == pytest.approx(29 / 50)
    assert acc["mean_acceptance_length"] == pytest.approx((29 + 15) / 15)
    assert acc["accepted_per_position"] == pytest.approx([11 / 15, 9 / 15, 5 / 15, 4 / 15])
    assert acc["alpha"] == pytest.approx(29 / 40)
    assert acc["mean_gamma"] == pytest.approx((40 + 10) / 15)
    assert acc["rounds_per_gamma"] == [1, 0, 4, 0, 10]
    assert metrics.gamma_mix(acc) == pytest.approx({0: 1 / 15, 2: 4 / 15, 4: 10 / 15})
    # stats recorded without the histogram: every round at the mean γ
    assert metrics.gamma_mix({"mean_gamma": 2.5}) == {2.5: 1.0}
    off = metrics.acceptance([record(1, 0.1, 10, stats={"rounds": 10})])
    assert off["acceptance_rate"] is None and off["mean_acceptance_length"] is None


def test_sequential_service_queues_concurrent_requests():
    runs = [record(1.0, 0.1, 10), record(2.0, 0.2, 10), record(1.0, 0.1, 10)]
    queued, wall = metrics.sequential_service(runs, concurrency=2)
    assert wall == pytest.approx(4.0)
    # request 1 is sent at 0 but starts at 1; request 2 is sent when request 0 ends (1) and
    # starts when request 1 ends (3)
    assert [q["ttft_s"] for q in queued] == pytest.approx([0.1, 1.2, 2.1])
    assert [q["latency_s"] for q in queued] == pytest.approx([1.0, 3.0, 3.0])
    alone, _ = metrics.sequential_service(runs, concurrency=1)
    assert [q["latency_s"] for q in alone] == pytest.approx([1.0, 2.0, 1.0])


def test_model_bound_matches_the_performance_model():
    costs = {"c": 0.1, "v": {"1": 1.2, "2": 1.4, "4": 1.8}, "target_step_ms": 20.0}
    bound = metrics.model_bound(0.7, 4, costs)
    expected = (1 - 0.7**5) / 0.3 / (4 * 0.1 + 1.8)
    assert bound["speedup"] == pytest.approx(expected)
    assert bound["tokens_per_s"] == pytest.approx(expected * 50.0)
    assert metrics.interpolate_v(costs["v"], 3) == pytest.approx(1.6)
    assert metrics.interpolate_v(costs["v"], 0.5) == pytest.approx(1.1)
    assert metrics.model_bound(0.7, 0, costs, rho=0.25)["speedup"] == pytest.approx(0.8)


def test_the_bound_of_a_mix_of_gammas_is_its_tokens_over_its_time():
    """Hand-computed: a quarter of the rounds without candidates, a quarter at γ = 2, half at
    γ = 4. The bound at the mix's mean γ (2.5) overstates it: E is concave in γ."""
    costs = {"c": 0.1, "v": {"1": 1.2, "2": 1.4, "4": 1.8}, "target_step_ms": 20.0}
    e2, e4 = 1 + 0.7 + 0.49, (1 - 0.7**5) / 0.3
    tokens = 0.25 * 1 + 0.25 * e2 + 0.5 * e4
    steps = 0.25 * 1 + 0.25 * (0.2 + 1.4) + 0.5 * (0.4 + 1.8)
    bound = metrics.model_bound(0.7, {0: 0.25, 2: 0.25, 4: 0.5}, costs)
    assert bound["expected_tokens_per_round"] == pytest.approx(tokens)
    assert bound["cost_steps_per_round"] == pytest.approx(steps)
    assert bound["speedup"] == pytest.approx(tokens / steps)
    assert bound["gamma"] == pytest.approx(2.5)
    assert metrics.model_bound(0.7, 2.5, costs)["speedup"] > bound["speedup"]
    # one γ as a mix is that γ
    assert metrics.model_bound(0.7, {4: 1.0}, costs) == metrics.model_bound(0.7, 4, costs)


def test_the_adaptive_rows_bound_is_over_its_rounds_and_reports_the_mean_too():
    from bench.report import bound_for

    costs = {"c": 0.1, "v": {"1": 1.2, "2": 1.4, "4": 1.8}, "target_step_ms": 20.0}
    acceptance = {"alpha": 0.7, "mean_gamma": 2.5, "rounds_per_gamma": [5, 0, 5, 0, 10]}
    row = {
        "contender": "specdec_adaptive",
        "mode": "greedy",
        "concurrency": 1,
        "acceptance": acceptance,
        "decode_tokens_per_s_per_request": 60.0,
    }
    b = bound_for(row, costs)
    mixed = metrics.model_bound(0.7, {0: 0.25, 2: 0.25, 4: 0.5}, costs)
    assert b["bound_tokens_per_s"] == pytest.approx(mixed["tokens_per_s"])
    assert b["measured_over_bound"] == pytest.approx(60.0 / mixed["tokens_per_s"])
    at_mean = metrics.model_bound(0.7, 2.5, costs)["tokens_per_s"]
    assert b["bound_tokens_per_s_at_mean_gamma"] == pytest.approx(at_mean)
    assert b["gamma_mix"] == {"0": 0.25, "2": 0.25, "4": 0.5}
    # ρ that makes the model match: E / (cost + ρ) = the measured speedup (60 tok/s × 20 ms)
    rho = mixed["expected_tokens_per_round"] / 1.2 - mixed["cost_steps_per_round"]
    assert b["implied_rho"] == pytest.approx(rho)
    # a fixed γ row ignores a histogram: its γ is its own
    fixed = bound_for({**row, "contender": "specdec_g4"}, costs)
    assert fixed["bound_tokens_per_s"] == pytest.approx(
        metrics.model_bound(0.7, 4, costs)["tokens_per_s"]
    )


def test_a_rows_time_splits_into_the_workers_passes_and_the_rest():
    """`metrics.passes` sums the requests' own pass times against their total time; the bound
    compares them with the in-process cost of the same rounds, and the report prints both."""
    from bench.report import bound_for
    from bench.tables import passes_table

    # two requests: 11 and 31 rounds, the first of each (the prompt's) 40 ms with 36 in passes
    a = {"rounds": 11, "total_time_ms": 240.0, "draft_forward_ms": 50.0, "verify_forward_ms": 146.0}
    b = {
        "rounds": 31,
        "total_time_ms": 640.0,
        "draft_forward_ms": 120.0,
        "verify_forward_ms": 396.0,
    }
    for stats in (a, b):
        stats.update(time_to_first_token_ms=40.0, first_token_forward_ms=36.0)
    p = metrics.passes([record(0.24, 0.04, 40, stats=a), record(0.64, 0.04, 120, stats=b)])
    # after the first token: 40 rounds, 800 ms, 640 in passes
    assert p["decode_only"] and p["rounds"] == 40
    assert p["in_passes"] == pytest.approx(640 / 800)
    assert p["round_ms"] == pytest.approx(20.0) and p["pass_ms_per_round"] == pytest.approx(16.0)
    # stats from before the first-token split: the whole requests
    whole = [{k: v for k, v in s.items() if k != "first_token_forward_ms"} for s in (a, b)]
    w = metrics.passes([record(0.24, 0.04, 40, stats=s) for s in whole])
    assert not w["decode_only"] and w["rounds"] == 42
    assert w["in_passes"] == pytest.approx(712 / 880)
    # stats without the pass times (an older run, or a peer's records): nothing to split
    assert metrics.passes([record(0.2, 0.02, 40, stats={"rounds": 10})]) is None
    assert metrics.passes([]) is None

    costs = {"c": 0.1, "v": {"1": 1.2, "2": 1.4, "4": 1.8}, "target_step_ms": 5.0}
    row = {
        "contender": "specdec_g4",
        "label": "specdec γ=4",
        "mode": "greedy",
        "concurrency": 1,
        "acceptance": {"alpha": 0.7, "mean_gamma": 4.0},
        "decode_tokens_per_s_per_request": 150.0,
        "passes": p,
    }
    bound = bound_for(row, costs)
    # γ·c + v(4) = 0.4 + 1.8 target steps of 5 ms in-process; 16 ms in the stack's passes
    assert bound["inprocess_pass_ms_per_round"] == pytest.approx(11.0)
    assert bound["stack_passes_over_inprocess"] == pytest.approx(16.0 / 11.0)
    assert bound["in_passes"] == pytest.approx(0.8) and bound["stack_round_ms"] == 20.0
    table = "\n".join(passes_table({"bounds": [bound], "rows": [row]}))
    assert "| greedy | specdec γ=4 | 20.00 | 16.00 | 11.00 | 1.45× | 4.00 | 80% |" in table
    # a row measured without the pass times: no split, no table
    older = bound_for({**row, "passes": None}, costs)
    assert older["stack_passes_over_inprocess"] is None and older["in_passes"] is None
    assert passes_table({"bounds": [older], "rows": [row]}) == []


def test_render_needs_a_full_result():
    """The report renderer refuses a result without its rows (no silent empty report)."""
    with pytest.raises((KeyError, TypeError)):
        render({})


def batch_row(contender, alpha, mean_gamma=None, tokens_per_s=300.0):
    acceptance = {"alpha": alpha, "mean_gamma": mean_gamma}
    return {
        "contender": contender,
        "mode": "greedy",
        "concurrency": 16,
        "acceptance": acceptance,
        "tokens_per_s": tokens_per_s,
    }


def test_batch_bound_is_tokens_of_a_lock_step_round_over_its_passes():
    """Hand-computed: 16 sessions, pass ms by new tokens a session, draft step 1 ms."""
    from bench.report import batch_bound_for

    batch = {"pass_ms": {"1": 32.0, "2": 40.0, "3": 48.0, "4": 56.0}, "draft_step_ms": 1.0}
    off = batch_bound_for(batch_row("specdec_off", 0.0), batch, 16)
    assert off["bound_tokens_per_s"] == pytest.approx(16 / 0.032)
    assert off["bound_over_off_bound"] == pytest.approx(1.0)
    assert batch_bound_for(batch_row("specdec_off", 0.0), batch, 4)["bound_tokens_per_s"] == (
        pytest.approx(4 / 0.032)
    )
    g2 = batch_bound_for(batch_row("specdec_g2", 0.7), batch, 16)
    tokens = 1 + 0.7 + 0.49  # E(0.7, 2)
    assert g2["expected_tokens_per_round"] == pytest.approx(tokens)
    assert g2["bound_tokens_per_s"] == pytest.approx(16 * tokens / 0.050)  # 48 + 2·1 ms
    assert g2["bound_over_off_bound"] == pytest.approx(tokens * 32 / 50)
    assert g2["measured_over_bound"] == pytest.approx(300.0 / (16 * tokens / 0.050))
    # adaptive: its mean γ, the pass interpolated between whole γ (1.5 → 44 ms)
    adaptive = batch_bound_for(batch_row("specdec_adaptive", 0.5, mean_gamma=1.5), batch, 16)
    assert adaptive["pass_ms"] == pytest.approx(44.0)
    assert adaptive["draft_ms"] == pytest.approx(1.5)
    # with its rounds' γ mix: half without candidates, half at γ = 3
    row = batch_row("specdec_adaptive", 0.5, mean_gamma=1.5)
    row["acceptance"]["rounds_per_gamma"] = [6, 0, 0, 6]
    mixed = batch_bound_for(row, batch, 16)
    tokens = 0.5 * 1 + 0.5 * (1 + 0.5 + 0.25 + 0.125)
    assert mixed["expected_tokens_per_round"] == pytest.approx(tokens)
    assert mixed["pass_ms"] == pytest.approx(0.5 * 32 + 0.5 * 56)
    assert mixed["bound_tokens_per_s"] == pytest.approx(16 * tokens / ((44.0 + 1.5) / 1000))
    # the passes the stack's sessions were in (their own stats), against the in-process ones
    timed = batch_row("specdec_g2", 0.7)
    timed["passes"] = {"pass_ms_per_round": 75.0}
    g2 = batch_bound_for(timed, batch, 16)
    assert g2["stack_pass_ms"] == 75.0
    assert g2["stack_passes_over_inprocess"] == pytest.approx(75.0 / 50.0)  # 48 + 2·1 ms
    assert batch_bound_for(batch_row("specdec_g2", 0.7), batch, 16)["stack_pass_ms"] is None
    # a pass that grows with every position more than E does: speculation cannot pay
    flat = {"pass_ms": {"1": 30.0, "2": 60.0, "3": 90.0}, "draft_step_ms": 0.0}
    assert batch_bound_for(batch_row("specdec_g2", 0.7), flat, 16)["bound_over_off_bound"] < 1.0


def test_batch_costs_job_times_passes_as_the_workers_run_them(model_dirs):
    """The in-process job on tiny models: a pass time per new-token count (1 .. γ+1) and a
    draft step, per batch size asked for."""
    from bench.inproc import measure_batch_costs

    job = {
        "target_model": model_dirs["target"],
        "draft_model": model_dirs["draft"],
        "linear_kernel": "auto",
        "context": list(range(5, 40)),
        "batches": [2, 4],
        "max_gamma": 2,
        "reps": 2,
        "warmup": 1,
    }
    out = measure_batch_costs({**job, "target_threads": 2, "draft_threads": 1})
    assert out["threads"] == {"target": 2, "draft": 1}  # each model at its worker's threads
    assert sorted(out["batches"]) == ["2", "4"]
    for costs in out["batches"].values():
        assert sorted(costs["pass_ms"]) == ["1", "2", "3"]
        assert all(ms > 0 for ms in costs["pass_ms"].values()) and costs["draft_step_ms"] > 0


def test_costs_job_times_the_workers_own_passes_at_one_session(model_dirs):
    """The bound's per-token costs come from the workers' runtime (not HF's forward): a step,
    a draft step and verifies of γ+1 tokens, with c and v(γ) their ratios."""
    from bench.inproc import measure_costs

    job = {
        "target_model": model_dirs["target"],
        "draft_model": model_dirs["draft"],
        "linear_kernel": "auto",
        "context": list(range(5, 40)),
        "max_gamma": 2,
        "reps": 2,
        "warmup": 1,
        "target_threads": 2,
        "draft_threads": 1,
    }
    out = measure_costs(job)
    assert out["forward"].startswith("the workers' runtime")
    assert out["threads"] == {"target": 2, "draft": 1} and out["context_tokens"] == 35
    assert sorted(out["verify_ms"]) == [1, 2] and out["target_step_ms"] > 0
    assert out["c"] == pytest.approx(out["draft_step_ms"] / out["target_step_ms"])
    assert out["v"][2] == pytest.approx(out["verify_ms"][2] / out["target_step_ms"])


def test_goals_are_the_performance_issues_measured_side_by_side():
    """Each goal from hand-set rows: met exactly at its threshold, not met just below it."""
    from bench.report import goals

    rates = {  # (contender, mode, concurrency) -> aggregate tok/s
        ("hf_target", 1): 100.0,
        ("hf_assisted", 1): 100.0,
        ("specdec_off", 1): 95.0,  # 0.95× HF generate: met at the line
        ("specdec_g2", 1): 130.0,
        ("specdec_adaptive", 1): 125.0,  # 1.25× HF assisted; 0.96× of γ = 2
        ("hf_assisted", 16): 100.0,
        ("specdec_off", 16): 300.0,
        ("specdec_g2", 16): 400.0,
        ("specdec_adaptive", 16): 299.0,  # 2.99× HF assisted, below speculation off
    }
    rows = [
        {"contender": c, "mode": m, "concurrency": n, "tokens_per_s": t}
        for m in ("greedy", "sampling")
        for (c, n), t in rates.items()
    ]
    bounds = [{"contender": "specdec_adaptive", "mode": "greedy", "measured_over_bound": 0.9}]
    batch_bounds = [
        {"mode": "greedy", "concurrency": 16, "bound_over_off_bound": r} for r in (1.1, 1.31)
    ]
    got = {g["goal"]: (g["value"], g["met"]) for g in goals(rows, bounds, [1, 16], batch_bounds)}
    assert got["conc 1 greedy: adaptive ≥ 1.25× HF assisted"] == (pytest.approx(1.25), True)
    assert got["conc 1 sampling: adaptive ≥ 1.1× HF assisted"][1] is True
    assert got["conc 1 greedy: speculation off ≥ 0.95× HF generate"] == (pytest.approx(0.95), True)
    assert got["conc 1 greedy: adaptive ≥ 90% of the model bound"] == (0.9, True)
    assert got["conc 16 greedy: adaptive ≥ 3× HF assisted (aggregate)"] == (
        pytest.approx(2.99),
        False,
    )
    load = "conc 16 greedy: adaptive ≥ 1.3× speculation off (the bound under load allows 1.31×)"
    assert got[load] == (pytest.approx(299 / 300), False)
    assert "conc 16 sampling: adaptive ≥ 1.3× speculation off" in got  # no bound measured
    assert got["conc 1 greedy: adaptive within 5% of the best fixed γ"] == (
        pytest.approx(125 / 130),
        True,
    )
    assert got["conc 16 greedy: adaptive within 5% of the best fixed γ"] == (
        pytest.approx(299 / 400),
        False,
    )
    assert got["adaptive never below speculation off (any mode, any conc)"] == (
        pytest.approx(299 / 300),
        False,
    )


def test_speculation_off_on_all_threads_is_the_serving_overhead_goal_where_measured():
    """With the all-threads row, the ≥ 0.95× HF generate goal is measured on it (the target on
    HF's threads), not on the speculating stack's 1-thread target; that row gets no bound and
    does not stand in for speculation off in the other goals."""
    from bench.report import goals

    rates = {
        ("hf_target", 1): 100.0,
        ("hf_assisted", 1): 100.0,
        ("specdec_off", 1): 70.0,
        ("specdec_off_all_threads", 1): 94.0,  # just below the line
        ("specdec_adaptive", 1): 110.0,
    }
    rows = [
        {"contender": c, "mode": m, "concurrency": n, "tokens_per_s": t}
        for m in ("greedy", "sampling")
        for (c, n), t in rates.items()
    ]
    got = {g["goal"]: (g["value"], g["met"]) for g in goals(rows, [], [1])}
    named = "conc 1 greedy: speculation off (target on HF's threads) ≥ 0.95× HF generate"
    assert got[named] == (pytest.approx(0.94), False)
    assert "conc 1 greedy: speculation off ≥ 0.95× HF generate" not in got
    never_below = "adaptive never below speculation off (any mode, any conc)"
    assert got[never_below] == (pytest.approx(110 / 70), True)  # against the same stack's off


def test_peers_and_costs_run_where_the_workers_do(monkeypatch, model_dirs):
    """bench.inproc places the HF peers and the in-process costs on the workers' device and
    dtype (SPECDEC_DEVICE / SPECDEC_DTYPE, which `bench.run --device/--dtype` sets)."""
    import torch

    from bench.inproc import load, placement

    monkeypatch.setenv("SPECDEC_DEVICE", "cpu")
    monkeypatch.setenv("SPECDEC_DTYPE", "bfloat16")
    assert placement() == (torch.device("cpu"), torch.bfloat16)
    model = load(model_dirs["target"])
    assert next(model.parameters()).dtype == torch.bfloat16
    monkeypatch.setenv("SPECDEC_DTYPE", "auto")
    assert placement() == (torch.device("cpu"), torch.float32)  # auto: float32 on a CPU
    monkeypatch.setenv("SPECDEC_DTYPE", "float64")
    with pytest.raises(ValueError, match="dtype"):
        placement()


def test_bench_run_device_flags_reach_every_contender(monkeypatch):
    """`--device/--dtype` default to the workers' environment and are handed back to it, so
    the stack's workers and the peers' subprocesses read the same placement."""
    import os

    from bench import run

    monkeypatch.setenv("SPECDEC_DEVICE", "cuda")
    monkeypatch.delenv("SPECDEC_DTYPE", raising=False)
    args = run.parse([])
    assert (args.device, args.dtype) == ("cuda", "auto")
    args = run.parse(["--device", "cpu", "--dtype", "float32"])
    assert (args.device, args.dtype) == ("cpu", "float32")
    with pytest.raises(SystemExit):
        run.parse(["--device", "tpu"])
    seen = {}
    monkeypatch.setattr(run, "bench_pair", lambda a, argv: seen.update(vars(a)))
    monkeypatch.setattr("specdec.engine.convert.resolve_model", lambda value, **_: value)
    run.main(["--pair", "code", "--device", "cpu", "--dtype", "float32"])
    assert os.environ["SPECDEC_DEVICE"] == "cpu" and os.environ["SPECDEC_DTYPE"] == "float32"
    assert seen["device"] == "cpu"


def test_bench_run_split_defaults_to_the_target_on_every_thread():
    """`--split T+D:P`: by default the target worker gets all `--threads`, the draft 1, and
    pipelining is off; a split is checked when the flags are read."""
    from bench import run

    args = run.parse([])
    assert (args.target_threads, args.draft_threads, args.pipeline) == (2, 1, "off")
    args = run.parse(["--threads", "4", "--split", "3+1:auto"])
    assert (args.target_threads, args.draft_threads, args.pipeline) == (3, 1, "auto")
    with pytest.raises(SystemExit):
        run.parse(["--split", "2+1"])


def test_report_header_names_the_device_the_models_ran_on():
    from bench.tables import header

    meta = {
        "quick": True,
        "date_utc": "2026-12-04T00:00:00+00:00",
        "command": "python -m bench.run",
        "duration_s": 60.0,
        "machine": {"cpus": 16, "platform": "Linux", "python": "3.12.3"},
        "threads": {"hf_peers": 2, "stack_target_worker": 1, "stack_draft_worker": 1},
        "prompts": {"count": 1, "chat_template": True, "source": "x"},
        "target_model": "t",
        "draft_model": "d",
        "max_new_tokens": 8,
        "hf_assistant_defaults": {},
    }
    costs = {"v": {1: 1.0}, "target_step_ms": 1.0, "draft_step_ms": 0.1, "c": 0.1}
    costs["context_tokens"] = 8
    text = "\n".join(header({"meta": meta, "costs": costs}))
    assert "no GPU" in text and "(float32, CPU)" in text  # runs before the device was recorded
    meta["machine"].update(device="cuda:0", dtype="bfloat16")
    text = "\n".join(header({"meta": meta, "costs": costs}))
    assert "models on cuda:0" in text and "(bfloat16, cuda:0)" in text and "no GPU" not in text


def test_plots_draw_only_the_contenders_a_run_measured(tmp_path):
    """A run without some contender (the all-threads speculation off is run only where the
    split leaves the target fewer threads) still gets its two plots."""
    from bench.report import plots

    rows = [
        {"contender": c, "label": c, "mode": m, "concurrency": n, "tokens_per_s": 10.0 * n}
        for c in ("hf_target", "hf_assisted", "specdec_off", "specdec_adaptive")
        for m in ("greedy", "sampling")
        for n in (1, 4)
    ]
    result = {
        "rows": rows,
        "meta": {"concurrency": [1, 4]},
        "acceptance_per_position_pooled": {
            "specdec_adaptive/greedy": [0.7, 0.4],
            "specdec_adaptive/sampling": [0.6, 0.3],
        },
    }
    paths = plots(result, tmp_path)
    assert [p.name for p in paths] == [
        "tokens_per_s_vs_concurrency.png",
        "acceptance_per_position.png",
    ]
    assert all(p.stat().st_size > 0 for p in paths)


def test_median_run_is_the_middle_rate_and_lists_every_run():
    from bench.measure import median_run

    runs = [{"r": 3.0}, {"r": 1.0}, {"r": 2.0}]
    assert median_run(runs, lambda m: m["r"]) == ({"r": 2.0}, [3.0, 1.0, 2.0])
    # an even count: the lower middle one (never an average of two runs no one measured)
    assert median_run(runs + [{"r": 4.0}], lambda m: m["r"])[0] == {"r": 2.0}
    assert median_run([{"r": 5.0}], lambda m: m["r"]) == ({"r": 5.0}, [5.0])


class CannedStack:
    """Answers `measure` with a run whose rate the test chose (a stand-in for `BenchStack`,
    which needs a whole stack: this checks what `measure_rows` does with the runs)."""

    def __init__(self, rates):
        self.rates, self.calls = rates, []

    def measure(self, mode, gamma, concurrency):
        self.calls.append((mode["name"], gamma, concurrency))
        rate = self.rates[(gamma, len(self.calls))]
        tokens = [1] * 100
        request = {"token_ids": tokens, "stats": {}, "ttft_s": 0.01, "token_times_s": [0.01] * 100}
        return {"wall_s": 100 / rate, "requests": [request]}


def test_repeats_alternate_the_order_and_keep_each_rows_median(monkeypatch):
    from argparse import Namespace

    from bench import measure

    monkeypatch.setattr(measure, "MODES", ({"name": "greedy", "temperature": 0.0},))
    monkeypatch.setattr(
        measure,
        "make_row",
        lambda name, mode, c, requests, wall: {
            "contender": name,
            "mode": mode,
            "concurrency": c,
            "tokens_per_s": 100 / wall,
            "label": name,
            "tokens_per_s_per_request": 0.0,
            "tpot_ms_p50": 0.0,
            "ttft_ms_p50": 0.0,
        },
    )
    monkeypatch.setattr(
        measure.metrics,
        "acceptance",
        lambda requests: {"acceptance_rate": None, "mean_acceptance_length": None},
    )
    monkeypatch.setattr(measure, "LABELS", {"a": "a", "b": "b"})
    monkeypatch.setattr(measure, "progress_line", lambda *a: "")
    # call n (1-based) of contender γ: a (γ 0) runs 1st, 4th, 5th; b (γ 2) 2nd, 3rd, 6th
    rates = {(0, 1): 10.0, (2, 2): 50.0, (2, 3): 40.0, (0, 4): 30.0, (0, 5): 20.0, (2, 6): 60.0}
    stack = CannedStack(rates)
    args = Namespace(repeats=3, concurrency=[1], retries=0, max_other_cpu=1.0)
    rows, raw = [], []
    measure.measure_rows(args, stack, (("a", 0), ("b", 2)), rows, raw, 2, lambda msg: None)
    assert [g for _, g, _ in stack.calls] == [0, 2, 2, 0, 0, 2]  # forward, reverse, forward
    assert [(r["contender"], r["runs"]) for r in rows] == [
        ("a", [10.0, 30.0, 20.0]),
        ("b", [50.0, 40.0, 60.0]),
    ]
    assert [round(r["tokens_per_s"], 6) for r in rows] == [20.0, 50.0]  # the medians
    assert len(raw) == 2


def test_bench_run_repeats_flag_and_runs_table():
    from bench import run
    from bench.tables import runs_line, runs_table

    assert run.parse([]).repeats == 1
    assert run.parse(["--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        run.parse(["--repeats", "0"])
    assert runs_line({"repeats": 1}) == [] and "3 times" in runs_line({"repeats": 3})[0]
    row = {
        "mode": "greedy",
        "concurrency": 1,
        "label": "x",
        "tokens_per_s": 2.0,
        "runs": [3.0, 1.0, 2.0],
    }
    assert "| greedy | 1 | x | 2.0 | 3.0, 1.0, 2.0 |" in runs_table({"rows": [row]})
    assert runs_table({"rows": [{**row, "runs": [2.0]}]}) == []


def test_goals_between_stack_rows_say_how_each_repeat_went():
    """Two repeats: each stack goal also gives the ratio of the contenders' runs of each repeat
    (measured side by side), the never-below goal the worst cell of each repeat; goals against
    the HF peers, rows without runs and a run of one repeat give none. The table shows the
    column only where some goal has it."""
    from bench.report import goals
    from bench.tables import goals_and_checks

    runs = {  # (contender, concurrency) -> runs of two repeats
        ("hf_assisted", 16): [100.0, 100.0],
        ("specdec_off", 16): [450.0, 540.0],
        ("specdec_g2", 16): [583.0, 633.0],
        ("specdec_g4", 16): [478.0, 542.0],
        ("specdec_adaptive", 16): [489.0, 476.0],
        ("specdec_off", 1): [90.0, 100.0],
        ("specdec_adaptive", 1): [120.0, 95.0],
    }
    rows = [
        {"contender": c, "mode": m, "concurrency": n, "tokens_per_s": min(r), "runs": r}
        for m in ("greedy", "sampling")
        for (c, n), r in runs.items()
    ]
    by_goal = {g["goal"]: g for g in goals(rows, [], [1, 16])}
    within = by_goal["conc 16 greedy: adaptive within 5% of the best fixed γ"]
    assert within["value"] == pytest.approx(476 / 583) and not within["met"]
    assert within["per_repeat"] == pytest.approx([489 / 583, 476 / 633])
    load = by_goal["conc 16 greedy: adaptive ≥ 1.3× speculation off"]
    assert load["per_repeat"] == pytest.approx([489 / 450, 476 / 540])
    never = by_goal["adaptive never below speculation off (any mode, any conc)"]
    assert never["per_repeat"] == pytest.approx(
        [min(489 / 450, 120 / 90), min(476 / 540, 95 / 100)]
    )
    assert "per_repeat" not in by_goal["conc 16 greedy: adaptive ≥ 3× HF assisted (aggregate)"]
    table = "\n".join(goals_and_checks({"goals": list(by_goal.values()), "greedy_checks": {}}))
    assert "| goal | measured | per repeat | met |" in table
    assert f"| 0.82 | {489 / 583:.2f}, {476 / 633:.2f} | **no** |" in table

    one_repeat = [{**r, "runs": r["runs"][:1]} for r in rows]
    no_runs = [{k: v for k, v in r.items() if k != "runs"} for r in rows]
    uneven = [{**r, "runs": r["runs"][:1]} if r["contender"] == "specdec_g2" else r for r in rows]
    for other in (one_repeat, no_runs, uneven):
        found = goals(other, [], [1, 16])
        within = next(g for g in found if g["goal"].startswith("conc 16 greedy: adaptive within"))
        assert "per_repeat" not in within
    table = "\n".join(goals_and_checks({"goals": goals(no_runs, [], [1, 16]), "greedy_checks": {}}))
    assert "| goal | measured | met |" in table and "per repeat" not in table

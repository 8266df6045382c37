"""`python -m bench.gpu_check math`: the workers' hot path (bench/math.py's `propose_step` and
`verify_logits`) on a device, checked token for token against the CPU and timed; in fixed
shapes (CUDA graphs on a GPU) too, and random `stress` rounds against the eager path."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.gpu_env import result, torch_threads


def math_inputs(vocab: int, batch: int, mode: str) -> dict:
    """The inputs bench/math.py's `case` builds (same seeds, same LLM-like logits), on CPU."""
    from bench.math import case_inputs

    return case_inputs(vocab, batch, mode)


def hot_path(inputs: dict, device, graphs=None):
    """(propose_step, verify_logits) closures over the inputs moved to `device`; with
    `graphs` (a `specdec.core.graphs.SamplingGraphs`) the sampling math in fixed shapes, one
    CUDA graph a call on a GPU (`--sampling-graphs`)."""
    from bench.math import K
    from specdec.core.processed import ProcessorParams
    from specdec.core.proposal import propose_step
    from specdec.core.verify import DraftBlock, verify_logits

    x = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    batch = x["target"].shape[0]
    block = DraftBlock(x["candidates"], x["num"], x["q_ids"], x["q_w"])
    sampling = ProcessorParams.of([] if x["greedy"] else x["params"], device=device)
    token_only = [x["greedy"]] * batch

    def draft():
        return propose_step(
            x["draft_logits"], x["params"], x["seeds"], x["base"], K, token_only, graphs
        )

    def verify():
        return verify_logits(x["target"], x["mask"], sampling, block, x["seeds"], x["base"], graphs)

    return draft, verify


def timed_sync(fn, repeat: int, device) -> float:
    """Median ms of fn() after one warm-up, the device synchronised around each call."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def cmd_math(args) -> int:
    torch_threads(1)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} but this torch has no CUDA", flush=True)
        return 2
    from specdec.core.graphs import SamplingGraphs

    device = torch.device(args.device)
    cpu = torch.device("cpu")
    vocabs = [int(v) for v in args.vocabs.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    # [sessions differing from the CPU, all]: the eager path, and the fixed shapes ("graphs")
    mismatched = {m: [0, 0] for m in ("greedy", "sampling", "sampling-graphs")}
    rows = []
    cases = bench_cases(vocabs, batches, args.repeat) if args.bench_cases else []
    graphs = SamplingGraphs(device, capacity=64) if args.graphs else None
    with torch.inference_mode():
        for vocab in vocabs:
            for batch in batches:
                for mode in ("greedy", "sampling"):
                    inputs = math_inputs(vocab, batch, mode)
                    draft_cpu, verify_cpu = hot_path(inputs, cpu)
                    want = draft_cpu(), verify_cpu()
                    row = {"vocab": vocab, "batch": batch, "mode": mode, "device": str(device)}
                    ways = [("", mode, None)]
                    if graphs is not None and mode == "sampling":
                        ways.append(("graph_", "sampling-graphs", graphs))
                    for prefix, kind, runner in ways:
                        draft_dev, verify_dev = hot_path(inputs, device, runner)
                        differing = sessions_differing(want, (draft_dev(), verify_dev()))
                        mismatched[kind][0] += differing
                        mismatched[kind][1] += batch
                        row[prefix + "verify_ms"] = timed_sync(verify_dev, args.repeat, device)
                        row[prefix + "draft_step_ms"] = timed_sync(draft_dev, args.repeat, device)
                        row[prefix + "sessions_differing_from_cpu"] = differing
                    if graphs is not None:
                        row["graph_counts"] = dict(graphs.counts)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    greedy_bad, greedy_all = mismatched["greedy"]
    sampling_bad, sampling_all = mismatched["sampling"]
    graph_bad, graph_all = mismatched["sampling-graphs"]
    # greedy must be identical; sampling may differ only where a float sum lands on a
    # boundary (another reduction order on the device): at most 1 % of the sessions
    ok = greedy_bad == 0 and sampling_bad <= 0.01 * sampling_all and graph_bad <= 0.01 * graph_all
    stressed = stress(device, args.stress) if args.graphs and args.stress else None
    if stressed is not None:
        print("stress " + json.dumps(stressed), flush=True)
        ok = ok and stressed["differing"] <= 0.01 * stressed["sessions"]
        ok = ok and stressed["draft_differing"] <= 0.01 * stressed["draft_rows"]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"math-{args.device.replace(':', '')}.json").write_text(
            json.dumps(
                {"rows": rows, "mismatched": mismatched, "cases": cases, "stress": stressed},
                indent=1,
            )
        )
    worst = max(rows, key=lambda r: r["verify_ms"])
    also = f"bench.math cases (cpu): {len(cases)}; " if cases else ""
    fixed = ""
    if graphs is not None:
        slowest = max(
            (r for r in rows if "graph_verify_ms" in r), key=lambda r: r["graph_verify_ms"]
        )
        fixed = (
            f"; sampling in fixed shapes {graph_all - graph_bad}/{graph_all} as on the CPU, "
            f"slowest verify {slowest['graph_verify_ms']:.2f} ms (vocab {slowest['vocab']:,} x "
            f"batch {slowest['batch']}; eager {slowest['verify_ms']:.2f} ms), calls sent back "
            f"to the eager path {graphs.counts['eager']}/{graphs.counts['calls']}"
        )
    if stressed is not None:
        fixed += (
            f"; stress: {stressed['sessions'] - stressed['differing']}/{stressed['sessions']} "
            f"verified sessions and {stressed['draft_rows'] - stressed['draft_differing']}/"
            f"{stressed['draft_rows']} draft rows as on the CPU ({stressed['rounds']} rounds, "
            f"{stressed['captures']} graphs captured, {stressed['eager']} calls eager)"
        )
    return result(
        ok,
        f"{also}math hot path on {device}: greedy {greedy_all - greedy_bad}/{greedy_all} and sampling "
        f"{sampling_all - sampling_bad}/{sampling_all} sessions as on the CPU; slowest verify "
        f"{worst['verify_ms']:.2f} ms (vocab {worst['vocab']:,} x batch {worst['batch']}, "
        f"{worst['mode']}){fixed}",
    )


def stress(device, rounds: int, seed: int = 0) -> dict:
    """Random rounds of sampling verifies and draft steps in fixed shapes on `device` against
    the eager path on the CPU: 1–16 sessions (some greedy), γ 0–6, vocabularies 8k and 49k,
    peaked and flat LLM-like rows, temperatures 0.3–1.5, top-k off / 20 / 64 / 100, top-p
    0.9–1, min-p; one `SamplingGraphs` for all, so buckets are reused with stale rows."""
    import random

    import torch

    from bench.math import llm_like
    from specdec.core.graphs import SamplingGraphs
    from specdec.core.params import SamplingParams
    from specdec.core.processed import ProcessorParams
    from specdec.core.proposal import propose_step
    from specdec.core.rng import seed_tensor
    from specdec.core.verify import DraftBlock, verify_logits

    rng, graphs = random.Random(seed), SamplingGraphs(device)
    out = {"rounds": rounds, "sessions": 0, "differing": 0, "draft_rows": 0, "draft_differing": 0}
    for r in range(rounds):
        batch, gamma, vocab = rng.randint(1, 16), rng.randint(0, 6), rng.choice((8192, 49152))
        k = rng.choice((8, 32, 64))
        params = [
            SamplingParams()
            if rng.random() < 0.15
            else SamplingParams(
                temperature=rng.choice((0.3, 0.8, 1.0, 1.5)),
                top_k=rng.choice((0, 0, 0, 20, 64, 100)),
                top_p=rng.choice((1.0, 0.9, 0.95, 0.99)),
                min_p=rng.choice((0.0, 0.0, 0.05)),
            )
            for _ in range(batch)
        ]
        token_only = [p.greedy for p in params]
        scale = rng.choice((1.0, 1.0, 0.3))  # 0.3: flat rows, nuclei of thousands
        target = (llm_like(batch * (gamma + 1), vocab, seed=r) * scale).reshape(
            batch, gamma + 1, -1
        )
        seeds = seed_tensor([rng.getrandbits(63) for _ in range(batch)])
        base = torch.tensor([rng.randrange(4096) for _ in range(batch)])
        candidates = torch.zeros(batch, gamma, dtype=torch.int64)
        q_ids = torch.zeros(batch, gamma, k, dtype=torch.int64)
        q_w = torch.zeros(batch, gamma, k, dtype=torch.float64)
        for i in range(gamma):
            draft = target[:, i] + 0.5 * torch.randn(batch, vocab)
            want = propose_step(draft, params, seeds, base + i, k, token_only)
            got = propose_step(
                draft.to(device),
                params,
                seeds.to(device),
                (base + i).to(device),
                k,
                token_only,
                graphs,
            )
            same = want.tokens == got.tokens.cpu()
            if want.dist_ids is not None:
                same &= (want.dist_weights == got.dist_weights.cpu()).all(dim=1)
            out["draft_rows"] += batch
            out["draft_differing"] += int((~same).sum())
            candidates[:, i] = want.tokens
            if want.dist_ids is not None:
                q_ids[:, i], q_w[:, i] = want.dist_ids, want.dist_weights.double()
        alone = torch.tensor(token_only)
        q_w[alone] = 0.0
        q_ids[alone, :, 0], q_w[alone, :, 0] = candidates[alone], 1.0
        num = torch.tensor([rng.randint(0, gamma) if rng.random() < 0.2 else gamma for _ in params])
        greedy = torch.tensor(token_only)
        sampling = [p for p in params if not p.greedy]
        block = DraftBlock(candidates, num, q_ids, q_w)
        want = verify_logits(target, greedy, ProcessorParams.of(sampling), block, seeds, base)
        moved = DraftBlock(*(x.to(device) for x in (candidates, num, q_ids, q_w)))
        got = verify_logits(
            target.to(device),
            greedy.to(device),
            ProcessorParams.of(sampling, device=device),
            moved,
            seeds.to(device),
            base.to(device),
            graphs,
        )
        same = (want.num_accepted == got.num_accepted.cpu()) & (
            want.output_tokens == got.output_tokens.cpu()
        ).all(dim=1)
        out["sessions"] += batch
        out["differing"] += int((~same).sum())
    out.update(graphs.counts)
    return out


def sessions_differing(want, got) -> int:
    """Sessions whose draft candidate or verify output differs between two (Proposal,
    VerifyResult) pairs (the second possibly on another device)."""
    same = (want[0].tokens == got[0].tokens.cpu()) & (
        want[1].output_tokens == got[1].output_tokens.cpu()
    ).all(dim=1)
    return int((~same).sum())


def bench_cases(vocabs: list[int], batches: list[int], repeat: int) -> list[dict]:
    """bench/math.py's own `case` (hot path and dense reference, CPU) at the given sizes: the
    loop body of `python -m bench.math`, small enough for the smoke run."""
    import torch

    from bench.math import case

    rows = []
    with torch.inference_mode():
        for vocab in vocabs:
            for batch in batches:
                for mode in ("greedy", "sampling"):
                    rows.append(case(vocab, batch, mode, dense=True, repeat=repeat))
                    print("bench.math case " + json.dumps(rows[-1]), flush=True)
    return rows

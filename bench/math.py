"""Micro-benchmark of the per-pass math: one draft sampling step and one verify pass.

    python -m bench.math [--threads 1] [--out results/math] [--quick]   (also: specdec bench math)

For each vocabulary (8k, 49k SmolLM2, 128k Llama 3, 262k Gemma 3) × batch (1, 16, 64) ×
mode (greedy; sampling at temperature 0.8, top-p 0.95), γ = 4, K = 32 wire entries, the
median of `REPEATS` calls (batch 1 takes the small-batch path, `specdec.core.few_rows`):
  - hot path (what the workers run): `propose_step` for one draft step; `verify_logits` for
    one verify pass, from the target's float32 logits [B, γ+1, vocab] and the sparse q̃;
  - dense reference (the math before): `batched_probs` + `dense_q` + `verify_block`, and a
    draft step through `apply_processors` + float64 softmax + `quantise`, measured in the same
    run where it fits in time (batch ≤ 16).
Logits are LLM-like (`llm_like`): a Gaussian tail with a few strong tokens per row whose
strength varies, so top-p's nucleus ranges from a few tokens to thousands as a real model's
does, not only a flat worst case; the nucleus sizes are reported.
`--model DIR` also times the same verify math against the model's own batched forward pass
(16 sessions × γ+1 positions) on real logits: the share of the pass the math takes, after
random token ids (flat rows: the worst case) and, for a bench pair's target, after the
pair's held-out prompts (the rows it serves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec.core import row_kernel
from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams, process
from specdec.core.proposal import dense_q, propose_step, quantise
from specdec.core.rng import Stream, seed_tensor, uniform
from specdec.core.sampling import apply_processors, batched_probs, sample_inverse_cdf
from specdec.core.verify import DraftBlock, verify_block, verify_logits

GAMMA, K = 4, 32
REPEATS = {1: 100, 16: 5}  # timed calls per case by batch (3 beyond): sub-ms cases need more
MODES = {"greedy": SamplingParams(), "sampling": SamplingParams(temperature=0.8, top_p=0.95)}


def llm_like(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """A Gaussian tail (σ = 2) and 8 strong tokens 8–22 nats above it: rows range from
    peaked (a nucleus of a few tokens) to flat (thousands), as a model's positions do."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    top = torch.randint(0, vocab, (rows, 8), generator=gen)
    strength = 8.0 + 14.0 * torch.rand(rows, 1, generator=gen)
    return x.scatter_add(1, top, strength * (0.6 + 0.4 * torch.rand(rows, 8, generator=gen)))


def timed(fn, repeat: int) -> float:
    """Median wall time of fn() in ms after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def dense_draft_step(logits, params, seeds, positions):
    """The draft step as it was: processors, float64 softmax and quantised top-K per row."""
    probs = apply_processors(logits, params[0]).double().softmax(dim=-1)
    ids, weights = quantise(probs, K)
    choice = sample_inverse_cdf(weights, uniform(seeds, positions, Stream.DRAFT))
    return ids.gather(1, choice[:, None])


def case_inputs(vocab: int, batch: int, mode: str) -> dict:
    """What `case` times (also bench/gpu_math.py, on a GPU): LLM-like draft and target
    logits, the draft's candidates and sparse q̃, seeds and positions, on the CPU."""
    params = [MODES[mode]] * batch
    greedy = params[0].greedy
    seeds, base = seed_tensor(range(batch)), torch.arange(batch) * 7
    draft_logits = llm_like(batch, vocab, seed=1)
    target = llm_like(batch * (GAMMA + 1), vocab, seed=2).reshape(batch, GAMMA + 1, vocab)
    step = propose_step(draft_logits, params, seeds, base, K, [greedy] * batch)
    candidates = step.tokens[:, None].repeat(1, GAMMA)
    if greedy:
        q_ids, q_w = candidates[..., None], torch.ones(batch, GAMMA, 1, dtype=torch.float64)
    else:
        q_ids = step.dist_ids[:, None].repeat(1, GAMMA, 1)
        q_w = step.dist_weights[:, None].repeat(1, GAMMA, 1).double()
    return {
        "params": params,
        "greedy": greedy,
        "seeds": seeds,
        "base": base,
        "draft_logits": draft_logits,
        "target": target,
        "candidates": candidates,
        "num": torch.full((batch,), GAMMA),
        "q_ids": q_ids,
        "q_w": q_w,
        "mask": torch.full((batch,), greedy),
    }


def case(vocab: int, batch: int, mode: str, dense: bool, repeat: int) -> dict:
    x = case_inputs(vocab, batch, mode)
    params, greedy, seeds, base = x["params"], x["greedy"], x["seeds"], x["base"]
    draft_logits, target, candidates = x["draft_logits"], x["target"], x["candidates"]
    q_ids, q_w, mask = x["q_ids"], x["q_w"], x["mask"]
    block = DraftBlock(candidates, x["num"], q_ids, q_w)
    sampling = ProcessorParams.of([] if greedy else params)
    row = {"vocab": vocab, "batch": batch, "mode": mode}
    row["verify_ms"] = timed(
        lambda: verify_logits(target, mask, sampling, block, seeds, base), repeat
    )
    if not greedy:
        # the synthetic target rows are unrelated to the draft, so most candidates are
        # rejected at once and few rows are processed; the worst case — every candidate
        # accepted, all γ+1 rows of every session processed — gets the candidate's logit
        # raised far above the rest at each position
        done = verify_logits(target, mask, sampling, block, seeds, base).num_accepted
        row["rows_processed"] = float((done + 1).sum()) / (batch * (GAMMA + 1))
        boosted = target.clone()
        boosted[:, :GAMMA].scatter_add_(
            2,
            candidates[..., None],
            torch.full_like(candidates[..., None], 40.0, dtype=boosted.dtype),
        )
        accepted = verify_logits(boosted, mask, sampling, block, seeds, base).num_accepted
        row["all_accepted_share"] = float((accepted == GAMMA).double().mean())
        row["verify_all_accepted_ms"] = timed(
            lambda: verify_logits(boosted, mask, sampling, block, seeds, base), repeat
        )
    row["draft_step_ms"] = timed(
        lambda: propose_step(draft_logits, params, seeds, base, K, [greedy] * batch), repeat
    )
    if not greedy:
        kept = process(target.reshape(-1, vocab), sampling.repeat_rows(GAMMA + 1)).tau
        z = target.reshape(-1, vocab) / params[0].temperature
        sizes = (z >= kept[:, None]).sum(-1).double()
        row["nucleus_mean"], row["nucleus_median"] = float(sizes.mean()), float(sizes.median())
    if dense:

        def dense_verify():
            p = batched_probs(target, params)
            q = dense_q(q_ids, q_w, vocab)
            return verify_block(p, q, candidates, torch.full((batch,), GAMMA), seeds, base)

        row["dense_verify_ms"] = timed(dense_verify, max(1, repeat // 3))
        if not greedy:
            row["dense_draft_step_ms"] = timed(
                lambda: dense_draft_step(draft_logits, params, seeds, base), max(1, repeat // 3)
            )
    return row


def model_share(model_dir: str, batch: int = 16, prompt_len: int = 96) -> list[dict]:
    """The verify math against the same pass's target forward, on the model's real logits:
    after random token ids (the model's rows then are flat: its worst case) and, for the
    target of a bench pair, after that pair's held-out prompts (its rows as served)."""
    from specdec.engine.model import ModelRuntime, RuntimeSettings

    runtime = ModelRuntime(RuntimeSettings(model_dir, threads=torch.get_num_threads()))
    gen = torch.Generator().manual_seed(3)
    prompts = {
        "random ids": [
            torch.randint(1, runtime.vocab_size, (prompt_len,), generator=gen).tolist()
            for _ in range(batch)
        ]
    }
    held_out = pair_prompts(model_dir, batch, prompt_len)
    if held_out:
        prompts["held-out text"] = held_out
    return [row for kind, ids in prompts.items() for row in _share(runtime, kind, ids)]


def pair_prompts(model_dir: str, count: int, prompt_len: int) -> list[list[int]] | None:
    """`count` held-out prompts of the bench pair whose target `model_dir` is (`bench.run`'s
    chat questions or standard-library files), as `specdec bench` sends them; None for a
    model of no pair."""
    from transformers import AutoTokenizer

    from bench.contenders import PAIRS, chat_prompts
    from bench.prompts import heldout_prompts
    from specdec.catalog import CATALOG, cached_dir

    for target, draft, source in PAIRS.values():
        path = cached_dir(CATALOG[target]) if target in CATALOG else Path(target)
        if path.resolve() != Path(model_dir).resolve():
            continue
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if source == "chat":
            ids = chat_prompts(tokenizer, draft, count)[0]
        else:
            ids = heldout_prompts(tokenizer, count, prompt_len, source)[0]
        return ids if len(ids) == count else None
    return None


def _share(runtime, kind: str, prompts: list[list[int]]) -> list[dict]:
    from specdec.engine.kv import KVSession

    batch = len(prompts)
    sessions = []
    for i, prompt in enumerate(prompts):
        session = KVSession(str(i))
        session.sync(list(prompt))
        runtime.forward([session], [session.pending()[:-1]], keep=1)
        sessions.append(session)
    blocks = [s.pending() + [int(t) for t in torch.randint(1, 99, (GAMMA,))] for s in sessions]
    lengths = [s.kv_len for s in sessions]

    def forward():
        for s, n in zip(sessions, lengths):
            s.kv_len, s.tokens = n, s.tokens[: n + 1]
        return runtime.forward(sessions, blocks, keep=GAMMA + 1)

    logits = forward()
    rows = []
    for mode, params in MODES.items():
        greedy = params.greedy
        seeds, base = seed_tensor(range(batch)), torch.tensor(lengths) + 1
        step = propose_step(logits[:, 0], [params] * batch, seeds, base, K, [greedy] * batch)
        candidates = torch.tensor([b[1:] for b in blocks])
        if greedy:
            q_ids, q_w = candidates[..., None], torch.ones(batch, GAMMA, 1, dtype=torch.float64)
        else:
            q_ids = step.dist_ids[:, None].repeat(1, GAMMA, 1)
            q_w = step.dist_weights[:, None].repeat(1, GAMMA, 1).double()
            q_ids[:, :, 0], q_w[:, :, 0] = candidates, 1.0  # each candidate inside its q̃
        block = DraftBlock(candidates, torch.full((batch,), GAMMA), q_ids, q_w)
        sampling = ProcessorParams.of([] if greedy else [params] * batch)
        mask = torch.full((batch,), greedy)
        args = (logits, mask, sampling, block, seeds, base)
        math_ms = timed(lambda args=args: verify_logits(*args), 5)
        forward_ms = timed(forward, 3)
        rows.append(
            {
                "model": Path(runtime.settings.model_dir).name,
                "prompts": kind,
                "vocab": runtime.vocab_size,
                "mode": mode,
                "batch": batch,
                "forward_ms": forward_ms,
                "verify_math_ms": math_ms,
                "share": math_ms / forward_ms,
            }
        )
    return rows


def markdown(rows: list[dict], shares: list[dict], threads: int) -> str:
    fmt = lambda x: "—" if x is None else f"{x:.2f}" if x < 1 else f"{x:.1f}"  # noqa: E731
    out = [
        f"Per-pass math, {threads} CPU thread(s), γ = {GAMMA}, K = {K}; median ms.",
        "",
        "| vocab | batch | mode | verify pass | rows processed | verify, all accepted "
        "| draft step | dense verify (before) | dense draft step (before) "
        "| nucleus mean / median |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r.get("rows_processed")
        out.append(
            f"| {r['vocab']:,} | {r['batch']} | {r['mode']} | {fmt(r['verify_ms'])} "
            f"| {'—' if share is None else f'{100 * share:.0f} %'} "
            f"| {fmt(r.get('verify_all_accepted_ms'))} "
            f"| {fmt(r['draft_step_ms'])} | {fmt(r.get('dense_verify_ms'))} "
            f"| {fmt(r.get('dense_draft_step_ms'))} "
            f"| {fmt(r.get('nucleus_mean'))} / {fmt(r.get('nucleus_median'))} |"
        )
    if shares:
        out += [
            "",
            "| model | prompts | vocab | mode | batch | target forward | verify math "
            "| math / forward |",
            "|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in shares:
            out.append(
                f"| {r['model']} | {r['prompts']} | {r['vocab']:,} | {r['mode']} | {r['batch']} "
                f"| {r['forward_ms']:.1f} | {r['verify_math_ms']:.1f} | {100 * r['share']:.1f} % |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench math", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/math")
    p.add_argument("--quick", action="store_true", help="vocab 8k and 128k, batch 1 and 16")
    p.add_argument("--model", action="append", default=[], help="also time against this model")
    p.add_argument(
        "--sampling-kernel",
        default="auto",
        choices=row_kernel.KERNELS,
        help="rows past the window on a CPU: the compiled kernel or torch's ops (the workers' flag)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row_kernel.select(args.sampling_kernel)
    if args.model:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # "sequence longer than the model" on whole files
    vocabs = (8192, 128256) if args.quick else (8192, 49152, 128256, 262144)
    batches = (1, 16) if args.quick else (1, 16, 64)
    rows = []
    with torch.inference_mode():
        for vocab in vocabs:
            for batch in batches:
                for mode in MODES:
                    dense = batch <= 16 and vocab <= 131072
                    repeat = REPEATS.get(batch, 3)
                    rows.append(case(vocab, batch, mode, dense, repeat=repeat))
                    print(json.dumps(rows[-1]), flush=True)
        shares = [r for model in args.model for r in model_share(model)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "math.json").write_text(json.dumps({"rows": rows, "shares": shares}, indent=2))
    text = markdown(rows, shares, args.threads)
    (out / "math.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

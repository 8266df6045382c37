"""Load against the local stack: how much it holds, and that the caps hold past it.

    python -m bench.load [--requests 1000] [--concurrency 64] [--over 160] [--out results/load]
                                                                  (also: specdec bench load)

Closed-loop clients over the public gRPC API, on the demo pair: mixed prompt lengths (4–200
tokens) and output lengths (8–96), greedy and sampling, one request in ten cancelled
mid-stream, one in twenty over a limit (too many stop strings, a prompt past the context).
Phase 1 runs at `--concurrency`, below the coordinator's caps; phase 2 at `--over`, above
`--max-streams` (set to 128 here), where the documented RESOURCE_EXHAUSTED is the only new
error. Reports requests/s, tokens/s, TTFT and TPOT p50/p99, errors by status code, and each
process's RSS after warm-up and at the end (peak and growth).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import statistics
import time
from pathlib import Path

import grpc

from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

MAX_STREAMS = 128
PHASES = ("below_caps", "above_caps")


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident set of a process, MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def make_request(rng: random.Random, i: int, vocab: int):
    """(request, cancel_after_tokens or None, expected_code or None)."""
    prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 200))]
    sampling = common_pb2.SamplingParams(max_new_tokens=rng.randint(8, 96), ignore_eos=True)
    if i % 2:
        sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.95, i
    expected = None
    if i % 20 == 7:
        sampling.stop.extend(["x"] * 40)
        expected = grpc.StatusCode.INVALID_ARGUMENT
    elif i % 20 == 13:
        prompt = prompt * 20  # past the context of the target
        expected = grpc.StatusCode.INVALID_ARGUMENT
    cancel = rng.randint(1, 6) if i % 10 == 3 and expected is None else None
    return (
        coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling),
        cancel,
        expected,
    )


async def one(stub, request, cancel_after, timeout_s: float) -> dict:
    start = time.perf_counter()
    first, tokens = None, 0
    call = stub.GenerateStream(request, timeout=timeout_s)
    try:
        async for chunk in call:
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            tokens += len(chunk.token_ids)
            if cancel_after is not None and tokens >= cancel_after:
                call.cancel()
                return {"code": "CANCELLED (by the client)", "tokens": tokens}
        end = time.perf_counter()
        return {
            "code": "OK",
            "tokens": tokens,
            "ttft_ms": 1000 * ((first or end) - start),
            "tpot_ms": 1000 * (end - (first or end)) / max(tokens - 1, 1),
        }
    except grpc.aio.AioRpcError as exc:
        why = re.sub(r"[0-9.]+", "N", (exc.details() or "")[:70])  # group by message kind
        return {"code": exc.code().name, "tokens": tokens, "why": f"{exc.code().name}: {why}"}


async def phase(address: str, requests: list, concurrency: int, timeout_s: float) -> dict:
    """Closed-loop clients; above --max-streams its RESOURCE_EXHAUSTED is expected."""
    cap_code = "RESOURCE_EXHAUSTED" if concurrency > MAX_STREAMS else None
    queue = collections.deque(requests)
    results = []

    async def worker():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            while queue:
                request, cancel, expected = queue.popleft()
                result = await one(stub, request, cancel, timeout_s)
                result["expected"] = expected.name if expected else None
                results.append(result)
                if len(results) % 50 == 0:
                    print(f"  {len(results)}/{len(requests)} requests", flush=True)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ok = [r for r in results if r["code"] == "OK"]
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else None  # noqa: E731
    ttft, tpot = [r["ttft_ms"] for r in ok], [r["tpot_ms"] for r in ok]
    unexpected = collections.Counter(
        r["code"]
        for r in results
        if r["code"] not in ("OK", "CANCELLED (by the client)", r["expected"], cap_code)
    )
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
        "codes": dict(collections.Counter(r["code"] for r in results)),
        "reasons": dict(collections.Counter(r["why"] for r in results if "why" in r)),
        "unexpected": dict(unexpected),
    }


def main(argv: list[str] | None = None) -> int:
    from specdec.launcher.stack import Stack, StackSettings
    from specdec.text.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="specdec bench load", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--over", type=int, default=160, help="phase 2 concurrency, above the cap")
    p.add_argument("--over-requests", type=int, default=400)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--target-model", default="models/target")
    p.add_argument("--draft-model", default="models/draft")
    p.add_argument("--out", default="results/load")
    args = p.parse_args(argv)
    vocab = len(load_tokenizer(args.target_model))
    rng = random.Random(0)
    settings = StackSettings(
        args.target_model,
        args.draft_model,
        port=0,
        coordinator_args=["--max-streams", str(MAX_STREAMS)],
    )
    report = {"command": "python -m bench.load " + " ".join(argv or [])}
    with Stack(settings) as stack:
        warm = [make_request(rng, i, vocab) for i in range(16)]
        asyncio.run(phase(stack.address, [w for w in warm if w[2] is None], 8, args.timeout_s))
        pids = {c.name: c.process.pid for c in stack.children}
        report["rss_after_warmup_mb"] = {n: rss_mb(pid)[0] for n, pid in pids.items()}
        below = [make_request(rng, i, vocab) for i in range(args.requests)]
        report["below_caps"] = asyncio.run(
            phase(stack.address, below, args.concurrency, args.timeout_s)
        )
        over = [make_request(rng, i, vocab) for i in range(args.over_requests)]
        report["above_caps"] = asyncio.run(phase(stack.address, over, args.over, args.timeout_s))
        report["rss_end_mb"] = {n: rss_mb(pid)[0] for n, pid in pids.items()}
        report["rss_peak_mb"] = {n: rss_mb(pid)[1] for n, pid in pids.items()}
        report["dead_processes"] = [c.name for c in stack.dead_children()]
        if any(report[k]["unexpected"].keys() - {"RESOURCE_EXHAUSTED"} for k in PHASES):
            report["logs"] = {c.name: c.tail(80) for c in stack.children}  # to diagnose
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What TLS costs: the same requests through a plaintext stack and a stack with every control
on (TLS to the public API, mTLS between the tiers, API keys, a Redis password).

    python -m bench.tls [--requests 12] [--tokens 64] [--gamma 4] [--repeats 2]
                        [--target-model models/target] [--draft-model models/draft]
                        [--out results/tls]                         (also: specdec bench tls)

The two stacks run one after the other, in the order plain, secure, plain, secure, … (so a
drift of the machine shows up in both), each with the target and the draft worker on one
thread. Per stack: greedy requests at concurrency 1 with a fixed γ over one client channel
(its TLS handshake is paid once, as a real client's is), reporting ms per round (the
coordinator's own round timing, stats.total_time / rounds), ms per token and TTFT; and the
bare cost of one worker RPC (`Info`, 300 calls on one channel) with and without mTLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.report import save
from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.security import ClientTLS
from specdec.serving.server import channel
from specdec.v1 import common_pb2, target_pb2_grpc

PROMPTS = ["def add(a, b):", "import os\n", "class Point:\n    def", "for i in range(10):\n"]
API_KEY = "bench-key"


def rpc_cost_ms(stack: Stack, calls: int) -> float:
    """Median milliseconds of one Info call to the target worker on one open channel."""

    async def go() -> float:
        tls = None
        if stack.ca is not None:
            cert, key = stack.ca.issue("bench-client")
            tls = ClientTLS(stack.ca.cert_path, cert, key)
        ch = channel(stack.target_addresses[0], tls)
        stub = target_pb2_grpc.TargetWorkerStub(ch)
        await stub.Info(common_pb2.InfoRequest(), timeout=10)  # connect + handshake
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await stub.Info(common_pb2.InfoRequest(), timeout=10)
            times.append(time.perf_counter() - t0)
        await ch.close()
        return statistics.median(times) * 1000

    return asyncio.run(go())


def measure(stack: Stack, args) -> dict:
    rounds_ms, token_ms, ttft_ms = [], [], []
    with Client(stack.address, timeout_s=300, **stack.client_options()) as client:
        client.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)  # warm-up
        for i in range(args.requests):
            prompt = PROMPTS[i % len(PROMPTS)]
            out = client.generate(
                prompt,
                max_new_tokens=args.tokens,
                ignore_eos=True,
                temperature=0.0,
                num_speculative_tokens=args.gamma,
            )
            s = out.stats
            rounds_ms.append(s.total_time_ms / max(1, s.rounds))
            token_ms.append(s.total_time_ms / max(1, s.generated_tokens))
            ttft_ms.append(s.time_to_first_token_ms)
    return {
        "round_ms": statistics.median(rounds_ms),
        "token_ms": statistics.median(token_ms),
        "ttft_ms": statistics.median(ttft_ms),
        "rpc_ms": rpc_cost_ms(stack, args.rpc_calls),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specdec bench tls", description=__doc__)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rpc-calls", type=int, default=300)
    p.add_argument("--target-model", default="models/target")
    p.add_argument("--draft-model", default="models/draft")
    p.add_argument("--out", default="results/tls")
    args = p.parse_args(argv)
    runs: dict[str, list[dict]] = {"plaintext": [], "tls+mtls+keys": []}
    for repeat in range(args.repeats):
        for name in runs:
            secure = name != "plaintext"
            settings = StackSettings(
                args.target_model,
                args.draft_model,
                port=0,
                tls=secure,
                api_keys=[API_KEY] if secure else [],
            )
            with Stack(settings) as stack:
                result = measure(stack, args)
            runs[name].append(result)
            print(f"repeat {repeat} {name:14s} " + json.dumps(result), flush=True)
    table = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    plain, secure = table["plaintext"], table["tls+mtls+keys"]
    lines = [
        f"# TLS cost: {args.requests} greedy requests × {args.tokens} tokens, γ = {args.gamma}, "
        f"concurrency 1, target and draft 1 thread each, median of {args.repeats} runs per stack",
        "",
        "| stack | ms / round | ms / token | TTFT ms | worker RPC (Info) ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in table.items():
        lines.append(
            f"| {name} | {row['round_ms']:.2f} | {row['token_ms']:.2f} | {row['ttft_ms']:.1f} | "
            f"{row['rpc_ms']:.3f} |"
        )
    lines += [
        "",
        f"TLS cost per round: {secure['round_ms'] - plain['round_ms']:+.2f} ms "
        f"({secure['round_ms'] / plain['round_ms']:.3f}×); per worker RPC: "
        f"{secure['rpc_ms'] - plain['rpc_ms']:+.3f} ms.",
    ]
    save(args.out, "tls", "\n".join(lines), {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

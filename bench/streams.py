"""What worker call streams give: the same requests through two coordinators of one stack,
one carrying Propose and Verify on a stream per worker (`--worker-streams`, the default) and
one making unary calls (`--no-worker-streams`), alternating.

    python -m bench.streams [--prompts 6] [--tokens 96] [--repeats 3]
                            [--target-model models/target] [--draft-model models/draft]
                            [--out results/streams]              (also: specdec bench streams)

Both coordinators share the workers and Redis (target and draft worker one thread each), so
only the transport differs; they alternate streams, unary, streams, … and each table entry
is the median over the repeats. Per (mode, γ) at concurrency 1 (`bench.pipeline.measure`:
the held-out code-pair prompts, greedy and sampling at T = 0.8, top-p 0.95, seeded; γ = 2, 4
and adaptive): the decode rate and whether the greedy outputs are identical (they must be).

Through the whole stack the difference (about a millisecond per round) is within this
machine's run-to-run noise, so the same stack's workers are also driven directly, as the
coordinator drives them (Propose γ = 4, then Verify with the accepted prefix as the next
delta, greedy, one session), alternating a `CallLane` per worker with unary calls: per call
the client's time minus the worker's forward (gRPC, protobuf, the handler's checks and the
batcher's hand-off), median over the rounds after the third.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import grpc

from bench.pipeline import held_out, measure, pair_arguments
from bench.report import save
from specdec.core.prefix import fingerprint
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.callstream import CallLane
from specdec.serving.redis_embedded import free_port
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

GREEDY = common_pb2.SamplingParams()


async def direct_overheads(
    draft_addr: str, target_addr: str, prompt: list[int], lanes: bool, rounds: int = 80
) -> tuple[float, float]:
    """Median ms per Propose and per Verify call beyond the worker's forward, with call
    streams (`lanes`) or unary calls."""
    async with (
        grpc.aio.insecure_channel(draft_addr) as dch,
        grpc.aio.insecure_channel(target_addr) as tch,
    ):
        draft, target = draft_pb2_grpc.DraftWorkerStub(dch), target_pb2_grpc.TargetWorkerStub(tch)
        propose, verify = draft.Propose, target.Verify
        if lanes:
            propose = CallLane(draft.ProposeStream, draft.Propose, draft_pb2.ProposeCall)
            verify = CallLane(target.VerifyStream, target.Verify, target_pb2.VerifyCall)
        session = f"bench-streams-{lanes}-{time.monotonic_ns()}"
        history, held, costs = list(prompt), 0, ([], [])
        for i in range(rounds):
            base = common_pb2.Base(
                session_id=session,
                epoch=1,
                base_len=len(history),
                base_fingerprint=fingerprint(history),
            )
            delta = common_pb2.TokenDelta(start=held, token_ids=history[held:])
            t0 = time.perf_counter()
            proposal = await propose(
                draft_pb2.ProposeRequest(
                    base=base, delta=delta, num_speculative_tokens=4, sampling=GREEDY
                ),
                timeout=60,
            )
            t1 = time.perf_counter()
            verdict = await verify(
                target_pb2.VerifyRequest(
                    base=base,
                    delta=delta,
                    candidate_ids=proposal.candidate_ids,
                    sampling=GREEDY,
                    max_output_tokens=1 << 20,
                ),
                timeout=60,
            )
            t2 = time.perf_counter()
            held = len(history) + verdict.num_accepted
            history += list(verdict.output_ids)
            if i >= 3:
                costs[0].append(1e3 * (t1 - t0) - proposal.forward_ns / 1e6)
                costs[1].append(1e3 * (t2 - t1) - verdict.forward_ns / 1e6)
        for lane in (propose, verify):
            if isinstance(lane, CallLane):
                await lane.close()
    return statistics.median(costs[0]), statistics.median(costs[1])


def main(argv: list[str] | None = None) -> int:
    args = pair_arguments("streams", __doc__, 6, 3, "results/streams").parse_args(argv)
    prompts = held_out(args)
    runs: dict[str, list[dict]] = {"streams": [], "unary": []}
    with Stack(StackSettings(args.target_model, args.draft_model, port=0)) as stack:
        unary = free_port()
        stack.add_coordinator(unary, extra=["--no-worker-streams"])
        address = {"streams": stack.address, "unary": f"{stack.settings.host}:{unary}"}
        for repeat in range(args.repeats):
            for name, runs_of in runs.items():
                runs_of.append(measure(address[name], prompts, args.tokens))
                rates = {k: round(v["tokens_per_s"], 1) for k, v in runs_of[-1].items()}
                print(f"repeat {repeat} {name}: {json.dumps(rates)}", flush=True)
        direct: dict[str, list[tuple[float, float]]] = {"streams": [], "unary": []}
        for repeat in range(args.repeats):
            for name in direct:
                ends = (stack.draft_addresses[0], stack.target_addresses[0])
                prompt = prompts[repeat % len(prompts)]
                direct[name].append(asyncio.run(direct_overheads(*ends, prompt, name == "streams")))
                print(f"direct {repeat} {name}: {direct[name][-1]}", flush=True)
    lines = [
        f"# Worker call streams: {args.prompts} held-out prompts × {args.tokens} tokens, "
        f"concurrency 1, target and draft 1 thread each, median of {args.repeats} runs",
        "",
        "| mode | γ | tok/s unary | tok/s streams | streams / unary | greedy outputs equal |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key in runs["unary"][0]:
        mode, gamma = key.split("/")
        rate = {n: statistics.median(r[key]["tokens_per_s"] for r in runs[n]) for n in runs}
        outputs = [r[key]["outputs"] for n in runs for r in runs[n]]
        same = "yes" if all(o == outputs[0] for o in outputs) else "no"
        lines.append(
            f"| {mode} | {'adaptive' if gamma == 'None' else gamma} | {rate['unary']:.1f} | "
            f"{rate['streams']:.1f} | {rate['streams'] / rate['unary']:.3f}× | "
            f"{same if mode == 'greedy' else '—'} |"
        )
    lines += [
        "",
        "Per call beyond the worker's forward (ms; workers driven directly, greedy, γ = 4):",
        "",
        "| call | unary | streams | saved |",
        "|---|---:|---:|---:|",
    ]
    for i, call in enumerate(("Propose", "Verify")):
        ms = {n: statistics.median(r[i] for r in direct[n]) for n in direct}
        lines.append(
            f"| {call} | {ms['unary']:.2f} | {ms['streams']:.2f} | "
            f"{ms['unary'] - ms['streams']:.2f} |"
        )
    save(
        args.out,
        "streams",
        "\n".join(lines),
        {"args": vars(args), "runs": runs, "direct": direct},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

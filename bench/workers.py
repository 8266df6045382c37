"""Worker tiers on their own: batched verification against one session at a time, and the
draft tier with and without cross-session batching.

    python -m bench.workers [--quick] [--threads N] [--out results/workers.json]

Models: the committed demo pair (models/target, models/draft) when both are built, else the
tiny test models of tests/tiny_models.py written to a temporary directory. Workers run
in-process on 127.0.0.1 (one background event loop, one model thread each, `--threads`
torch intra-op threads); the client is a grpc.aio loop in the main thread of the same process.

Verify: B sessions (prompts of 48-96 tokens from stdlib files, greedy, γ = 4 draft candidates
proposed untimed before each round) are verified by a target worker whose batch closes at B
sessions, all B calls at once; the same requests then go one at a time to a target worker
with max_batch_size = 1. Both must give identical greedy outputs. Throughput counts verified
positions (γ + 1 per session per round) and output tokens (accepted + 1) per second.

Draft: 32 sessions propose γ = 4 candidates per round concurrently (each session then
commits its own candidates), once with max_batch_size = 1 and once with 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.prompts import heldout_files
from specdec.core.prefix import fingerprint
from specdec.serving.server import Server, channel
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
BATCH_SIZES = (1, 4, 16, 32)
DRAFT_SESSIONS = 32
GAMMA = 4
TIMEOUT_S = 120.0
GREEDY = common_pb2.SamplingParams()


def model_pair(tmp: str) -> tuple[str, str, str]:
    """(target dir, draft dir, description): the demo pair if built, else tiny models."""
    target, draft = ROOT / "models" / "target", ROOT / "models" / "draft"
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return str(target), str(draft), "demo pair (models/target, models/draft)"
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_model_dirs

    dirs = build_model_dirs(tmp)
    return dirs["target"], dirs["draft"], "tiny test models (tests/tiny_models.py)"


def prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts of 48..96 tokens: windows of stdlib files (held-out ones if listed)."""
    files, _ = heldout_files(str(ROOT / "models" / "heldout_files.txt"))
    windows = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        for start in range(len(ids) // 3, len(ids) - 96, 400)[:4]:
            windows.append([int(t) for t in ids[start : start + 96]])
        if len(windows) >= count:
            break
    lengths = [48, 64, 80, 96]
    return [windows[i % len(windows)][: lengths[i % 4]] for i in range(count)]


class ServerLoop:
    """One event loop in a background thread that serves every worker of the benchmark."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def run(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@asynccontextmanager
async def worker(servers: ServerLoop, role: str, settings):
    """A draft or target worker on 127.0.0.1:0 and a grpc.aio stub on the client loop."""
    if role == "target":
        from target_worker.__main__ import build

        name, stub_cls = (
            "specdec.v1.TargetWorker",
            target_pb2_grpc.TargetWorkerStub,
        )
    else:
        from draft_worker.__main__ import build

        name, stub_cls = (
            "specdec.v1.DraftWorker",
            draft_pb2_grpc.DraftWorkerStub,
        )
    service = build(settings)  # loads the model in this thread

    async def start():
        server = Server([name])
        server.add(service, name)
        port = server.bind("127.0.0.1", 0)
        await server.start()
        service.batcher.start()
        return server, port

    server, port = await servers.run(start())
    async with channel(f"127.0.0.1:{port}") as chan:
        yield stub_cls(chan)

    async def stop():
        await server.server.stop(0)
        await service.batcher.stop()

    await servers.run(stop())


@dataclass
class Session:
    sid: str
    history: list[int]
    held: int = 0  # both workers hold history[:held] (delta rule: base_len + accepted)

    def base(self, sid: str | None = None) -> common_pb2.Base:
        return common_pb2.Base(
            session_id=sid or self.sid,
            epoch=1,
            base_len=len(self.history),
            base_fingerprint=fingerprint(self.history),
        )

    def delta(self) -> common_pb2.TokenDelta:
        return common_pb2.TokenDelta(start=self.held, token_ids=self.history[self.held :])


async def propose_all(stub, sessions: list[Session]) -> list:
    return await asyncio.gather(
        *[
            stub.Propose(
                draft_pb2.ProposeRequest(
                    base=s.base(), delta=s.delta(), num_speculative_tokens=GAMMA, sampling=GREEDY
                ),
                timeout=TIMEOUT_S,
            )
            for s in sessions
        ]
    )


def verify_request(session: Session, proposal, suffix: str) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        base=session.base(session.sid + suffix),
        delta=session.delta(),
        candidate_ids=proposal.candidate_ids,
        sampling=GREEDY,
    )


async def bench_verify(servers, target_settings, draft_stub, tokenizer, batch, rounds) -> dict:
    """One batch size: the same rounds verified together and one at a time."""
    sessions = [Session(f"v{batch}-{i}", p) for i, p in enumerate(prompts(tokenizer, batch))]
    together = replace(target_settings, max_batch_size=batch, max_wait_ms=50.0)
    alone = replace(target_settings, max_batch_size=1, max_wait_ms=0.0)
    times = {"batched": 0.0, "single": 0.0}
    positions = outputs = mismatches = 0
    batch_sizes: list[int] = []
    async with (
        worker(servers, "target", together) as batched,
        worker(servers, "target", alone) as single,
    ):
        for round_index in range(rounds + 1):  # round 0 prefills the prompts, untimed
            proposals = await propose_all(draft_stub, sessions)
            requests = [verify_request(s, p, "-b") for s, p in zip(sessions, proposals)]
            start = time.perf_counter()
            results = await asyncio.gather(
                *[batched.Verify(r, timeout=TIMEOUT_S) for r in requests]
            )
            batched_s = time.perf_counter() - start
            start = time.perf_counter()
            references = []
            for s, p in zip(sessions, proposals):
                references.append(
                    await single.Verify(verify_request(s, p, "-1"), timeout=TIMEOUT_S)
                )
            single_s = time.perf_counter() - start
            for s, ours, ref in zip(sessions, results, references):
                mismatches += list(ours.output_ids) != list(ref.output_ids)
                s.held = len(s.history) + ref.num_accepted
                s.history += list(ref.output_ids)
            if round_index == 0:
                continue
            times["batched"] += batched_s
            times["single"] += single_s
            positions += sum(len(r.candidate_ids) + 1 for r in requests)
            outputs += sum(len(r.output_ids) for r in references)
            batch_sizes += [r.batch_size for r in results]
    return {
        "batch": batch,
        "rounds": rounds,
        "verified_positions": positions,
        "output_tokens": outputs,
        "batched_s": times["batched"],
        "single_s": times["single"],
        "batched_positions_per_s": positions / times["batched"],
        "single_positions_per_s": positions / times["single"],
        "batched_output_tokens_per_s": outputs / times["batched"],
        "single_output_tokens_per_s": outputs / times["single"],
        "speedup": times["single"] / times["batched"],
        "mean_batch_size": sum(batch_sizes) / len(batch_sizes),
        "greedy_mismatches": mismatches,
    }


async def bench_draft(servers, draft_settings, tokenizer, max_batch_size, rounds) -> dict:
    """DRAFT_SESSIONS sessions proposing concurrently; each commits its own candidates."""
    settings = replace(draft_settings, max_batch_size=max_batch_size, max_wait_ms=2.0)
    sessions = [
        Session(f"d{max_batch_size}-{i}", p)
        for i, p in enumerate(prompts(tokenizer, DRAFT_SESSIONS))
    ]
    elapsed, proposed, forwards = 0.0, 0, 0
    async with worker(servers, "draft", settings) as stub:
        for round_index in range(rounds + 1):  # round 0 prefills, untimed
            start = time.perf_counter()
            results = await propose_all(stub, sessions)
            seconds = time.perf_counter() - start
            for s, r in zip(sessions, results):
                s.held = len(s.history)  # the draft holds its own candidates
                s.history += list(r.candidate_ids)
            if round_index:
                elapsed += seconds
                proposed += sum(len(r.candidate_ids) for r in results)
                forwards += len({r.forward_ns for r in results})  # calls of one batch share it
    return {
        "max_batch_size": max_batch_size,
        "sessions": DRAFT_SESSIONS,
        "rounds": rounds,
        "proposed_tokens": proposed,
        "seconds": elapsed,
        "tokens_per_s": proposed / elapsed,
        "batches_per_round": forwards / rounds,
    }


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"Models: {meta['models']}; device {meta['device']}; torch intra-op threads "
        f"{meta['threads']} per worker; γ = {GAMMA}; greedy; {meta['rounds']} timed rounds.",
        "",
        "| sessions (batch) | verified pos/s batched | one at a time | speedup "
        "| output tok/s batched | one at a time | mean batch | greedy mismatches |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["verify"]:
        lines.append(
            f"| {r['batch']} | {r['batched_positions_per_s']:.0f} | "
            f"{r['single_positions_per_s']:.0f} | {r['speedup']:.2f}× | "
            f"{r['batched_output_tokens_per_s']:.0f} | {r['single_output_tokens_per_s']:.0f} | "
            f"{r['mean_batch_size']:.1f} | {r['greedy_mismatches']} |"
        )
    lines += [
        "",
        f"| draft tier, {DRAFT_SESSIONS} concurrent sessions | proposed tok/s | batches/round |",
        "|---|---:|---:|",
    ]
    for r in result["draft"]:
        label = "no cross-session batching" if r["max_batch_size"] == 1 else "batched"
        lines.append(
            f"| max_batch_size={r['max_batch_size']} ({label}) | {r['tokens_per_s']:.0f} | "
            f"{r['batches_per_round']:.1f} |"
        )
    lines.append(
        f"\nDraft batching speedup: {result['draft'][1]['tokens_per_s'] / result['draft'][0]['tokens_per_s']:.2f}×"
    )
    return "\n".join(lines)


async def run(args, target_dir: str, draft_dir: str, models: str) -> dict:
    from draft_worker.__main__ import DraftSettings
    from specdec.text.tokenizer import load_tokenizer
    from target_worker.__main__ import TargetSettings

    target_settings = TargetSettings(model=target_dir, device=args.device, threads=args.threads)
    draft_settings = DraftSettings(model=draft_dir, device=args.device, threads=args.threads)
    tokenizer = load_tokenizer(target_dir)
    rounds = 3 if args.quick else 10
    servers = ServerLoop()
    try:
        verify = []
        async with worker(servers, "draft", draft_settings) as draft_stub:
            for batch in BATCH_SIZES:
                row = await bench_verify(
                    servers, target_settings, draft_stub, tokenizer, batch, rounds
                )
                print(f"verify batch {batch}: {row['speedup']:.2f}× ({row['batched_s']:.2f}s)")
                verify.append(row)
        draft = []
        for max_batch_size in (1, DRAFT_SESSIONS):
            row = await bench_draft(servers, draft_settings, tokenizer, max_batch_size, rounds)
            print(f"draft max_batch_size {max_batch_size}: {row['tokens_per_s']:.0f} tok/s")
            draft.append(row)
    finally:
        servers.close()
    meta = {
        "models": models,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "gamma": GAMMA,
        "rounds": rounds,
        "quick": args.quick,
    }
    return {"meta": meta, "verify": verify, "draft": draft}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 timed rounds instead of 10")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--out", default=str(ROOT / "results" / "workers.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
        target_dir, draft_dir, models = model_pair(tmp)
        result = asyncio.run(run(args, target_dir, draft_dir, models))
    result["meta"]["wall_s"] = time.perf_counter() - started
    table = markdown(result)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "markdown": table}, indent=2))
    print(f"wrote {out} in {result['meta']['wall_s']:.0f}s")


if __name__ == "__main__":
    main()

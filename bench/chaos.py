"""Chaos benchmark: sessions that survive faults, token for token.

    python -m bench.chaos [--sessions 256] [--concurrency 64] [--max-new-tokens 48]
                          [--seed 1] [--out results/chaos] [--short]   (also: specdec bench chaos)

Every tier is its own process: a real redis-server (append-only file), 2 draft workers, 3
target workers (one of them in its own network namespace behind a veth pair), 2
coordinators. First a fault-free reference pass, then the same requests (new session ids)
while a seeded, bounded fault injector kills -9 and SIGSTOPs random drafts, targets and
coordinators (killed ones restart), restarts Redis (SIGTERM: the append-only file is synced at
shutdown) and pauses it (SIGSTOP), slows the namespaced target's link down and cuts it off.
One fault at a time; each is undone before the next. Clients resume with `session_id` and
`resume_from` on another coordinator after any retryable status.

Every finished session must equal its fault-free run token for token (greedy, and seeded
sampling at a fixed γ). Reported: sessions finished and exact, tokens lost and repeated, faults
by kind, resumes, errors by status code, time per output token p50/p99 with and without
faults. `--short` (fewer sessions, each fault kind once) is what `make test` runs.

The link faults use the kernel's own traffic control: this machine's kernel has no `netem`
(CONFIG_NET_SCH_NETEM is not set), so added latency comes from a token-bucket filter
(`tc qdisc … tbf`: a slow link whose queue delays every packet) instead of netem's delay and
loss; the cut is real (the veth goes down). Needs root, `ip` and `tc` (Debian's iproute2).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.chaos_faults import Injector, Link
from bench.chaos_report import compare, explain_greedy, markdown, passed, tpot_ms
from specdec.client import build_request
from specdec.launcher.stack import Child, Stack, StackSettings
from specdec.serving.redis_embedded import free_port
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
FAULTS = (
    "kill_draft",
    "kill_target",
    "kill_coordinator",
    "stop_draft",
    "stop_target",
    "stop_coordinator",
    "redis_restart",
    "redis_pause",
    "link_slow",
    "link_cut",
)
# What a client resumes after (any other status ends the session as an error).
RESUMABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
PROMPTS = (
    "def add(a, b):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self, item):",
    "for i in range(10):\n    ",
    'def read(path):\n    """Read a file."""\n',
    "try:\n    import json\nexcept ImportError:",
)


# --- the stack ----------------------------------------------------------------------------


class ChaosStack(Stack):
    """The stack plus a target worker inside the namespace, and restartable children."""

    def __init__(self, settings: StackSettings, link: Link):
        super().__init__(settings)
        self.link = link

    def start(self, progress=print) -> ChaosStack:
        port = free_port()
        address = f"{self.link.ns_ip}:{port}"
        self.target_addresses.append(address)  # static: every coordinator knows it
        env = dict(os.environ, OMP_NUM_THREADS="1", SPECDEC_REDIS_URL="")
        argv = [
            *self.link.exec_prefix(),
            sys.executable,
            "-m",
            "target_worker",
            "--model",
            self.settings.target_model,
            "--host",
            self.link.ns_ip,
            "--port",
            str(port),
            "--threads",
            "1",
            "--log-level",
            self.settings.log_level,
        ]
        self.children.append(Child("target-worker-ns", argv, env))
        super().start(progress)
        self._wait([self.child("target-worker-ns")], self.settings.startup_timeout_s)
        return self

    def restart(self, name: str) -> None:
        old = self.child(name)
        env = dict(os.environ, OMP_NUM_THREADS="1", SPECDEC_REDIS_URL=self.redis_url)
        if name == "target-worker-ns":
            env["SPECDEC_REDIS_URL"] = ""
        self.children[self.children.index(old)] = Child(name, old.argv, env)


# --- clients ------------------------------------------------------------------------------


@dataclass
class Request:
    index: int
    prompt: str
    temperature: float
    seed: int
    gamma: int
    max_new_tokens: int
    prompt_ids: list[int] = field(default_factory=list)  # sent instead of the text when set


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    target_only_rounds: int = 0  # rounds without candidates (the draft tier was out)
    resumes: int = 0
    repeated: int = 0  # chunks that overlapped what the client already had
    gaps: int = 0  # chunks that started past it
    times: list[float] = field(default_factory=list)  # arrival of each chunk's tokens

    def tpot(self) -> float | None:
        if len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) / (len(self.tokens) - 1)


def requests(n: int, max_new_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampled = i % 2 == 1
        out.append(
            Request(
                i,
                PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f"# {i}\n"),
                0.8 if sampled else 0.0,
                rng.randrange(1 << 31),
                2 + i % 3,
                max_new_tokens,
            )
        )
    return out


# A stream's deadline: well past a session's length at the run's concurrency on 2 cores
ATTEMPT_TIMEOUT_S = 600.0


async def run_one(
    req: Request, session_id: str, addresses: list[str], errors: collections.Counter
) -> Outcome:
    out = Outcome()
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [coordinator_pb2_grpc.CoordinatorStub(ch) for ch in channels]
    try:
        for attempt in range(40):
            stub = stubs[(req.index + attempt) % len(stubs)]
            request = build_request(
                req.prompt_ids or req.prompt,
                num_speculative_tokens=req.gamma,
                session_id=session_id,
                temperature=req.temperature,
                seed=req.seed,
                max_new_tokens=req.max_new_tokens,
                ignore_eos=True,
            )
            request.resume_from = len(out.tokens)
            try:
                async for chunk in stub.GenerateStream(request, timeout=ATTEMPT_TIMEOUT_S):
                    if chunk.offset < len(out.tokens):
                        out.repeated += 1
                    elif chunk.offset > len(out.tokens):
                        out.gaps += 1
                    now = time.monotonic()
                    for token in chunk.token_ids:
                        out.tokens.append(token)
                        out.times.append(now)
                    if chunk.finish_reason:
                        out.finish_reason = coordinator_pb2.FinishReason.Name(chunk.finish_reason)
                        out.target_only_rounds = chunk.stats.rounds - chunk.stats.drafts
                        # a session that did not run its course did not survive the faults
                        out.finished = out.finish_reason == "FINISH_REASON_LENGTH"
                        return out
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                if exc.code() not in RESUMABLE:
                    out.error = exc.code().name
                    return out
                out.resumes += 1
                await asyncio.sleep(min(2.0, 0.2 * (attempt + 1)))
        out.error = "too many resumes"
        return out
    finally:
        for ch in channels:
            await ch.close()


async def run_all(
    reqs: list[Request], prefix: str, addresses: list[str], concurrency: int
) -> tuple[dict[int, Outcome], collections.Counter]:
    errors: collections.Counter = collections.Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(req: Request) -> tuple[int, Outcome]:
        async with gate:
            return req.index, await run_one(req, f"{prefix}-{req.index}", addresses, errors)

    results = await asyncio.gather(*(one(r) for r in reqs))
    return dict(results), errors


def run(args, link: Link | None = None) -> dict:
    """The whole benchmark (root only); `link` defaults to the namespace specdec-chaos."""
    t0 = time.monotonic()
    link = (link or Link()).up()
    settings = StackSettings(
        args.target_model,
        args.draft_model,
        port=0,
        draft_workers=2,
        target_workers=2,
        persist_redis=True,
        log_level="error",
        coordinator_args=[
            "--lease-s",
            "1.0",
            "--draft-timeout-s",
            "2",
            "--worker-timeout-s",
            "20",
            "--max-starting",
            "64",
        ],
    )
    stack = ChaosStack(settings, link)
    try:
        stack.start(progress=lambda _m: None)
        second = free_port()
        stack.add_coordinator(second, name="coordinator-b")
        addresses = [stack.address, f"127.0.0.1:{second}"]
        reqs = requests(args.sessions, args.max_new_tokens, args.seed)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target_model)
        for req in reqs:  # token ids on the wire: the analysis below uses the same prompt
            req.prompt_ids = tokenizer.encode(req.prompt, add_special_tokens=False)
        # two fault-free passes: batching changes the last bits of a logit, which can flip
        # an exact near-tie (a documented limit of lossless); what differs between the two
        # shows how often that happens here, and a session under faults must equal one
        ref, ref_errors = asyncio.run(run_all(reqs, "ref", addresses, args.concurrency))
        ref2, ref2_errors = asyncio.run(run_all(reqs, "ref2", addresses, args.concurrency))
        ref_errors += ref2_errors
        if args.short:
            kinds = list(FAULTS)
        else:
            rng = random.Random(args.seed)
            kinds = list(FAULTS) + [rng.choice(FAULTS) for _ in range(args.faults - len(FAULTS))]
            rng.shuffle(kinds)
        injector = Injector(stack, args.seed, kinds, args.fault_gap_s)
        injector.start()
        waves, errors = [], collections.Counter()
        stop_at = time.monotonic() + 60 * args.max_minutes
        while not waves or (injector.is_alive() and time.monotonic() < stop_at):
            got, wave_errors = asyncio.run(
                run_all(reqs, f"chaos{len(waves)}", addresses, args.concurrency)
            )
            waves.append(got)
            errors += wave_errors
        injector.done.set()
        injector.join(60)
        outcomes = [o for wave in waves for o in wave.values()]
        report = {
            "command": " ".join(["python -m bench.chaos", *args.argv]),
            "seconds": time.monotonic() - t0,
            "stack": "2 draft workers, 3 target workers (1 in a network namespace), 2 coordinators",
            "models": f"{args.target_model} + {args.draft_model}",
            "sessions": args.sessions,
            "waves": len(waves),
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens,
            "reference": {
                **compare([ref], [ref2], reqs),
                "resumes": sum(o.resumes for o in [*ref.values(), *ref2.values()]),
                "errors": dict(ref_errors),
                "tpot_ms": tpot_ms(list(ref.values())),
            },
            "chaos": {
                **compare([ref, ref2], waves, reqs),
                "resumes": sum(o.resumes for o in outcomes),
                "errors": dict(errors),
                "client_errors": dict(collections.Counter(o.error for o in outcomes if o.error)),
                "tpot_ms": tpot_ms(outcomes),
            },
            "faults": dict(injector.injected),
            "faults_planned": len(kinds),
            "fault_log": injector.log,
            "injector_failure": injector.failure,
        }
        for part in ("reference", "chaos"):
            report[part]["greedy_divergences"] = explain_greedy(
                args.target_model, reqs, report[part]["mismatches"]
            )
        return report
    finally:
        stack.stop()
        link.fast()
        link.down()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument(
        "--faults", type=int, default=30, help="faults in all (each kind at least once)"
    )
    ap.add_argument("--fault-gap-s", type=float, default=4.0, help="mean pause between faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=30.0,
        help="bound on the faulty phase: passes over the sessions repeat while faults last",
    )
    ap.add_argument("--short", action="store_true", help="each fault kind once (make test)")
    ap.add_argument("--target-model", default=str(ROOT / "models" / "target"))
    ap.add_argument("--draft-model", default=str(ROOT / "models" / "draft"))
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "chaos")
    args = ap.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        print("bench.chaos needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "chaos.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`specdec` — one console script: up, draft-worker, target-worker, coordinator, generate, bench."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time

from specdec.serving.settings import env_default

USAGE = """usage: specdec COMMAND [flags]

commands:
  up              the whole local stack: embedded Redis, draft and target workers, coordinator
  draft-worker    serve the draft tier (a small model or n-gram lookup)
  target-worker   serve the target tier (batched verification)
  coordinator     serve the public API (sessions in Redis)
  generate        stream a completion from a coordinator
  bench           benchmarks against Hugging Face generate and assisted generation

`specdec COMMAND --help` lists a command's flags; every flag also reads SPECDEC_<FLAG>."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Commands served by a service (or bench) package: its entry module, imported only when run.
SERVICES = {
    "draft-worker": "draft_worker.__main__",
    "target-worker": "target_worker.__main__",
    "coordinator": "coordinator.__main__",
    "bench": "bench.run",
    "bench workers": "bench.workers",
    "bench math": "bench.math",
    "bench fuzz": "bench.fuzz",
    "bench load": "bench.load",
}


def demo_model(kind: str) -> str:
    return os.path.join(ROOT, "models", kind)


# --- specdec up ---------------------------------------------------------------------------


def up(argv: list[str]) -> int:
    from specdec.launcher.stack import Stack, StackError, StackSettings

    cores = os.cpu_count() or 2
    p = argparse.ArgumentParser(
        prog="specdec up", description="Run the whole local stack until Ctrl-C."
    )
    p.add_argument("--target-model", default=env_default("target-model", demo_model("target")))
    p.add_argument("--draft-model", default=env_default("draft-model", demo_model("draft")))
    p.add_argument("--port", type=int, default=env_default("port", 50051), help="coordinator port")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--draft-workers", type=int, default=env_default("draft-workers", 1))
    p.add_argument("--target-workers", type=int, default=env_default("target-workers", 1))
    p.add_argument("--draft-threads", type=int, default=env_default("draft-threads", 1))
    p.add_argument(
        "--target-threads", type=int, default=env_default("target-threads", max(1, cores - 1))
    )
    p.add_argument(
        "--proposer", choices=["model", "ngram"], default=env_default("proposer", "model")
    )
    p.add_argument(
        "--redis-url",
        default=env_default("redis-url", ""),
        help="external Redis (default: embedded)",
    )
    p.add_argument("--demo-prompt", default=env_default("demo-prompt", "def fibonacci(n):\n    "))
    p.add_argument("--no-demo", action="store_true", help="skip the demo completion")
    p.add_argument("--log-level", default=env_default("log-level", "warning"))
    args = p.parse_args(argv)
    for label, path in (("--target-model", args.target_model), ("--draft-model", args.draft_model)):
        if not os.path.isdir(path):
            print(
                f"specdec up: {label} {path} is not a directory (run `make models` or pass a model)",
                file=sys.stderr,
            )
            return 2
    stack = Stack(
        StackSettings(
            target_model=args.target_model,
            draft_model=args.draft_model,
            port=args.port,
            host=args.host,
            redis_url=args.redis_url,
            draft_workers=args.draft_workers,
            target_workers=args.target_workers,
            draft_threads=args.draft_threads,
            target_threads=args.target_threads,
            proposer=args.proposer,
            log_level=args.log_level,
        )
    )
    stopping = {"flag": False}

    def on_signal(signum, _frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(
        f"specdec up: starting ({cores} cores: target {args.target_threads} thread(s) × {args.target_workers}, "
        f"draft {args.draft_threads} thread(s) × {args.draft_workers})",
        flush=True,
    )
    try:
        stack.start(progress=lambda line: print("  " + line, flush=True))
    except StackError as exc:
        print(f"specdec up: start-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(f"\nspecdec is ready: coordinator at {stack.address}", flush=True)
        print(
            f"try:  specdec generate --addr {stack.address} --stats 'def add(a, b):'\n", flush=True
        )
        if not args.no_demo and not stopping["flag"]:
            demo(stack.address, args.demo_prompt)
        print("serving; Ctrl-C stops everything", flush=True)
        while not stopping["flag"]:
            dead = stack.dead_children()
            if dead:
                child = dead[0]
                print(
                    f"specdec up: {child.name} exited with code {child.process.returncode}:\n{child.tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            time.sleep(0.2)
        print("specdec up: stopping", flush=True)
        return 0
    finally:
        stack.stop()
        print("specdec up: stopped", flush=True)


def demo(address: str, prompt: str) -> None:
    from specdec.client import Client

    print(f"demo completion (greedy, adaptive γ):\n{prompt}", end="", flush=True)
    with Client(address, timeout_s=120) as client:
        final = None
        for chunk in client.stream(prompt, max_new_tokens=48, temperature=0.0):
            print(chunk.text, end="", flush=True)
            final = chunk
    s = final.stats
    print(
        f"\n--- {s.generated_tokens} tokens, {s.tokens_per_second:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
        f"mean acceptance length {s.mean_acceptance_length:.2f}\n",
        flush=True,
    )


# --- specdec generate -------------------------------------------------------------------


def generate(argv: list[str]) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specdec.client import Client
    from specdec.serving.wire import merge

    p = argparse.ArgumentParser(
        prog="specdec generate", description="Stream a completion to the terminal."
    )
    p.add_argument("prompt")
    p.add_argument(
        "--addr",
        default=env_default("addr", "127.0.0.1:50051"),
        help="coordinator address(es), comma-separated",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)"
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--gamma",
        "--num-speculative-tokens",
        dest="gamma",
        type=int,
        default=None,
        help="γ per round; unset = adaptive, 0 = speculation off",
    )
    p.add_argument("--session-id", default="")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument(
        "--json", action="store_true", help="print the whole response with stats as JSON"
    )
    p.add_argument("--stats", action="store_true", help="print acceptance and speed after the text")
    args = p.parse_args(argv)
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        num_speculative_tokens=args.gamma,
        session_id=args.session_id,
    )
    client = Client(args.addr.split(","), timeout_s=args.timeout)
    try:
        if args.json:
            response = merge(client.stream(args.prompt, **kwargs))
            print(json.dumps(MessageToDict(response, preserving_proto_field_name=True), indent=2))
            return 0
        final = None
        for chunk in client.stream(args.prompt, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        print()
        if args.stats and final is not None:
            s = final.stats
            print(
                f"[{s.generated_tokens} tokens in {s.total_time_ms:.0f} ms = {s.tokens_per_second:.1f} tok/s, "
                f"TTFT {s.time_to_first_token_ms:.0f} ms | acceptance rate {s.acceptance_rate:.3f}, "
                f"mean acceptance length {s.mean_acceptance_length:.2f}, α̂ {s.alpha:.3f}, "
                f"rounds {s.rounds}, mean γ {s.mean_speculative_tokens:.2f}]"
            )
        return 0
    except grpc.RpcError as exc:
        print(f"specdec generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        return up(rest)
    if command == "generate":
        return generate(rest)
    if command == "bench" and rest and rest[0] in ("workers", "math", "fuzz", "load"):
        command, rest = f"bench {rest[0]}", rest[1:]
    if command not in SERVICES:
        print(f"specdec: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    result = importlib.import_module(SERVICES[command]).main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

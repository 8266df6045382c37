"""`specdec up`: the whole local stack (embedded Redis, workers, coordinator) until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from specdec.launcher.generate import demo
from specdec.launcher.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    demo_model,
    has_chat_template,
    model_line,
)
from specdec.serving.settings import LOG_LEVELS, env_default, flag_type


def pipeline_args(args, cores: int, environ) -> list[str]:
    """The coordinator's `--pipeline off` where the workers' threads exceed the cores and
    SPECDEC_PIPELINE does not say otherwise: a block drafted during a verify would take a core
    from the target's pass (`specdec bench split`, docs/benchmarks.md)."""
    threads = args.target_threads * args.target_workers + args.draft_threads * args.draft_workers
    if args.proposer == "model" and threads > cores and not environ.get("SPECDEC_PIPELINE"):
        return ["--pipeline", "off"]
    return []


def up(argv: list[str]) -> int:
    from specdec.launcher.stack import Stack, StackError, StackSettings

    cores = os.cpu_count() or 2
    p = argparse.ArgumentParser(
        prog="specdec up", description="Run the whole local stack until Ctrl-C."
    )
    p.add_argument(
        "--target-model",
        default=env_default("target-model", DEFAULT_TARGET),
        help="model directory or catalogued name (`specdec models list`)",
    )
    p.add_argument("--draft-model", default=env_default("draft-model", demo_model(DEFAULT_DRAFT)))
    p.add_argument("--port", type=int, default=env_default("port", 50051), help="coordinator port")
    p.add_argument(
        "--http-port",
        type=int,
        default=env_default("http-port", 8000),
        help="port of the OpenAI-compatible HTTP API (-1 = off)",
    )
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--draft-workers", type=int, default=env_default("draft-workers", 1))
    p.add_argument("--target-workers", type=int, default=env_default("target-workers", 1))
    p.add_argument("--draft-threads", type=int, default=env_default("draft-threads", 1))
    # all the cores for the target: at one request its passes and the draft's steps take turns,
    # and under load sharing them beat a core each (`specdec bench split`, docs/benchmarks.md)
    p.add_argument("--target-threads", type=int, default=env_default("target-threads", cores))
    p.add_argument(
        "--proposer",
        type=flag_type(str, {"choices": ["model", "ngram"]}),
        choices=["model", "ngram"],
        default=env_default("proposer", "model"),
    )
    p.add_argument(
        "--redis-url",
        default=env_default("redis-url", ""),
        help="external Redis (default: embedded)",
    )
    p.add_argument(
        "--demo-prompt",
        default=env_default("demo-prompt", ""),
        help="demo request (default: a chat question, or a code prompt for a model without a "
        "chat template)",
    )
    p.add_argument("--no-demo", action="store_true", help="skip the demo completion")
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=env_default("tls", False),
        help="every hop over TLS (mTLS between tiers) with a throwaway CA in --state-dir",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[k for k in [env_default("api-key", "")] if k],
        help="turn API keys on with this key (repeatable); clients send it as a Bearer token",
    )
    p.add_argument(
        "--state-dir",
        default=env_default("state-dir", ""),
        help="where --tls, --api-key and the embedded Redis write the CA, certificates, key "
        "file and Redis data (default: a temporary directory removed on exit)",
    )
    p.add_argument(
        "--redis-dir",
        default=env_default("redis-dir", ""),
        help="the embedded Redis's append-only file, so sessions survive a Redis restart "
        "(default: <state dir>/redis; pass a directory to keep them across runs)",
    )
    p.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=env_default("reflection", True),
        help="gRPC reflection on every service (on here; off by default in each service)",
    )
    p.add_argument(
        "--log-level",
        type=flag_type(str, {"choices": LOG_LEVELS}),
        choices=LOG_LEVELS,
        default=env_default("log-level", "warning"),
    )
    args = p.parse_args(argv)
    from specdec.catalog import CatalogError, cache_root
    from specdec.engine.convert import resolve_model

    started = time.monotonic()
    try:
        args.target_model = resolve_model(args.target_model, progress=lambda m: print("  " + m))
        args.draft_model = resolve_model(args.draft_model, progress=lambda m: print("  " + m))
    except CatalogError as exc:
        print(f"specdec up: {exc}", file=sys.stderr)
        return 2
    for label, path in (("--target-model", args.target_model), ("--draft-model", args.draft_model)):
        if not os.path.isdir(path):
            print(
                f"specdec up: {label} {path} is not a directory (run `make models` or pass a model)",
                file=sys.stderr,
            )
            return 2
    print(f"specdec up: model cache {cache_root()}", flush=True)
    print("  " + model_line("target", args.target_model), flush=True)
    if args.proposer == "model":
        print("  " + model_line("draft", args.draft_model), flush=True)
    coordinator_args = pipeline_args(args, cores, os.environ)
    stack = Stack(
        StackSettings(
            target_model=args.target_model,
            coordinator_args=coordinator_args,
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
            tls=args.tls,
            api_keys=args.api_key,
            state_dir=args.state_dir,
            reflection=args.reflection,
            http_port=args.http_port,
            persist_redis=True,
            redis_dir=args.redis_dir,
        )
    )
    stopping = {"flag": False}

    def on_signal(signum, _frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(
        f"specdec up: starting ({cores} cores: target {args.target_threads} thread(s) × {args.target_workers}, "
        f"draft {args.draft_threads} thread(s) × {args.draft_workers}"
        + ("; pipelined rounds off: the workers share the cores)" if coordinator_args else ")"),
        flush=True,
    )
    try:
        stack.start(progress=lambda line: print("  " + line, flush=True))
    except StackError as exc:
        print(f"specdec up: start-up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        chat = has_chat_template(args.target_model)
        print(
            f"\nspecdec is ready: coordinator at {stack.address} "
            f"(set-up took {time.monotonic() - started:.1f} s)",
            flush=True,
        )
        example = "--chat 'Write a haiku about autumn.'" if chat else "'def add(a, b):'"
        options = stack.client_options()
        tls = f" --tls-ca {options['tls_ca']}" if "tls_ca" in options else ""
        if "api_key" in options:
            print("API keys are on: export SPECDEC_API_KEY=<the --api-key you gave>", flush=True)
        print(f"try:  specdec generate --addr {stack.address}{tls} --stats {example}", flush=True)
        if options:
            ca = f", tls_ca={options['tls_ca']!r}" if tls else ""
            print(f"      Python: Client({stack.address!r}{ca}).generate(...)", flush=True)
        if args.http_port >= 0:
            print(f"OpenAI-compatible HTTP API at {stack.http_url}:", flush=True)
            key = ' -H "Authorization: Bearer $SPECDEC_API_KEY"' if args.api_key else ""
            ca = f" --cacert {options['tls_ca']}" if tls else ""
            model = os.path.basename(os.path.normpath(args.target_model))
            print(
                f"      curl{ca} {stack.http_url}/chat/completions{key} -H 'Content-Type: "
                f'application/json\' -d \'{{"model": "{model}", "messages": '
                f'[{{"role": "user", "content": "Hi!"}}]}}\'',
                flush=True,
            )
            print(
                f"      openai.OpenAI(base_url={stack.http_url!r}, api_key=...)"
                f" with model={model!r}",
                flush=True,
            )
        print(flush=True)
        if not args.no_demo and not stopping["flag"]:
            demo(stack.address, args.demo_prompt, chat, stack.client_options())
        print("serving; Ctrl-C stops everything", flush=True)
        while not stopping["flag"]:
            if stack.redis is not None and not stack.redis.alive():
                print("specdec up: redis-server exited; restarting it (same data)", flush=True)
                stack.redis.restart()
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

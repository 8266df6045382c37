"""`specdec` — one console script: up, draft-worker, target-worker, coordinator, generate, bench."""

from __future__ import annotations

import importlib
import sys

from specdec.launcher.generate import generate
from specdec.launcher.models import models
from specdec.launcher.up import up

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
    "bench split": "bench.split",
}


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

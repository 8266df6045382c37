"""Command-line flags that also read SPECDEC_<FLAG> environment variables.

Each service declares its flags with `flag()`; `parse()` builds the service's settings
dataclass. Precedence: command line, then environment, then the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any


def env_name(flag: str) -> str:
    return "SPECDEC_" + flag.lstrip("-").upper().replace("-", "_")


def _coerce(value: str, kind: type) -> Any:
    if kind is bool:
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


def add_flags(parser: argparse.ArgumentParser, settings_cls: type) -> None:
    """Add one flag per field of a settings dataclass; field metadata carries the help."""
    for field in dataclasses.fields(settings_cls):
        flag = "--" + field.name.replace("_", "-")
        kind = field.type if isinstance(field.type, type) else eval(field.type)  # noqa: S307
        default = field.default
        env = os.environ.get(env_name(flag))
        if env is not None:
            default = _coerce(env, kind)
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(flag)}; default {field.default!r}]"
        )
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            parser.add_argument(
                flag,
                type=kind,
                default=default,
                help=help_text,
                choices=field.metadata.get("choices"),
            )


def from_args(settings_cls: type, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls)}
    return settings_cls(**values)


def opt(default: Any, help: str, choices: list | None = None) -> Any:
    """A settings field with help text (and optional choices)."""
    meta = {"help": help}
    if choices:
        meta["choices"] = choices
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """Flags both worker tiers take; each tier overrides the defaults that differ."""

    model: str = opt("", "Hugging Face model directory")
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 in a container)")
    port: int = opt(0, "gRPC port (0 = pick a free one)")
    threads: int = opt(1, "torch intra-op threads")
    device: str = opt("auto", "auto | cpu | cuda[:N]")
    dtype: str = opt(
        "auto", "auto | float32 | float16 | bfloat16", ["auto", "float32", "float16", "bfloat16"]
    )
    max_sessions: int = opt(256, "sessions whose KV is cached (LRU beyond)")
    max_kv_mb: int = opt(1024, "KV cache memory budget in MiB (LRU eviction beyond)")
    max_speculative_tokens: int = opt(16, "largest γ accepted")
    max_batch_size: int = opt(32, "most sessions in one batched forward")
    max_wait_ms: float = opt(1.0, "how long a batch waits for more sessions after its first")
    redis_url: str = opt("", "register in this Redis (empty = static addressing only)")
    advertise_addr: str = opt("", "address registered in Redis (default host:port)")
    heartbeat_s: float = opt(2.0, "registry heartbeat period; the entry expires after 3 periods")
    grace_s: float = opt(10.0, "on SIGTERM, how long in-flight calls may finish")
    metrics_port: int = opt(0, "Prometheus metrics port (0 = off)")
    log_level: str = opt("info", "debug | info | warning | error")

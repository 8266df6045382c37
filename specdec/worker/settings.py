"""Flags both worker tiers take; each tier's settings subclass overrides what differs."""

from __future__ import annotations

import dataclasses

from specdec.serving.security import SecurityFlags, ServerTLS
from specdec.serving.settings import LOG_LEVELS, opt


@dataclasses.dataclass(frozen=True)
class WorkerSettings(SecurityFlags):
    """Flags both worker tiers take; each tier overrides the defaults that differ."""

    model: str = opt("", "Hugging Face model directory")
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 in a container)")
    port: int = opt(0, "gRPC port (0 = pick a free one)")
    threads: int = opt(1, "torch intra-op threads")
    cpu_bind: str = opt(
        "auto",
        "pin the model's threads, one CPU each: auto (on a CPU device at --threads >= 2, where "
        "the process may run on exactly --threads CPUs: a pod under the static CPU manager, a "
        "cpuset, taskset) | off | a CPU list like 0-3 or 0,2,4,6 (exactly --threads CPUs)",
        pattern=r"auto|off|[0-9][0-9,\-]*",
    )
    device: str = opt("auto", "auto | cpu | cuda[:N]", pattern=r"auto|cpu|cuda(:\d+)?")
    dtype: str = opt(
        "auto", "auto | float32 | float16 | bfloat16", ["auto", "float32", "float16", "bfloat16"]
    )
    linear_kernel: str = opt(
        "auto",
        "CPU float32 linear layers: auto (a compiled C++ kernel streaming each weight once a "
        "call, built once per machine, where it builds and agrees with torch's own at load; "
        "else oneDNN with weights prepacked at load, where present and agreeing; else torch's "
        "own) | compiled (the compiled kernel, or fail) | packed (oneDNN, or fail) | default "
        "(torch's own)",
        ["auto", "compiled", "packed", "default"],
    )
    batch_attention: str = opt(
        "auto",
        "attention of a batched forward: auto (over each session's own KV on a CPU, where the "
        "model qualifies and agrees on a check at load; else a padded batch copy) | sessions "
        "(that, or fail) | padded",
        ["auto", "sessions", "padded"],
    )
    attention_kernel: str = opt(
        "auto",
        "who attends blocks of <= 12 tokens over the sessions' own KV (float32, CPU): auto "
        "(a compiled C++ kernel, one call a layer for every such session, built once per "
        "machine, where it builds and agrees on the check at load; else torch, one call a "
        "session) | compiled (that, or fail) | torch",
        ["auto", "compiled", "torch"],
    )
    model_forward: str = opt(
        "auto",
        "who runs the model's forward over the sessions' own KV: auto (its modules called "
        "directly, without Hugging Face's per-call wrappers and causal mask, for Llama, "
        "Mistral, Qwen2 and Qwen3 models whose logits equal the model's own forward's on a "
        "check at load; else Hugging Face's forward) | lean (that, or fail) | hf",
        ["auto", "lean", "hf"],
    )
    sampling_kernel: str = opt(
        "auto",
        "the sampling math on a CPU (the draft's step; the target's 64-value top window of "
        "every row with its cuts, and its rows whose kept set runs past it, a top-p nucleus of "
        "more than 64 "
        "tokens): auto (a compiled C++ "
        "kernel, each row's passes in one call, built once per machine, where it builds; else "
        "torch's ops) | compiled (that, or fail) | torch",
        ["auto", "compiled", "torch"],
    )
    sampling_graphs: str = opt(
        "auto",
        "the sampling math of a verify / draft step (temperature > 0): auto (in fixed shapes, "
        "one CUDA graph a call, on a CUDA device; else the eager path) | on (fixed shapes on "
        "any device: graphs on CUDA, eager elsewhere) | off (the eager path)",
        ["auto", "on", "off"],
    )
    sampling_graphs_mb: int = opt(
        4096,
        "GPU memory the sampling graphs may hold, in MiB (estimated at 48 bytes a logit of a "
        "graph's padded rows; least recently used released beyond; a shape larger than this "
        "alone takes the eager path)",
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
    max_message_mb: int = opt(64, "largest gRPC message between the tiers, in MiB")
    max_in_flight: int = opt(
        256, "Propose/Verify/Prefill calls queued or running (RESOURCE_EXHAUSTED beyond)"
    )
    log_level: str = opt("info", "debug | info | warning | error", choices=LOG_LEVELS)

    def server_tls(self) -> ServerTLS | None:
        """TLS of this worker's port; with --tls-ca every caller needs a client certificate."""
        if not self.tls_cert:
            return None
        return ServerTLS(self.tls_cert, self.tls_key, client_ca=self.tls_ca)

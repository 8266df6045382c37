"""`specdec draft-worker`: the draft tier (a small model, or n-gram prompt lookup)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.runtime import ModelRuntime, RuntimeSettings
from specdec.serve import worker_main
from specdec.settings import opt
from specdec.v1 import draft_pb2_grpc


@dataclass(frozen=True)
class DraftSettings:
    model: str = opt(
        "models/draft", "Hugging Face model directory of the draft (tokenizer only for ngram)"
    )
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 in a container)")
    port: int = opt(50061, "gRPC port (0 = pick a free one)")
    threads: int = opt(1, "torch intra-op threads")
    device: str = opt("auto", "auto | cpu | cuda[:N]")
    dtype: str = opt(
        "auto", "auto | float32 | float16 | bfloat16", ["auto", "float32", "float16", "bfloat16"]
    )
    proposer: str = opt(
        "model", "model (a draft LM) | ngram (prompt lookup, no model)", ["model", "ngram"]
    )
    ngram_max: int = opt(4, "ngram proposer: longest suffix n-gram to match")
    max_sessions: int = opt(256, "sessions whose KV is cached (LRU beyond)")
    max_kv_mb: int = opt(1024, "KV cache memory budget in MiB (LRU eviction beyond)")
    max_speculative_tokens: int = opt(16, "largest γ accepted by Propose")
    wire_top_k: int = opt(
        32, "K: tokens of q̃ sent per candidate (the draft samples from this top-K)"
    )
    max_batch_size: int = opt(32, "most sessions drafted in one batched forward")
    max_wait_ms: float = opt(1.0, "how long a batch waits for more sessions after its first")
    redis_url: str = opt("", "register in this Redis (empty = static addressing only)")
    advertise_addr: str = opt("", "address registered in Redis (default host:port)")
    heartbeat_s: float = opt(2.0, "registry heartbeat period; the entry expires after 3 periods")
    grace_s: float = opt(10.0, "on SIGTERM, how long in-flight calls may finish")
    metrics_port: int = opt(0, "Prometheus metrics port (0 = off)")
    log_level: str = opt("info", "debug | info | warning | error")


def build(settings: DraftSettings):
    from draft_worker.engine import ModelProposer, NgramProposer
    from draft_worker.service import DraftService

    if settings.proposer == "ngram":
        proposer = NgramProposer(settings.model, max_ngram=settings.ngram_max)
    else:
        runtime = ModelRuntime(
            RuntimeSettings(settings.model, settings.device, settings.dtype, settings.threads)
        )
        proposer = ModelProposer(runtime, settings.wire_top_k)
    return DraftService(proposer, settings, address="")


def main(argv: list[str] | None = None) -> None:
    worker_main(
        argv,
        "specdec draft-worker",
        __doc__,
        DraftSettings,
        build,
        "draft",
        draft_pb2_grpc.add_DraftWorkerServicer_to_server,
        "specdec.v1.DraftWorker",
    )


if __name__ == "__main__":
    main()

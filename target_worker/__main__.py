"""`specdec target-worker`: the target tier."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.core import row_kernel
from specdec.engine.convert import resolve_model
from specdec.engine.model import ModelRuntime, RuntimeSettings
from specdec.serving.settings import opt
from specdec.worker.lifecycle import worker_main
from specdec.worker.settings import WorkerSettings


@dataclass(frozen=True)
class TargetSettings(WorkerSettings):
    model: str = opt(
        "smollm2-135m-instruct",
        "the target: a Hugging Face model directory, or a catalogued name (converted once "
        "into $SPECDEC_MODEL_CACHE)",
    )
    port: int = opt(50071, "gRPC port (0 = pick a free one)")
    max_kv_mb: int = opt(4096, "KV cache memory budget in MiB (LRU eviction beyond)")
    max_speculative_tokens: int = opt(16, "largest γ accepted by Verify")
    max_batch_size: int = opt(32, "most sessions verified in one forward pass")
    max_wait_ms: float = opt(
        50.0,
        "most a batch waits for the other recently active sessions (also at most half a forward)",
    )
    max_batch_tokens: int = opt(
        4096, "most positions in one forward pass: sessions × the longest input (padding included)"
    )
    prefill_chunk: int = opt(512, "tokens per Prefill forward pass")


def build(settings: TargetSettings):
    from target_worker.engine import TargetEngine
    from target_worker.service import TargetService

    row_kernel.select(settings.sampling_kernel)  # before the model loads: a bad choice fails fast
    runtime = ModelRuntime(
        RuntimeSettings(
            resolve_model(settings.model),
            settings.device,
            settings.dtype,
            settings.threads,
            settings.linear_kernel,
            settings.batch_attention,
            settings.attention_kernel,
            settings.model_forward,
        )
    )
    engine = TargetEngine(runtime, settings.sampling_graphs, settings.sampling_graphs_mb)
    return TargetService(engine, settings, address="")


def main(argv: list[str] | None = None) -> None:
    worker_main(
        argv,
        "specdec target-worker",
        __doc__,
        TargetSettings,
        build,
        "target",
        "specdec.v1.TargetWorker",
    )


if __name__ == "__main__":
    main()

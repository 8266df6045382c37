"""`specdec draft-worker`: the draft tier (a small model, or n-gram prompt lookup)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.core import row_kernel
from specdec.engine.convert import resolve_model
from specdec.engine.model import ModelRuntime, RuntimeSettings
from specdec.serving.settings import opt
from specdec.worker.lifecycle import worker_main
from specdec.worker.settings import WorkerSettings


@dataclass(frozen=True)
class DraftSettings(WorkerSettings):
    model: str = opt(
        "models/smollm2-draft",
        "the draft: a Hugging Face model directory or a catalogued name (tokenizer only for ngram)",
    )
    port: int = opt(50061, "gRPC port (0 = pick a free one)")
    max_speculative_tokens: int = opt(16, "largest γ accepted by Propose")
    max_batch_size: int = opt(32, "most sessions drafted in one batched forward")
    max_wait_ms: float = opt(
        10.0,
        "most a batch waits for the other recently active sessions (also at most half a forward)",
    )
    proposer: str = opt(
        "model", "model (a draft LM) | ngram (prompt lookup, no model)", ["model", "ngram"]
    )
    ngram_max: int = opt(4, "ngram proposer: longest suffix n-gram to match")
    wire_top_k: int = opt(
        32, "K: tokens of q̃ sent per candidate (the draft samples from this top-K)"
    )


def build(settings: DraftSettings):
    from draft_worker.engine import ModelProposer, NgramProposer
    from draft_worker.service import DraftService

    row_kernel.select(settings.sampling_kernel)  # before the model loads: a bad choice fails fast
    if settings.proposer == "ngram":
        proposer = NgramProposer(resolve_model(settings.model), max_ngram=settings.ngram_max)
    else:
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
        proposer = ModelProposer(
            runtime, settings.wire_top_k, settings.sampling_graphs, settings.sampling_graphs_mb
        )
    return DraftService(proposer, settings, address="")


def main(argv: list[str] | None = None) -> None:
    worker_main(
        argv,
        "specdec draft-worker",
        __doc__,
        DraftSettings,
        build,
        "draft",
        "specdec.v1.DraftWorker",
    )


if __name__ == "__main__":
    main()

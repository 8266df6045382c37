"""What a session's loop needs from its coordinator, as one typed value (no reaching up)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.cost_model import CostModel
from coordinator.pool import WorkerPool
from coordinator.settings import CoordinatorSettings
from coordinator.shedding import LoadShedder
from coordinator.store import SessionStore

if TYPE_CHECKING:
    from specdec.serving.metrics import CoordinatorMetrics


@dataclass(frozen=True)
class RunContext:
    """Shared by every session a coordinator runs."""

    settings: CoordinatorSettings
    store: SessionStore
    drafts: WorkerPool
    targets: WorkerPool
    costs: CostModel  # timings the adaptive γ policy of every session shares
    tokenizer: object  # the target's tokenizer (detokenisation and stop strings)
    eos_token_ids: tuple[int, ...]
    owner: str  # this coordinator's id in session leases
    shedder: LoadShedder  # refuses new sessions while the target tier is saturated
    starting: asyncio.Semaphore  # sessions in their first round at once (--max-starting)
    metrics: CoordinatorMetrics | None = None  # None without a --metrics-port

    def pool(self, role: str) -> WorkerPool:
        return self.drafts if role == "draft" else self.targets

    def count(self, name: str, **attrs) -> None:
        """Add one to a coordinator counter (a no-op without metrics)."""
        if self.metrics is not None:
            getattr(self.metrics, name).add(1, attrs)

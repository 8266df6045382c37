"""Per-request sampling settings as a value type (plain Python: no torch).

The wire form is `specdec.v1.SamplingParams`; `specdec.serving.wire` converts between the two,
and `to_dict`/`from_dict` give the form stored with a session in Redis.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from specdec.errors import InvalidArgument

# Below this temperature a request is greedy (as vLLM treats it): dividing float32 logits by
# 1e-40 would overflow to inf and turn the distribution into NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """The request's processors (in this order: temperature, top-k, top-p, min-p) and stops."""

    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 0 or 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    max_new_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def processors(self) -> tuple[float, int, float, float]:
        """What shapes the distribution; rows of a batch with equal keys are processed together."""
        return (self.temperature, self.top_k, self.top_p, self.min_p)

    def validate(self, prefix: str = "sampling") -> None:
        """Raise InvalidArgument naming the field when a value is out of range."""
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidArgument(f"{prefix}.{name} must be finite, got {value}")
        if self.temperature < 0:
            raise InvalidArgument(f"{prefix}.temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidArgument(f"{prefix}.top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"{prefix}.min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"{prefix}.top_k must be >= 0, got {self.top_k}")

    def to_dict(self) -> dict:
        """JSON-ready form (the seed is stored apart, with the session)."""
        d = asdict(self)
        del d["seed"]
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict, seed: int | None = None) -> SamplingParams:
        return cls(
            **{**d, "stop": tuple(d["stop"]), "stop_token_ids": tuple(d["stop_token_ids"])},
            seed=seed,
        )

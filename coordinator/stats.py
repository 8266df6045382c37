"""A session's generation statistics: counted per round, stored with every commit."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from specdec.core.acceptance import alpha_hat


@dataclass
class Stats:
    rounds: int = 0
    drafts: int = 0  # rounds with γ > 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejection_rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rounds_per_gamma: list[int] = field(default_factory=list)  # [g] = rounds verifying g
    gamma_sum: int = 0
    draft_failovers: int = 0
    target_failovers: int = 0
    takeovers: int = 0
    drafted_ahead: int = 0  # rounds whose candidates were drafted during the last verify
    draft_forward_s: float = 0.0  # the workers' own pass times for this session's rounds
    verify_forward_s: float = 0.0
    first_token_forward_s: float = 0.0  # both, until the first token (set with first_token_s)
    first_token_s: float | None = None

    @classmethod
    def restore(cls, stored: dict) -> Stats:
        """The counters a previous owner stored with its last commit (a takeover goes on)."""
        names = {f.name for f in fields(cls)}
        raw = stored.get("_raw", {})
        stats = cls(**{k: v for k, v in raw.items() if k in names})
        stats.accepted_per_position = list(stats.accepted_per_position or [])
        stats.rounds_per_gamma = list(stats.rounds_per_gamma or [])
        return stats

    def raw(self) -> dict:
        """The counters as they are now (`dataclasses.asdict` without its deep copy of each
        number: only the lists need one, the round after changes them in place)."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw["accepted_per_position"] = list(self.accepted_per_position)
        raw["rounds_per_gamma"] = list(self.rounds_per_gamma)
        return raw

    def count_round(
        self, gamma: int, accepted: int, draft_forward_s: float = 0.0, verify_forward_s: float = 0.0
    ) -> None:
        self.rounds += 1
        self.draft_forward_s += draft_forward_s
        self.verify_forward_s += verify_forward_s
        self.drafts += int(gamma > 0)
        self.gamma_sum += gamma
        self.draft_tokens += gamma
        self.accepted_tokens += accepted
        self.rejection_rounds += int(accepted < gamma)
        if len(self.accepted_per_position) < gamma:
            self.accepted_per_position += [0] * (gamma - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if len(self.rounds_per_gamma) <= gamma:
            self.rounds_per_gamma += [0] * (gamma + 1 - len(self.rounds_per_gamma))
        self.rounds_per_gamma[gamma] += 1

    def first_token(self, elapsed_s: float) -> None:
        """The first token was committed `elapsed_s` after the request: the prompt's part ends."""
        self.first_token_s = elapsed_s
        self.first_token_forward_s = self.draft_forward_s + self.verify_forward_s

    def as_dict(self, prompt_tokens: int, generated: int, elapsed_s: float) -> dict:
        """GenerationStats fields, plus the raw counters under `_raw` (for a takeover)."""
        rounds = max(self.rounds, 1)
        accepted = self.accepted_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_acceptance_length": (accepted + self.rounds) / rounds if self.rounds else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "rounds_per_gamma": list(self.rounds_per_gamma),
            "alpha": alpha_hat(accepted, self.rejection_rounds),
            "time_to_first_token_ms": 1000.0 * (self.first_token_s or 0.0),
            "total_time_ms": 1000.0 * elapsed_s,
            "tokens_per_second": generated / elapsed_s if elapsed_s > 0 else 0.0,
            "mean_speculative_tokens": self.gamma_sum / rounds if self.rounds else 0.0,
            "draft_failovers": self.draft_failovers,
            "target_failovers": self.target_failovers,
            "takeovers": self.takeovers,
            "drafted_ahead": self.drafted_ahead,
            "draft_forward_ms": 1000.0 * self.draft_forward_s,
            "verify_forward_ms": 1000.0 * self.verify_forward_s,
            "first_token_forward_ms": 1000.0 * self.first_token_forward_s,
            "_raw": self.raw(),
        }

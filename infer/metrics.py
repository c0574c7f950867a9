"""Speculative-decoding metrics, defined once for the engine, the harness and training.

Definitions (docs/reference.md §3, vLLM's Prometheus counters):

- ``num_drafts``: verification steps of a request in which at least one token was drafted.
- ``num_draft_tokens``: tokens drafted; ``num_accepted_tokens``: drafted tokens accepted *and
  emitted* (tokens after an EOS / stop token or beyond max_tokens inside an accepted prefix are
  not counted: they never reach the user).
- ``num_accepted_tokens_per_pos[i]``: steps whose accepted prefix reached draft position i.
- acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts
  (the 1 counts the recovered / bonus token every step emits); per-position rate i =
  accepted_per_pos[i] / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Cumulative counters; ``record`` one request-step at a time, ``merge`` to aggregate."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verification step: ``num_accepted`` of ``num_drafted`` were kept."""
        if num_drafted <= 0:
            return
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"num_accepted={num_accepted} outside [0, {num_drafted}]")
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._grow(num_drafted)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecMetrics") -> "SpecMetrics":
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.num_accepted_tokens_per_pos))
        for pos, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[pos] += count
        return self

    def _grow(self, k: int) -> None:
        if len(self.num_accepted_tokens_per_pos) < k:
            self.num_accepted_tokens_per_pos += [0] * (k - len(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        if not self.num_drafts:
            return [0.0] * len(self.num_accepted_tokens_per_pos)
        return [c / self.num_drafts for c in self.num_accepted_tokens_per_pos]

    @classmethod
    def from_dict(cls, d: dict) -> "SpecMetrics":
        """The counters of an ``as_dict()`` (e.g. ``RequestOutput.metrics``)."""
        return cls(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"],
                   list(d["num_accepted_tokens_per_pos"]))

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_rates": self.per_position_rates,
        }

"""Adaptive verification (vLLM's ``enable_adaptive_verification``): each step verifies only as
many drafts as pay.

A row's i-th draft is worth verifying in proportion to the chance that it and every draft before
it are accepted, its survival ``s_i = a_1 ... a_i``, where ``a_j`` estimates the acceptance of
the j-th draft from the drafter's confidence there (its top probability). The estimate is
calibrated online, as vLLM's later estimator is: the verified drafts' outcomes are counted by
confidence bin (a draft judged after an accepted prefix, accepted or not), starting from the
prior that a drafter's top probability is its acceptance.

draftsmith's verify forward runs the batch's rows padded to the widest one, so its cost is set by
the width, not by the tokens kept: the step picks the width ``w`` (drafts per row, at most what
each drafted) that maximises the expected tokens per second,

    (rows + sum of survivals up to w) / (draft cost + verify cost at w + 1 tokens per row),

with the verify cost by width measured on the running rows when a batch size first steps (the
cache rolled back after) and refreshed by every verify since, and the draft cost the proposer's
measured time. Only how many drafts are judged changes, not how: lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from infer.timing import Timer

_REPEATS = 3  # timed forwards per width when profiling; the median is kept
_BINS = 10  # confidence bins of the acceptance estimate
_PRIOR = 4.0  # pseudo-counts of the prior (acceptance = confidence) in each bin
_EMA = 0.2  # weight of a new measurement in the running costs


def verify_width(survival: list[list[float]], drafted: list[int], draft_cost: float,
                 cost_by_width: list[float]) -> int:
    """Drafts per row to verify: the ``w`` maximising (rows + kept survival) / (``draft_cost``
    + ``cost_by_width[w]``), a row keeping ``min(w, drafted)`` (``survival`` per row and
    position; ``cost_by_width[w]``: a forward ``w + 1`` tokens wide)."""
    rows, widest = len(drafted), min(max(drafted, default=0), len(cost_by_width) - 1)
    best, best_rate, expected = 0, rows / (draft_cost + cost_by_width[0]), float(rows)
    for w in range(1, widest + 1):
        expected += sum(s[w - 1] for s, n in zip(survival, drafted) if n >= w)
        rate = expected / (draft_cost + cost_by_width[w])
        if rate > best_rate:
            best, best_rate = w, rate
    return best


@dataclass
class AcceptanceEstimate:
    """Acceptance of a draft by its confidence bin: judged and accepted counts, from a prior."""

    judged: list[float] = field(default_factory=lambda: [_PRIOR] * _BINS)
    accepted: list[float] = field(default_factory=lambda: [
        _PRIOR * (i + 0.5) / _BINS for i in range(_BINS)])

    def survival(self, confidence: list[list[float]]) -> list[list[float]]:
        """Per row and position, the estimated chance that every draft up to it is accepted."""
        out = []
        for row in confidence:
            s, acc = 1.0, []
            for c in row:
                b = _bin(c)
                s *= self.accepted[b] / self.judged[b]
                acc.append(s)
            out.append(acc)
        return out

    def observe(self, confidence: list[list[float]], verified: list[int],
                accepted: list[int]) -> None:
        """Count each judged draft: those before the first rejection accepted, that one not;
        drafts after it were never judged."""
        for conf, n, a in zip(confidence, verified, accepted):
            for i in range(min(a + 1, n)):
                b = _bin(conf[i])
                self.judged[b] += 1
                self.accepted[b] += 1 if i < a else 0


def _bin(confidence: float) -> int:
    return min(max(int(confidence * _BINS), 0), _BINS - 1)


@dataclass
class AdaptiveVerifier:
    """The engine's adaptive verification: verify costs by batch size and width (profiled when
    a batch size first steps, refreshed by every verify), the draft cost (a running mean of the
    proposer's time) and the acceptance estimate."""

    draft_seconds: float = 0.0
    costs: dict[int, list[float]] = field(default_factory=dict)  # rows -> seconds by width - 1
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    _last: list[list[float]] = field(default_factory=list)  # the pending step's confidences

    def keep(self, confidence: torch.Tensor, drafted: list[int], draft_seconds: float,
             profile: Callable[[], list[float]]) -> list[int]:
        """Drafts to verify per row, from ``confidence [B, w]`` (copied to the host), this
        step's draft time and, on a batch size's first step, ``profile()``: the verify forward's
        seconds at widths 1, 2, ... over the running rows."""
        rows = len(drafted)
        self.draft_seconds = _mean(self.draft_seconds, draft_seconds)
        if rows not in self.costs:
            self.costs[rows] = profile()
        self._last = confidence.float().tolist()
        width = verify_width(self.estimate.survival(self._last), drafted, self.draft_seconds,
                             self.costs[rows])
        return [min(width, n) for n in drafted]

    def observe(self, verified: list[int], accepted: list[int], seconds: float) -> None:
        """The step's outcome: drafts verified and accepted per row (the estimate learns) and
        the verify's measured time (the cost at its width is refreshed)."""
        if not self._last:
            return
        self.estimate.observe(self._last, verified, accepted)
        by_width = self.costs[len(verified)]
        w = min(max(verified, default=0), len(by_width) - 1)
        by_width[w] = _mean(by_width[w], seconds)
        self._last = []


def _mean(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - _EMA) * old + _EMA * new


def time_forward(run: Callable[[], None], device: torch.device) -> float:
    """The median wall time of ``run`` over a few calls (synchronised on CUDA)."""
    timer = Timer(cuda=device.type == "cuda")
    for _ in range(_REPEATS):
        with timer.measure():
            run()
    return timer.median

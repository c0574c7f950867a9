"""Adaptive verification (vLLM's ``enable_adaptive_verification``): each step verifies only the
prefix of each row's drafts that pays.

A draft at position i of a row is worth verifying in proportion to the chance that it and every
draft before it are accepted, its survival ``s_i = c_1 ... c_i``, where ``c_j`` is the drafter's
confidence in its j-th draft (its top probability there, the signal vLLM's online estimate reads
for EAGLE, MTP, DFlash and draft models). Over the batch, the step keeps the ``b`` drafts of
highest survival that maximise the expected tokens per second,

    (rows + s of the kept drafts) / (draft cost + verify cost of rows + b tokens),

with the verify forward's cost by width measured once per batch size on the running rows (the
cache rolled back after) and the draft cost the proposer's measured time. Survival only falls
along a row, so what a row keeps is a prefix: the verification rule itself is unchanged and the
step stays lossless; only how many drafts are judged changes. Where verifying is nearly free
(batch 1 on a GPU, or a CPU bound by reading weights) it keeps everything; where every verified
token costs (a compute-bound batch) it drops the drafts unlikely to survive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch

_REPEATS = 3  # timed forwards per width; the median is kept


def verify_budget(confidence: list[list[float]], drafted: list[int], draft_cost: float,
                  verify_cost: Callable[[int], float]) -> list[int]:
    """Drafts each row verifies: the ``b`` of highest survival (``confidence`` per row and
    position, ``drafted`` real drafts per row) that maximise (rows + kept survival) /
    (``draft_cost`` + ``verify_cost(rows + b)``); ties keep the earlier position."""
    rows = len(drafted)
    entries = []  # (-survival, row, position): sorted, each row's entries come in order
    for r, (conf, n) in enumerate(zip(confidence, drafted)):
        survival = 1.0
        for i in range(n):
            survival *= min(max(conf[i], 0.0), 1.0)
            entries.append((-survival, r, i))
    entries.sort()
    best, best_rate, expected = 0, rows / (draft_cost + verify_cost(rows)), float(rows)
    for b, (neg, _, _) in enumerate(entries, 1):
        expected -= neg
        rate = expected / (draft_cost + verify_cost(rows + b))
        if rate > best_rate:
            best, best_rate = b, rate
    keep = [0] * rows
    for _, r, _ in entries[:best]:
        keep[r] += 1
    return keep


@dataclass
class AdaptiveVerifier:
    """The engine's adaptive verification: the verify costs by batch size (measured on a batch
    size's first step) and the draft cost (a running mean of the proposer's measured time)."""

    draft_seconds: float = 0.0
    costs: dict[int, list[float]] = field(default_factory=dict)  # rows -> seconds at width 1..

    def keep(self, confidence: torch.Tensor, drafted: list[int], draft_seconds: float,
             profile: Callable[[], list[float]]) -> list[int]:
        """Drafts to verify per row, from ``confidence [B, w]`` (copied to the host), this
        step's draft time and, on a batch size's first step, ``profile()``: the verify forward's
        seconds at widths 1, 2, ... over the running rows."""
        rows = len(drafted)
        self.draft_seconds = draft_seconds if self.draft_seconds == 0.0 else (
            0.8 * self.draft_seconds + 0.2 * draft_seconds)
        if rows not in self.costs:
            self.costs[rows] = profile()
        by_width = self.costs[rows]
        return verify_budget(confidence.float().tolist(), drafted, self.draft_seconds,
                             lambda tokens: _interpolate(by_width, tokens / rows))


def _interpolate(by_width: list[float], width: float) -> float:
    """Seconds of a forward ``width`` tokens per row wide (1-based; linear between widths)."""
    lo = min(max(int(width), 1), len(by_width))
    if lo >= len(by_width):
        return by_width[-1]
    frac = width - lo
    return by_width[lo - 1] + frac * (by_width[lo] - by_width[lo - 1])


def time_forward(run: Callable[[], None], device: torch.device) -> float:
    """The median wall time of ``run`` over a few calls (synchronised on CUDA)."""
    times = []
    for _ in range(_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return median(times)

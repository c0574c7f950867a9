"""Step timings the engine records when asked: what the harness and the benchmarks read.

An engine has ``timers = None`` (nothing measured, nothing synchronised). Set
``llm.timers = EngineTimers.on(llm.device)`` and every ``generate`` adds to it: the engine
times its own steps, verify forwards, prefills and proposer calls (``LLM.speculative_step``,
``ModelRunner.verify`` / ``verify_tree``, ``ModelRunner.prefill``, ``Proposer.propose``), so
callers never patch its methods.
On CUDA each timed region synchronises before and after, so the time is the device's.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch


class Timer:
    """Wall time, calls, per-call durations and batch rows of one timed region."""

    def __init__(self, cuda: bool = False) -> None:
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        self.durations: list[float] = []
        self.cuda = cuda

    @contextmanager
    def measure(self, rows: int = 0) -> Iterator[None]:
        """Time the block (one call of ``rows`` batch rows)."""
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.durations.append(elapsed)
        self.calls += 1
        self.rows += rows

    @property
    def mean(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.durations) if self.durations else 0.0


@dataclass
class EngineTimers:
    """``step``: ``speculative_step``; ``verify``: target forwards of steps (not prefills), whose
    ``rows`` count request-steps; ``draft``: ``proposer.propose``; ``prefill``: prompt
    prefills (speculation does not change them)."""

    step: Timer
    verify: Timer
    draft: Timer
    prefill: Timer

    @classmethod
    def on(cls, device: torch.device | str) -> "EngineTimers":
        """Fresh timers for an engine on ``device`` (CUDA: synchronised)."""
        cuda = torch.device(device).type == "cuda"
        return cls(Timer(cuda), Timer(cuda), Timer(cuda), Timer(cuda))


def measure(timer: Timer | None, rows: int = 0) -> ContextManager:
    """``timer.measure(rows)``, or nothing when the engine is not being timed."""
    return timer.measure(rows) if timer is not None else nullcontext()

"""Training metrics between host syncs: running sums on the device inside a step, one host sync
per optimizer step (loss, tokens, grad norm: NaN detection needs them anyway), window averages
at each log step."""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor


class Meter:
    """Running sums between host syncs: device tensors inside the micro-step, floats after the
    one sync of each optimizer step, averaged over the log window (all micro-batches, all ranks)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._new_step()
        self._new_window()

    def _scalar(self, value: float) -> Tensor:
        return torch.full((), float(value), device=self.device)  # a fill kernel: no copy, no sync

    def _new_step(self) -> None:
        self.loss = self._scalar(0)  # [] sum of micro-batch losses
        self.micro, self.tokens = 0, 0

    def _new_window(self) -> None:
        self.sums: dict[str, Tensor] = {}  # metric -> [] sum over micro-batches
        self.window_micro, self.steps, self.window_tokens = 0, 0, 0
        self.loss_sum, self.gn_sum = 0.0, 0.0  # sums of per-step values (host floats)
        self.t0 = time.perf_counter()

    def add(self, out, batch: dict[str, Tensor]) -> None:
        self.loss += out.loss.detach().float()
        self.micro += 1
        self.tokens += batch["input_ids"].numel()
        self.window_micro += 1
        for key, value in out.metrics.items():
            self.sums[key] = self.sums.get(key, 0) + value.detach().float()

    def end_step(self, accelerator, grad_norm, votes: Sequence[float] = ()
                 ) -> tuple[float, int, float, list[float]]:
        """The step's (loss, tokens, grad norm) over all ranks: the one host sync per step.
        ``votes``: per-rank values summed over the ranks in the same sync (returned last), so
        that every rank sees the same decision (the trainer's stop requests) at no extra cost."""
        if isinstance(grad_norm, Tensor):
            gn = grad_norm.detach().float().reshape(()).to(self.device)
        else:  # DeepSpeed reports a float (None before its first step)
            gn = self._scalar(0.0 if grad_norm is None else grad_norm)
        stats = torch.stack([self.loss, self._scalar(self.micro), self._scalar(self.tokens),
                             gn, *(self._scalar(v) for v in votes)])  # [4 + len(votes)]
        loss_sum, micro, tokens, gn_sum, *voted = accelerator.reduce(stats, "sum").tolist()
        self._new_step()
        loss, gn = loss_sum / micro, gn_sum / accelerator.num_processes
        self.steps += 1
        self.loss_sum, self.gn_sum, self.window_tokens = (
            self.loss_sum + loss, self.gn_sum + gn, self.window_tokens + int(tokens))
        return loss, int(tokens), gn, voted

    def log_values(self, accelerator) -> dict[str, float]:
        """Window averages (rank mean of metrics); resets the window."""
        keys = sorted(self.sums)
        out: dict[str, float] = {}
        if keys:
            vec = torch.stack([self.sums[k] for k in keys]) / self.window_micro  # [K]
            out = dict(zip(keys, accelerator.reduce(vec, "mean").tolist()))
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        out.update(loss=self.loss_sum / self.steps, grad_norm=self.gn_sum / self.steps,
                   tokens_per_s=self.window_tokens / seconds)
        self._new_window()
        return out


class PhaseClock:
    """Wall time per phase of a run (data, features, training, export, evaluation), printed as
    one line at the end, so that a user sees where a run's minutes went (``make demo-real``)."""

    def __init__(self) -> None:
        self.start = self._last = time.monotonic()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Charge the time since the previous lap to ``name`` (laps of one name add up)."""
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def summary(self) -> str:
        def clock(seconds: float) -> str:
            return f"{int(seconds // 60)}:{int(seconds % 60):02d}"

        parts = ", ".join(f"{name} {clock(s)}" for name, s in self.phases.items())
        return f"wall time: {parts}; total {clock(time.monotonic() - self.start)}"

"""The training budget and learning-rate schedule: steps per epoch, warmup, decay.

Step accounting: a step is an optimizer step. An epoch is ``ceil(batches per rank /
grad_accum)`` steps (accelerate syncs at the end of the dataloader, so an epoch's last window may
be short); ``trainer.max_steps`` overrides ``trainer.epochs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """One stage's budget: ``total`` optimizer steps, ``per_epoch`` of them per pass over the
    data, the first ``warmup`` warming up."""

    total: int
    per_epoch: int
    warmup: int

    @classmethod
    def of(cls, tcfg, batches_per_epoch: int) -> "Plan":
        """From ``TrainerConfig`` and the number of micro-batches per epoch on one rank."""
        per_epoch = math.ceil(batches_per_epoch / tcfg.grad_accum)
        total = tcfg.max_steps or max(1, math.ceil(tcfg.epochs * per_epoch))
        return cls(total, per_epoch, num_warmup_steps(tcfg, total))

    def lr_factor(self, step: int, tcfg) -> float:
        return lr_factor(step, self.total, self.warmup, tcfg.schedule, tcfg.min_lr_ratio)


def num_warmup_steps(tcfg, total: int) -> int:
    """``warmup_steps`` when set, else ``round(warmup_ratio * total)``."""
    return tcfg.warmup_steps if tcfg.warmup_steps > 0 else round(tcfg.warmup_ratio * total)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of ``trainer.lr`` for optimizer step ``step`` (0-based) of ``total``.

    Warmup: steps ``0 .. warmup - 1`` rise linearly, ``(step + 1) / (warmup + 1)`` (no step is
    wasted at lr 0), to the peak at step ``warmup``. Then ``schedule`` decays from 1 at step
    ``warmup`` towards ``min_lr_ratio``, reached at ``total`` (just after the last step, which
    therefore still learns): cosine or linear in ``(step - warmup) / (total - warmup)``; constant
    stays at 1.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * shape


def set_hyperparameters(optimizer, scheduler, tcfg, plan: Plan, step: int) -> None:
    """This run's lr / betas / weight decay on a (possibly restored) optimizer: a checkpoint
    carries the old values, and resuming with new ones (lower lr after a divergence) is allowed."""
    scheduler.base_lrs = [tcfg.lr] * len(scheduler.base_lrs)
    factor = plan.lr_factor(step, tcfg)
    for group in optimizer.param_groups:
        group.update(initial_lr=tcfg.lr, lr=tcfg.lr * factor, betas=tuple(tcfg.betas),
                     weight_decay=tcfg.weight_decay if group.get("decay", True) else 0.0)

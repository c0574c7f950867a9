"""Served acceptance while training: the exported head through the engine every few steps.

Training accuracies are a proxy: they score the head on teacher-forced positions of the training
distribution, while serving accepts a chain the head drafts from its own outputs, over the
engine's rejection sampler. Users watching a long run want the served number itself, on the same
dashboard. Every ``eval.every_steps`` optimizer steps the trainer hands the current objective
state to ``ServedEval``, which

1. exports the drafter exactly as the final export does (``Objective.export`` into a temporary
   folder: the speculators checkpoint vLLM and ``infer.py`` load);
2. runs draftsmith's engine with that checkpoint's ``speculative_config`` at
   ``k = max(eval.ks)``, greedy, on the first ``eval.every_num_prompts`` evaluation prompts (the
   same held-out prompts and chat rendering as the end-of-training report), sharing the frozen
   target already in memory (offline training loads it for the evaluation and drops it again);
3. returns the acceptance length and per-position acceptance rates, which the trainer logs as
   ``served/acceptance_length`` and ``served/acceptance_rate_pos_<i>`` next to
   ``train/acceptance_length_est`` and ``train/full_acc_<i>`` (W&B and the console).

Greedy acceptance does not depend on the batch size, so all prompts run in one batch.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from infer.foundation.validation import config_error
from train.frozen_target import FrozenTarget
from train.objectives.base import Objective

_WHERE = "train config"


@dataclass
class ServedEval:
    """The trainer's periodic evaluation (see the module doc); call it with a state dict."""

    every_steps: int
    objective: Objective
    target: FrozenTarget
    prompts: list[Any]
    k: int
    max_tokens: int
    seed: int = 0

    @classmethod
    def from_config(cls, cfg, objective: Objective, target: FrozenTarget
                    ) -> "ServedEval | None":
        """None when ``eval.every_steps`` is 0 (off)."""
        from train.evaluate import eval_prompts

        ev = cfg.eval
        ev.validate(_WHERE)  # every_steps, every_num_prompts, ks, max_tokens ...
        if ev.every_steps == 0:
            return None
        if target.sharded:  # the engine runs on the main process alone: it needs the whole model
            raise config_error("eval.every_steps", ev.every_steps, "0 with a target sharded "
                               f"across the ranks (target.sharding={target.sharding.value}): "
                               "served evaluation needs the whole target on one process",
                               _WHERE)
        if target.gap is not None:  # the engine serves what it runs
            raise config_error("eval.every_steps", ev.every_steps, "0 with a target draftsmith's "
                               f"engine does not run ({target.gap}): served evaluation serves "
                               "the drafter in the engine", _WHERE)
        prompts = eval_prompts(cfg, target.dir)[: ev.every_num_prompts]
        return cls(ev.every_steps, objective, target, prompts, max(ev.ks), ev.max_tokens,
                   cfg.seed)

    def __call__(self, state_dict: dict[str, Tensor]) -> dict[str, float]:
        """Acceptance of the drafter in ``state_dict`` (an objective state dict)."""
        from infer import LLM, SamplingParams
        from infer.target import Target

        was_loaded = self.target.loaded
        with tempfile.TemporaryDirectory(prefix="served-eval-") as tmp:
            path = self.objective.export(tmp, state_dict)
            target = Target.wrap(self.target.dir, self.target.model)
            llm = LLM(target, speculative_config=self.objective.speculative_config(path, self.k),
                      max_num_seqs=len(self.prompts), seed=self.seed, enforce_eager=True,
                      gpu_memory_utilization=1.0)  # training holds most of the GPU already
            llm.generate(self.prompts, SamplingParams(temperature=0.0,
                                                      max_tokens=self.max_tokens),
                         use_tqdm=False)
            metrics = llm.metrics
        if not was_loaded:
            self.target.release()  # offline training keeps only the heads in memory
        out = {"acceptance_length": float(metrics.mean_acceptance_length)}
        for i, rate in enumerate(metrics.per_position_rates):
            out[f"acceptance_rate_pos_{i}"] = float(rate)
        return out

"""The MLP speculator's settings (train/objectives/mlp_speculator.py; IBM's two stages)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from infer.foundation.validation import check_bool, check_float, check_int
from train.methods.base import (METHODS, DistillConfig, DrafterConfig, method_field, opt_nonneg,
                                pinned, positive_int, weight)

_positive = partial(check_float, low=0.0, low_open=True)


@dataclass
class MLPSpeculatorObjectiveConfig(DistillConfig):
    """Cross-entropy per stage (+ KL), then optionally IBM's stage 2 on the target's answers."""

    kd_weight: float = pinned(0.0, weight)
    """KL to the target's distribution (objective.loss), on top of the CE."""
    stage2_steps: int = pinned(0, partial(check_int, minimum=0))
    """Optimizer steps of stage 2 on the target's own answers; 0: off."""
    stage2_lr_factor: float = pinned(0.1, _positive)
    """Stage 2's peak lr as a fraction of trainer.lr (IBM's recipe: 0.1)."""
    stage2_warmup_steps: Optional[int] = pinned(None, opt_nonneg)
    """Stage 2's warmup; None: IBM's min(2000, stage2_steps // 20)."""
    stage2_min_lr_ratio: float = pinned(0.1, partial(check_float, low=0.0, high=1.0))
    """Stage 2 anneals (cosine) to this fraction of its own peak (IBM: 0.1)."""


@METHODS.register("mlp_speculator")
@dataclass
class MLPSpeculatorDrafterConfig(DrafterConfig):
    """IBM's MLP speculator (fms-extras format)."""

    method: str = method_field("mlp_speculator")
    n_predict: int = pinned(3, positive_int)
    """Stages (drafted tokens)."""
    inner_dim: int = pinned(0, partial(check_int, minimum=0))
    """State width; 0: the target's hidden size."""
    tie_weights: bool = pinned(False, check_bool)
    """Share embedding, head, norm and projection across stages."""
    scale_input: bool = pinned(False, check_bool)
    """Normalise and scale the target state first."""

    objective_config = MLPSpeculatorObjectiveConfig

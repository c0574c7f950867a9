"""EAGLE-1's settings (train/objectives/eagle.py): feature regression plus distillation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.methods.base import (METHODS, DistillConfig, DrafterConfig, UnrollConfig,
                                method_field, opt_positive, pinned, weight)


@dataclass
class EagleObjectiveConfig(UnrollConfig, DistillConfig):
    """EAGLE's two terms over the unroll."""

    regression_weight: float = pinned(1.0, weight)
    """SmoothL1 on the next feature."""
    ce_weight: float = pinned(0.1, weight)
    """The distillation loss to the target's next-token distribution."""


@METHODS.register("eagle")
@dataclass
class EagleDrafterConfig(DrafterConfig):
    """An EAGLE-1 head (one decoder layer over [embedding, feature])."""

    method: str = method_field("eagle")
    intermediate_size: Optional[int] = pinned(None, opt_positive)
    """The draft layer's MLP width; None: the target's."""

    objective_config = EagleObjectiveConfig

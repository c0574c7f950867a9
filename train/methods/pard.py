"""PARD's settings (train/objectives/pard.py): a draft LM adapted to draft k tokens at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from train.methods.base import (METHODS, CodConfig, DistillConfig, DrafterConfig, method_field,
                                opt_nonneg, opt_str, pinned, positive_int, weight)


@dataclass
class PardObjectiveConfig(CodConfig, DistillConfig):
    """k masked copies of each sequence, thinned by COD."""

    pard_k: int = pinned(8, positive_int)
    """Copies of the sequence (drafts per forward)."""
    kd_weight: float = pinned(0.0, weight)
    """KL to the target's distribution (objective.loss), on top of the CE."""


@METHODS.register("pard")
@dataclass
class PardDrafterConfig(DrafterConfig):
    """A draft causal LM (served as draft_model with parallel_drafting)."""

    method: str = method_field("pard")
    model: Optional[str] = pinned(None, opt_str)
    """The draft causal LM to adapt; None: the embedded tiny draft (or a named real target's
    derived draft, train/real/draft.py)."""
    mask_token_id: Optional[int] = pinned(None, opt_nonneg)
    """The mask token; None: picked automatically (an unused id)."""

    objective_config = PardObjectiveConfig

    def model_paths(self) -> dict[str, Optional[str]]:
        return {**super().model_paths(), "drafter.model": self.model}

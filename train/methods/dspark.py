"""DSpark's settings (train/objectives/dspark.py): DFlash's block drafter with a low-rank
Markov head and a confidence head."""

from __future__ import annotations

from dataclasses import dataclass

from infer.foundation.validation import check_bool
from train.methods.base import METHODS, method_field, pinned, positive_int, weight
from train.methods.dflash import DFlashDrafterConfig, DFlashObjectiveConfig


@dataclass
class DSparkObjectiveConfig(DFlashObjectiveConfig):
    """DFlash's block loss on the Markov-corrected logits, plus the confidence head's."""

    confidence_weight: float = pinned(1.0, weight)
    """Weight of the confidence head's loss: binary cross-entropy toward each slot's
    acceptance probability 1 - TV(p, q) (no gradient through the target)."""


@METHODS.register("dspark")
@dataclass
class DSparkDrafterConfig(DFlashDrafterConfig):
    """A DSpark drafter (speculators' dspark format)."""

    method: str = method_field("dspark")
    markov_rank: int = pinned(256, positive_int)
    """Rank r of the Markov head (markov_w1 [vocab, r], markov_w2 [draft_vocab, r])."""
    confidence_head: bool = pinned(True, check_bool)
    """Train (and ship) the confidence head adaptive verification reads."""
    confidence_head_with_markov: bool = pinned(True, check_bool)
    """The confidence head reads the previous token's Markov embedding beside the hidden state."""

    objective_config = DSparkObjectiveConfig

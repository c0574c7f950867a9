"""DFlash's settings (train/objectives/dflash.py): a block of k drafts from one forward."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from infer.foundation.validation import check_bool, check_float, check_int
from train.methods.base import (METHODS, DistillConfig, HeadDrafterConfig, method_field,
                                opt_nonneg, pinned, positive_int)


@dataclass
class DFlashObjectiveConfig(DistillConfig):
    """Blocks over anchors, each slot's loss decayed."""

    block_size: int = pinned(16, partial(check_int, minimum=2))
    """Block slots (1 verified token + block_size - 1 masks = the most drafts)."""
    max_anchors: int = pinned(512, positive_int)
    """At most this many anchors (blocks) per packed row."""
    decay_gamma: float = pinned(7.0, partial(check_float, low=0.0, low_open=True))
    """Slot k's loss weight is exp(-(k - 1) / decay_gamma)."""


@METHODS.register("dflash")
@dataclass
class DFlashDrafterConfig(HeadDrafterConfig):
    """A DFlash block drafter (z-lab's format)."""

    method: str = method_field("dflash")
    embed_requires_grad: bool = pinned(False, check_bool)
    """Train (and ship) its own embedding instead of sharing the target's."""
    mask_token_id: Optional[int] = pinned(None, opt_nonneg)
    """The mask token; None: picked automatically (an unused id)."""

    objective_config = DFlashObjectiveConfig

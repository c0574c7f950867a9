"""EAGLE-3's settings (train/objectives/eagle3.py); P-EAGLE shares its head's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from infer.foundation.validation import check_bool
from train.choices import LmHeadInit
from train.methods.base import (METHODS, DistillConfig, HeadDrafterConfig, UnrollConfig,
                                choice, method_field, opt_positive, pinned,
                                weight)


@dataclass
class Eagle3HeadConfig(HeadDrafterConfig):
    """The EAGLE-3 head's architecture (eagle3 and peagle)."""

    token_map_size: Optional[int] = pinned(None, opt_positive)
    """Also export ``speculative_token_map.json``, the most frequent training-target tokens of
    the draft vocabulary, this many, and serve greedy drafts over them only
    (``speculative_token_map``; FR-Spec): a large draft vocabulary for sampled drafts at the
    LM-head cost of a small one for greedy drafts. None: no map."""
    norm_before_residual: bool = pinned(True, check_bool)
    """residual = hidden_norm(g) (speculators' flag)."""
    norm_output: bool = pinned(False, check_bool)
    """Feed norm(h) back to the next step instead of h."""
    fc_norm: bool = pinned(False, check_bool)
    """One RMSNorm per aux state before fc."""
    norm_before_fc: bool = pinned(False, check_bool)
    """One RMSNorm over the concatenated aux states before fc (input_norm)."""
    lm_head_init: LmHeadInit = pinned(LmHeadInit.target_rows, choice(LmHeadInit))
    """Start the LM head from the target's rows of the draft vocabulary (target_rows, +0.14
    acceptance length measured, docs/benchmarks-history.md) or from random weights."""
    layer_from_target: bool = pinned(False, check_bool)
    """Start as the target's last decoder layer over its last aux stream (FastMTP)."""


@dataclass
class Eagle3ObjectiveConfig(UnrollConfig, DistillConfig):
    """EAGLE-3's training-time-test unroll and loss."""

    argmax_weight: float = pinned(0.0, weight)
    """Cross-entropy on the target's greedy token (where the draft vocabulary has it), on top
    of the distillation loss: what a greedy draft must match."""


@METHODS.register("eagle3")
@dataclass
class Eagle3DrafterConfig(Eagle3HeadConfig):
    """An EAGLE-3 head (speculators' Eagle3 format)."""

    method: str = method_field("eagle3")
    embed_requires_grad: bool = pinned(False, check_bool)
    """Train (and ship) its own embedding instead of sharing the target's."""

    objective_config = Eagle3ObjectiveConfig

"""DSpark objective: DFlash's blocks (train/objectives/dflash.py) with the Markov head's bias
and the confidence head (infer/drafters/dspark.py).

Slot j of the block at anchor ``a`` predicts ``x_{a+j}``; its Markov bias comes from the token
before it, ``x_{a+j-1}`` (the anchor for slot 1), the ground truth here as the drafted token is
at serving when every earlier draft was accepted, the only case in which slot j's draft counts.
The distillation loss (DFlash's, per-slot decay and all) is on the corrected logits
``lm_head(h_j) + markov_w2 markov_w1[x_{a+j-1}]``.

The confidence head learns each slot's acceptance probability: binary cross-entropy of its
logit toward ``1 - TV(p, q) = sum min(p, q)`` (p the target's distribution, q the corrected
draft distribution, both over the draft vocabulary; no gradient through either), weighted by
``objective.confidence_weight`` over the slots that train. Its inputs (the slot's hidden state
and the Markov embedding) are detached, so learning to predict acceptance never trades against
drafting well. ``markov_w2`` starts at zero: the drafter starts as DFlash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.dspark import DSparkDrafter
from train.objectives.base import OBJECTIVES
from train.objectives.dflash import DFlashObjective

if TYPE_CHECKING:
    from train.config import TrainConfig


@OBJECTIVES.register("dspark")
class DSparkObjective(DFlashObjective):
    """DFlash's block loss on Markov-corrected logits + the confidence head (module doc)."""

    DRAFTER = DSparkDrafter

    def __init__(self, cfg: TrainConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.confidence_weight = cfg.objective.confidence_weight
        if not cfg.drafter.init_from:
            with torch.no_grad():  # no bias yet: the drafter starts as DFlash
                self.drafter.markov_head.markov_w2.weight.zero_()
                self.drafter.markov_head.markov_w1.weight.normal_(0.0, 0.02)

    @staticmethod
    def head_settings(cfg: TrainConfig) -> dict:
        d = cfg.drafter
        return {"markov_rank": d.markov_rank, "enable_confidence_head": d.confidence_head,
                "confidence_head_with_markov": d.confidence_head_with_markov}

    def slot_logits(self, h: Tensor, ids: Tensor, at: Tensor) -> Tensor:
        """DFlash's logits plus the Markov bias of each slot's previous token ``ids[at]``."""
        bias, _ = self.drafter.markov(previous_tokens(ids, at))  # [B, A, Bk-1, Vd]
        return self.drafter.logits(h) + bias

    def extra_loss(self, h: Tensor, logits: Tensor, target: Tensor, ids: Tensor, at: Tensor,
                   trains: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The confidence head's cross-entropy toward each slot's acceptance probability."""
        if self.drafter.confidence_head is None:
            return logits.new_zeros(()), {}
        _, e = self.drafter.markov(previous_tokens(ids, at))  # [B, A, Bk-1, r]
        logit = self.drafter.confidence_logit(h.detach(), e.detach())  # [B, A, Bk-1]
        with torch.no_grad():
            alpha = acceptance(target, logits)  # [B, A, Bk-1]
        bce = F.binary_cross_entropy_with_logits(logit, alpha, reduction="none")
        n = trains.sum().clamp(min=1)
        loss = (bce * trains).sum() / n
        error = ((torch.sigmoid(logit) - alpha).abs() * trains).sum() / n
        return self.confidence_weight * loss, {"loss/confidence": loss.detach(),
                                               "confidence_error": error.detach()}


def previous_tokens(ids: Tensor, at: Tensor) -> Tensor:
    """The token before each slot's prediction, ``ids [B, T]`` at ``at [B, A, S]``."""
    b, a, s = at.shape
    return ids.gather(1, at.view(b, a * s)).view(b, a, s)


def acceptance(target_logp: Tensor, logits: Tensor) -> Tensor:
    """``sum min(p, q)`` per slot: p = exp(``target_logp``), q = softmax(``logits``), both
    ``[..., Vd]`` -> ``[...]`` (float32)."""
    return torch.minimum(target_logp.float().exp(), logits.float().softmax(dim=-1)).sum(-1)

"""EAGLE-1 objective: the head of ``infer/drafters/eagle.py`` regresses the target's next
feature and matches its next-token distribution (docs/reference.md §4).

Per TTT step ``s`` (``ttt.py``; ``objective.ttt_steps`` 1 is plain EAGLE-1 training, more steps
replay the draft chain as EAGLE-3 does) at anchor ``t``::

    loss = regression_weight * SmoothL1(h^s_t, f_{t+1+s})          # mean over the H features
         + ce_weight * KL(softmax(lm_head(f_{t+1+s})) || softmax(lm_head(h^s_t)))

``f`` is the target's last hidden state after the final norm (``batch["hidden"]``, what the
frozen ``lm_head`` consumes); the head's input feature (never the regression target) gets the
uniform ``objective.feature_noise``. The KL term is the soft cross-entropy minus the target
entropy (same gradient). The embedding and LM head are the target's, shared and frozen, so the
exported checkpoint holds only ``fc`` and the decoder layer (vLLM's ``EagleLlamaForCausalLM``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.common import write_checkpoint
from infer.foundation.files import check_tensors
from infer.drafters.eagle import EagleConfig, EagleDrafter
from infer.foundation.validation import config_error
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.ttt import TTTObjective

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab

_WHERE = "train config"


@OBJECTIVES.register("eagle")
class EagleObjective(TTTObjective):
    """EAGLE-1 head + TTT unroll (module doc); ``self.drafter`` is an ``EagleDrafter``."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        o = cfg.objective
        self.regression_weight, self.ce_weight = float(o.regression_weight), float(o.ce_weight)
        self.drafter = EagleDrafter(EagleConfig.for_target(
            heads.config, intermediate_size=cfg.drafter.intermediate_size))
        if cfg.drafter.init_from:
            self._load_init(cfg.drafter.init_from)
        self.drafter.attach_target(heads)  # shared embedding + LM head (frozen, not saved)

    def _load_init(self, path: str) -> None:
        init = EagleDrafter.from_pretrained(path)
        self.drafter.config.fc_bias = init.config.fc_bias
        if init.config.fc_bias != (self.drafter.fc.bias is not None):
            fc = self.drafter.fc  # the checkpoint decides the bias, as on load
            self.drafter.fc = torch.nn.Linear(fc.in_features, fc.out_features,
                                              bias=init.config.fc_bias)
        try:
            self.drafter.load_state_dict(init.state_dict())
        except RuntimeError as e:  # other hidden / intermediate size
            raise config_error("drafter.init_from", path, f"an eagle checkpoint shaped like "
                               f"this drafter ({e})", _WHERE) from None

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    # ---- TTT hooks ---------------------------------------------------------------------------

    def features(self, batch: dict[str, Tensor]) -> Tensor:
        return self.noisy(batch["hidden"].to(self.drafter.fc.weight.dtype))  # [B, T, H]

    def targets(self, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        hidden = batch["hidden"][rows]  # [M, H]
        logits = self.heads.lm_head(hidden.to(self.heads.lm_head.weight.dtype)).float()
        return {"hidden": hidden, "logp": F.log_softmax(logits, dim=-1)}  # [M, V]

    def step_loss(self, step, logits, hidden, targets):
        feature, target = targets["hidden"], targets["logp"]  # [N, H] (f_{t+1+step}), [N, V]
        reg = F.smooth_l1_loss(hidden.float(), feature.float(), reduction="none").mean(-1)
        kl = self.distill(logits, target)  # [N]
        loss = self.regression_weight * reg + self.ce_weight * kl
        return loss, logits.argmax(-1) == target.argmax(-1), {"regression": reg, "kl": kl}

    # ---- export ------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """vLLM's EAGLE checkpoint (``config.json`` in ``EAGLEConfig`` shape + weights)."""
        state = self.drafter_state(state_dict)
        check_tensors(path, self.drafter.state_dict(), state)
        return write_checkpoint(path, self.drafter.config.to_dict(), state)

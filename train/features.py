"""Target features for drafter training: online capture (frozen target forward inside the step).

``capture(target, batch, spec)`` runs the frozen native target (``infer.models.load_model``) over
a packed batch with the block-diagonal document mask and adds what the objective's
``FeatureSpec`` asks for (``aux`` and / or ``hidden``; see ``train/objectives/base.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.models.llama import Llama
from train.data import document_attention_mask
from train.objectives.base import FeatureSpec, TargetHeads


def target_heads(target: Llama) -> TargetHeads:
    """The loaded target's embedding and LM head, shared (frozen) with the objective."""
    return TargetHeads(target.config, target.embed_tokens, target.lm_head)


@torch.no_grad()
def capture(target: Llama, batch: dict[str, Tensor], spec: FeatureSpec) -> dict[str, Tensor]:
    """``batch`` plus ``aux [B, T, n * H]`` / ``hidden [B, T, H]`` from one target forward."""
    if not spec.needs_target:
        return batch
    out = target.forward_train(batch["input_ids"], batch["position_ids"],
                               document_attention_mask(batch["doc_ids"]),
                               aux_layer_ids=spec.aux_layer_ids,
                               logits_at=batch["input_ids"].new_zeros(batch["input_ids"].shape[0], 1))
    batch = dict(batch)
    if spec.aux_layer_ids:
        batch["aux"] = torch.cat(out.aux, dim=-1)  # [B, T, n * H], sorted id order
    if spec.hidden:
        batch["hidden"] = out.hidden  # [B, T, H] after the final norm
    return batch


class OnlineFeatures:
    """Callable the trainer applies to every batch on the device: adds the target features."""

    def __init__(self, target: Llama, spec: FeatureSpec):
        self.target, self.spec = target, spec

    def __call__(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return capture(self.target, batch, self.spec)

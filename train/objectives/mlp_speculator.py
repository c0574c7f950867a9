"""IBM MLP speculator objective (docs/reference.md §5): teacher-forced heads over the frozen
target's last hidden state.

Alignment (the one rule everything below follows): head ``i`` (0-based) at position ``t`` starts
from ``s_0 = hidden_t`` (the target state that predicts token ``t + 1``), consumes the ground-truth

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab
tokens ``t + 1 .. t + 1 + i`` (one per stage) and predicts token ``t + 2 + i``. In serving, the
same head sees the target's state behind the pending token and the pending token itself, then its
own drafts, so head ``i`` is draft ``i + 1`` after the token the target has already emitted.

A prediction is trained only where the predicted token is a training target (``loss_mask``) and
lies in the same document as ``t`` (then every token in between does too: documents are
contiguous). Loss: ``sum_i mean_t CE_i`` (the IBM recipe: CE summed over heads), plus, when
``objective.kd_weight > 0``, ``kd_weight * KL(target || head_i)`` against the target's own
distribution for the same token (``heads.lm_head(hidden_{t+1+i})``).

Two-stage training (stage 1 on dataset text, stage 2 on text the target generated itself) is
listed by ``stages()`` and run by the pipeline with the same objective on different rows; the
loss itself is stage-agnostic.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer.drafters.common import write_checkpoint
from infer.drafters.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, MLPSpeculatorLayerNorm
from infer.foundation.validation import config_error
from train.config import validate_section
from train.objectives.base import (OBJECTIVES, FeatureSpec, LossOutput, Objective, Stage,
                                   StageData)
from train.objectives.losses import expected_acceptance, masked_mean

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab

_WHERE = "train config"


def shifted_targets(input_ids: Tensor, loss_mask: Tensor, doc_ids: Tensor, n: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher-forcing inputs and targets of ``n`` heads over a packed batch.

    ``input_ids`` / ``loss_mask`` / ``doc_ids`` ``[B, T]`` -> ``(tokens, targets, valid)``, each
    ``[B, T, n]``: ``tokens[b, t, i]`` = token ``t + 1 + i`` (stage i's input), ``targets[b, t, i]``
    = token ``t + 2 + i`` (head i's label), ``valid[b, t, i]`` = that label exists, has
    ``loss_mask`` set and is in the document of ``t``. Beyond the row, ids are 0 (never valid).
    """
    b, t = input_ids.shape
    pad = n + 1
    ids = F.pad(input_ids, (0, pad), value=0)  # [B, T + n + 1]
    lm = F.pad(loss_mask.bool(), (0, pad), value=False)
    doc = F.pad(doc_ids, (0, pad), value=-1)  # -1: no real document
    tokens = torch.stack([ids[:, 1 + i: 1 + i + t] for i in range(n)], dim=-1)  # [B, T, n]
    targets = torch.stack([ids[:, 2 + i: 2 + i + t] for i in range(n)], dim=-1)  # [B, T, n]
    valid = torch.stack([lm[:, 2 + i: 2 + i + t] & (doc[:, 2 + i: 2 + i + t] == doc_ids)
                         for i in range(n)], dim=-1)  # [B, T, n]
    return tokens, targets, valid


def reset_parameters(model: MLPSpeculator) -> MLPSpeculator:
    """IBM fms-extras' init: embeddings and linears ~ N(0, 1/sqrt(inner_dim)), norms 1 / 0."""
    std = 1 / math.sqrt(model.config.hidden_dim)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Embedding, nn.Linear)):
                m.weight.normal_(0, std)
            elif isinstance(m, MLPSpeculatorLayerNorm) and m.weight is not None:
                m.weight.fill_(1.0)
                m.bias.zero_()
    return model


@OBJECTIVES.register("mlp_speculator")
class MLPSpeculatorObjective(Objective):
    """Trains :class:`~infer.drafters.mlp_speculator.MLPSpeculator` (see the module doc).

    Settings: ``drafter.n_predict``, ``inner_dim`` (0 = target hidden size), ``tie_weights``,
    ``scale_input``, ``init_from`` (an exported mlp_speculator directory of the same shape);
    ``objective.kd_weight``.
    """

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        validate_section("objective", cfg.objective)  # kd_weight, the stage-2 settings ...
        d = cfg.drafter
        config = MLPSpeculatorConfig.for_target(heads.config, n_predict=d.n_predict,
                                                inner_dim=d.inner_dim, tie_weights=d.tie_weights,
                                                scale_input=d.scale_input)
        self.drafter = reset_parameters(MLPSpeculator(config))
        self.kd_weight = float(cfg.objective.kd_weight)
        if d.init_from:
            self._init_from(d.init_from)

    def _init_from(self, path: str) -> None:
        """Start from an exported speculator; its shape must match the configured one."""
        loaded = MLPSpeculator.from_pretrained(path, dtype=torch.float32)
        want, got = self.drafter.config, loaded.config
        for key in ("emb_dim", "vocab_size", "n_predict", "hidden_dim", "tie_weights",
                    "scale_input"):
            if getattr(want, key) != getattr(got, key):
                raise config_error("drafter.init_from", path, f"an mlp_speculator checkpoint with "
                                   f"{key}={getattr(want, key)!r} (the configured drafter); it "
                                   f"has {key}={getattr(got, key)!r}", _WHERE)
        self.drafter.load_state_dict(loaded.state_dict())

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def stages(self) -> list[Stage]:
        """IBM's recipe (fms-fsdp): stage 1 on the dataset; with ``objective.stage2_steps``,
        stage 2 on the same prompts answered by the target itself, continuing stage 1's
        optimizer (its moments) at ``stage2_lr_factor`` of the peak lr after a warmup of
        ``stage2_warmup_steps`` (None: min(2000, steps // 20)), cosine-annealed to
        ``stage2_min_lr_ratio`` of that peak: restarting at full lr with fresh moments and no
        warmup risks a loss spike on the shifted data."""
        o = self.cfg.objective
        steps = o.stage2_steps
        if steps <= 0:
            return [Stage()]
        validate_section("objective", o)  # changed since __init__ (tests, notebooks)
        warmup = (min(2000, steps // 20) if o.stage2_warmup_steps is None
                  else o.stage2_warmup_steps)
        trainer = {"max_steps": steps, "lr": self.cfg.trainer.lr * o.stage2_lr_factor,
                   "warmup_steps": warmup, "warmup_ratio": 0.0, "schedule": "cosine",
                   "min_lr_ratio": o.stage2_min_lr_ratio}
        return [Stage(), Stage("stage2", StageData.target_answers, trainer,
                               carry_optimizer=True)]

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        """The loss over the positions where some head has a label: a stage mixes nothing
        across positions, so the rest (prompts, padding, row ends; ~30 % of a chat row) is
        dropped before the stages, whose vocabulary-wide heads are nearly all of a step's work."""
        ids = batch["input_ids"]  # [B, T]
        t = ids.shape[1]
        n = self.drafter.n_predict
        tokens, targets, valid = shifted_targets(ids, batch["loss_mask"], batch["doc_ids"], n)
        rows, cols = valid.any(-1).nonzero(as_tuple=True)  # [M] each
        tokens, targets, valid = tokens[rows, cols], targets[rows, cols], valid[rows, cols]
        hidden = batch["hidden"]  # [B, T, H] target last hidden state (after the final norm)
        target_logp = None
        if self.kd_weight > 0:
            with torch.no_grad():  # [B, T, V]: the target's next-token log-probabilities
                lm = self.heads.lm_head
                target_logp = F.log_softmax(lm(hidden.to(lm.weight.dtype)).float(), dim=-1)
        dtype = self.drafter.proj[0].weight.dtype
        state = self.drafter.prepare(hidden[rows, cols].to(dtype))  # [M, emb_dim]
        loss = hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        all_right = torch.ones_like(valid[:, 0])  # [M]: heads 0..i all right
        for i in range(n):
            logits, state = self.drafter.step(i, state, tokens[:, i])  # [M, V]
            v = valid[:, i]  # [M]
            count = v.sum().clamp(min=1)
            ce = F.cross_entropy(logits.float(), targets[:, i], reduction="none")  # [M]
            head_loss = masked_mean(ce, v)
            metrics[f"loss/head_{i}"] = head_loss.detach()
            if target_logp is not None:  # head i at t is matched by the target at t + 1 + i
                kl = self.distill(logits, target_logp[rows, (cols + 1 + i).clamp(max=t - 1)])
                kd = (kl * v).sum() / count  # [M] -> scalar
                metrics[f"loss/kd_{i}"] = kd.detach()
                head_loss = head_loss + self.kd_weight * kd
            loss = loss + head_loss
            with torch.no_grad():
                right = logits.argmax(dim=-1) == targets[:, i]  # [M]
                all_right = all_right & right
                metrics[f"acc_{i}"] = (right & v).sum() / count
                metrics[f"full_acc_{i}"] = (all_right & v).sum() / count
        metrics["acceptance_length_est"] = 1 + sum(metrics[f"full_acc_{i}"] for i in range(n))
        metrics["eal"] = expected_acceptance([metrics[f"acc_{i}"] for i in range(n)])
        return LossOutput(loss, metrics, valid.sum())

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """vLLM's mlp_speculator directory (``config.json`` + ``model.safetensors``), atomic."""
        if state_dict is None:
            return self.drafter.save_pretrained(path)
        state = self.drafter_state(state_dict)
        names = self.drafter.vllm_state_dict()  # a tied tensor once, under its first name
        missing = sorted(set(names) - set(state))
        if missing:
            raise ValueError(f"mlp_speculator export: the state dict lacks {missing[:8]}")
        return write_checkpoint(path, self.drafter.config.to_dict(),
                                {k: state[k] for k in names})


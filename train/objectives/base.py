"""The objective interface and registry: one file per drafter method, registered by name.

An objective is an ``nn.Module`` that owns the trainable drafter (``self.drafter``, registered)
and borrows the frozen target pieces it needs (``TargetHeads``: embedding and LM head, shared,
never registered, so they are neither trained, saved nor wrapped by DDP/DeepSpeed). Its
``forward(batch)`` is the whole training computation of one micro-batch (unroll + loss +
metrics): the trainer hands the objective itself to ``accelerator.prepare``, so calling it goes
through DDP's / DeepSpeed's ``__call__`` and gradients are synchronised. (Calling
``model.module.forward_train`` directly would silently skip that.)

Batch layout (``train.data.collate`` + ``train.features``), all on the training device::

    input_ids     int64 [B, T]   packed documents (train/data.py module doc)
    loss_mask     bool  [B, T]   loss_mask[t]: token t is a training target
    position_ids  int64 [B, T]   restart at 0 per document
    doc_ids       int64 [B, T]   document index per token (attention never crosses documents)
    aux           [B, T, n * H]  target residual streams after ``aux_layer_ids`` layers, sorted
                                 id order, concatenated (only when the spec asks for them)
    hidden        [B, T, H]      target last hidden state after the final norm (when asked);
                                 target logits are ``heads.lm_head(hidden)`` (never stored)
    greedy  int64 [B, T]         the target's greedy next token at t (argmax over its whole
                                 vocabulary; when asked; computed once, cached offline)

Multi-stage training is data too: ``Objective.stages()`` lists the stages (``Stage``) and the
pipeline loops over them on one loaded target. Nothing branches on a method name: the pipeline
looks the class up in ``OBJECTIVES`` (``@OBJECTIVES.register("eagle3")`` in each module).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch
from torch import Tensor, nn

from infer.foundation.registry import Registry
from infer.foundation.validation import StrChoice
from infer.models.llama import ModelConfig
from infer.models.output import FeatureSpec  # noqa: F401 (re-exported for the objectives)

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.vocab import DraftVocab

OBJECTIVES: Registry[type["Objective"]] = Registry("train.objectives", "drafter.method",
                                                   "train config")


def from_end(ids, num_layers: int) -> list:
    """``drafter.aux_layer_ids`` with negative ids counted from the end, as Python indexes a
    list of the ``n + 1`` residual streams: -1 = ``n`` (the last layer's output), -2 = ``n - 1``.
    A recipe can so name "the last layer" whatever the target's depth; checkpoints always hold
    the resolved ids (what vLLM and speculators read)."""
    return [k + num_layers + 1 if isinstance(k, int) and not isinstance(k, bool) and k < 0
            else k for k in ids]


def last_layer_state(target_dir: str | Path, config: ModelConfig,
                     key: str) -> tuple[dict[str, Tensor], Tensor]:
    """The target's last decoder layer (native names, without ``model.layers.{n - 1}.``; fused
    Phi-3 weights split) and its final norm, float32, read from the checkpoint: the start of a
    head built from the target (the MTP objective's fresh layer, EAGLE-3's
    ``drafter.layer_from_target``). The head is a Llama-shaped layer, so a target the engine
    does not run (Gemma's extra norms, MoE experts ...) is refused naming ``key``, the setting
    that asked for the copy."""
    from infer.foundation.files import open_safetensors
    from infer.foundation.validation import config_error
    from infer.models.foreign import engine_gap
    from infer.models.loader import fused_parts, weight_files

    gap = engine_gap(target_dir)
    if gap is not None:
        raise config_error(key, True, "a target draftsmith's engine runs (the head starts as a "
                           f"copy of its Llama-shaped last layer); this one: {gap}", "train config")
    prefix, layer, norm = f"model.layers.{config.num_layers - 1}.", {}, None
    for file in weight_files(Path(target_dir)):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name.startswith(prefix):
                    whole = f.get_tensor(name).float()
                    for part, rows in fused_parts(name.removeprefix(prefix), whole.shape, config):
                        layer[part] = whole if rows is None else whole[rows]
                elif name == "model.norm.weight":
                    norm = f.get_tensor(name).float()
    return layer, norm


class StageData(StrChoice):
    """The rows a training stage reads."""

    dataset = "dataset"  # the prepared training data (regenerated when regenerate.enabled)
    target_answers = "target_answers"  # the same prompts answered by the target itself


@dataclass(frozen=True)
class Stage:
    """One training stage of an objective: ``name`` names its checkpoint folder, log prefix and
    data folder ("main" is the plain run); ``data`` says which rows it trains on; ``trainer``
    overrides ``TrainerConfig`` fields for this stage (e.g. its own step budget); with
    ``carry_optimizer`` the stage starts from the previous stage's optimizer moments where the
    trainer holds them (not under DeepSpeed / FSDP)."""

    name: str = "main"
    data: StageData = StageData.dataset
    trainer: Mapping[str, Any] = field(default_factory=dict)
    carry_optimizer: bool = False  # start from the previous stage's optimizer moments


@dataclass
class TargetHeads:
    """The frozen target's token embedding and LM head (+ its config), shared by drafters."""

    config: ModelConfig
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "TargetHeads":
        self.embed_tokens.to(device=device, dtype=dtype)
        self.lm_head.to(device=device, dtype=dtype)
        return self


@dataclass
class LossOutput:
    """``loss``: scalar to backpropagate; ``metrics``: detached scalar tensors (no host sync),
    e.g. ``loss/step_0``, ``full_acc_0``, ``cond_acc_1``; ``num_tokens``: loss positions."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    num_tokens: Tensor | None = None


class Objective(nn.Module, ABC):
    """Base of every training objective (see the module doc).

    Subclasses set ``self.drafter`` in ``__init__`` and implement ``feature_spec``, ``forward``
    and ``export``. ``cfg`` is the whole ``TrainConfig``: its ``drafter`` and ``objective``
    sections are the method's own settings classes (train/methods/<name>.py), holding only what
    the method reads; ``vocab`` is the ``DraftVocab`` of the training data.
    """

    name: ClassVar[str] = ""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__()
        self.cfg, self.vocab, self.target_dir = cfg, vocab, str(target_dir)
        object.__setattr__(self, "heads", heads)  # frozen, not a submodule

    def distill(self, logits: Tensor, target_logp: Tensor) -> Tensor:
        """``objective.loss`` per position between the draft's ``logits [..., V]`` and the
        target's ``target_logp [..., V]`` (train/objectives/losses.py)."""
        from train.objectives.losses import distill_loss

        return distill_loss(str(self.cfg.objective.loss), logits, target_logp)

    @abstractmethod
    def feature_spec(self) -> FeatureSpec:
        """Which target features ``forward`` reads from the batch (``aux`` / ``hidden``)."""

    @classmethod
    def planned_feature_spec(cls, cfg: TrainConfig, target: ModelConfig) -> FeatureSpec | None:
        """What ``feature_spec()`` will return for ``cfg`` on a target shaped ``target``, from
        the configs alone: ``plan=true`` (train/plan.py) sizes the features before any weight
        is read or drafter built. None: this method cannot tell (the plan says so)."""
        return None

    def stages(self) -> list[Stage]:
        """The training stages, in order (one plain stage unless the method needs more)."""
        return [Stage()]

    @abstractmethod
    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        """One micro-batch: unroll the drafter, return the loss and its metrics."""

    @abstractmethod
    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write the drafter in its deployment format (what vLLM / the engine load).

        ``state_dict``: the objective's full state dict gathered by the trainer (DeepSpeed
        ZeRO-3 / FSDP shard parameters); None = this module's own parameters.
        """

    @classmethod
    def served_config(cls, path: str | Path) -> dict:
        """The ``speculative_config`` (without k) that serves an exported drafter at ``path``
        (the method name by default; PARD overrides it: draft_model + parallel_drafting)."""
        return {"method": cls.name, "model": str(path)}

    def speculative_config(self, path: str | Path, k: int) -> dict:
        return {**self.served_config(path), "num_speculative_tokens": k}

    def serving_notes(self) -> str | None:
        """What deploying this drafter asks of the servers (EAGLE-3: the vLLM versions that
        serve its features as trained); printed before training starts."""
        return None

    def drafter_state(self, state_dict: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """``drafter.*`` entries of an objective state dict, prefix removed."""
        if state_dict is None:
            return self.drafter.state_dict()
        return {k.removeprefix("drafter."): v for k, v in state_dict.items()
                if k.startswith("drafter.")}

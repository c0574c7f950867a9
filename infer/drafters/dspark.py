"""DSpark drafter (speculators / vLLM ``dspark``; docs/reference.md §17): DFlash's block backbone
plus a low-rank Markov head and a confidence head.

One parallel forward of the block gives every slot's hidden state ``h_i`` and base logits
``lm_head(h_i)``, exactly as DFlash (``infer/drafters/dflash.py``). Drafting then runs left to
right over the slots, each adding a bias from the previously drafted token::

    e_i      = markov_w1[prev_i]                       # [r]; prev_1 = the pending (anchor) token,
                                                       #      prev_i = the token drafted at i - 1
    logits_i = lm_head(h_i) + markov_w2 @ e_i          # [Vd]
    conf_i   = sigmoid(proj([h_i ; e_i]))               # the chance draft i is accepted

``markov_w1`` [vocab, r] is indexed by target token ids (the drafted id mapped through ``d2t``),
``markov_w2`` [draft_vocab, r] maps into the draft vocabulary; ``proj`` [1, H (+ r)] has a bias
and runs in float32 (vLLM's). The Markov head type is vLLM's runtime one, ``vanilla``; the
confidence head reads ``e_i`` only with ``confidence_head_with_markov``.

Export: the speculators layout (``speculators_model_type: dspark``, architecture
``Qwen3DSparkModel``, DFlash's keys plus ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``; tensors ``markov_head.markov_w1
.weight``, ``markov_head.markov_w2.weight``, ``confidence_head.proj.weight`` / ``.bias`` beside
DFlash's). Matched against vLLM 0.32's ``model_executor/models/qwen3_dspark.py`` (names, shapes,
the float32 confidence) and ``v1/worker/gpu/spec_decode/dspark/speculator.py`` (the
left-to-right loop, the anchor as the first ``prev``, confidences from the slot's hidden state).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from infer.drafters.dflash import DFlashConfig, DFlashDrafter
from infer.foundation.validation import config_error
from infer.models.llama import ModelConfig

MARKOV_HEAD_TYPES = ("vanilla",)  # what vLLM's runtime applies
_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head",
         "confidence_head_with_markov")
_WHERE = "dspark config.json"


@dataclass
class DSparkConfig(DFlashConfig):
    """DFlash's config plus the Markov and confidence heads' settings."""

    MODEL_TYPE = "dspark"

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) \
                or self.markov_rank < 1:
            raise config_error("markov_rank", self.markov_rank, "an integer >= 1", _WHERE)
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise config_error("markov_head_type", self.markov_head_type,
                               f"one of {', '.join(MARKOV_HEAD_TYPES)} (vLLM's runtime)", _WHERE)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(architectures=["Qwen3DSparkModel"], speculators_model_type="dspark",
                 **{k: getattr(self, k) for k in _KEYS})
        d["speculators_config"]["algorithm"] = "dspark"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DSparkConfig":
        """The speculators layout (DFlash's keys parsed as DFlash's, plus the heads')."""
        if d.get("speculators_model_type") != "dspark":
            raise config_error("speculators_model_type", d.get("speculators_model_type"),
                               "'dspark'", _WHERE)
        rest = {k: v for k, v in d.items() if k not in _KEYS}
        base = DFlashConfig.from_dict({**rest, "speculators_model_type": "dflash"})
        return cls.extend(base, **{k: d[k] for k in _KEYS if k in d})

    @classmethod
    def extend(cls, base: DFlashConfig, **heads) -> "DSparkConfig":
        """``base`` (a DFlash config) with the heads' settings ``heads``."""
        return cls(**{f.name: getattr(base, f.name) for f in fields(DFlashConfig)}, **heads)

    @classmethod
    def for_target(cls, target: ModelConfig, **kwargs) -> "DSparkConfig":
        """DFlash's draft layers for ``target``; the heads' settings among ``kwargs``."""
        heads = {k: kwargs.pop(k) for k in _KEYS if k in kwargs}
        return cls.extend(DFlashConfig.for_target(target, **kwargs), **heads)


class MarkovHead(nn.Module):
    """``markov_w1`` [vocab, r] (the previous token's embedding, target ids) and ``markov_w2``
    [draft_vocab, r] (its bias over the draft vocabulary)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """``proj`` [1, H (+ r)] with a bias: a draft's acceptance logit."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=True)


class DSparkDrafter(DFlashDrafter):
    """DFlash's backbone with the Markov and confidence heads (module doc)."""

    CONFIG = DSparkConfig

    def __init__(self, config: DSparkConfig, *, with_embedding: bool = False,
                 with_lm_head: bool | None = None):
        super().__init__(config, with_embedding=with_embedding, with_lm_head=with_lm_head)
        h, r = self.layer_config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(self.layer_config.vocab_size, config.draft_vocab_size, r)
        self.confidence_head = (ConfidenceHead(h + (r if config.confidence_head_with_markov
                                                    else 0))
                                if config.enable_confidence_head else None)

    def markov(self, prev: Tensor) -> tuple[Tensor, Tensor]:
        """Previous tokens (target ids) ``[...]`` -> (bias over the draft vocabulary
        ``[..., Vd]``, their Markov embeddings ``[..., r]``)."""
        e = self.markov_head.markov_w1(prev)  # [..., r]
        return self.markov_head.markov_w2(e), e

    def confidence_logit(self, h: Tensor, e: Tensor) -> Tensor:
        """The confidence head's logit ``[...]`` (float32) from a slot's hidden state
        ``h [..., H]`` and its previous token's Markov embedding ``e [..., r]``."""
        if self.confidence_head is None:
            raise RuntimeError("this DSpark drafter has no confidence head")
        x = torch.cat([h, e], dim=-1) if self.config.confidence_head_with_markov else h
        proj = self.confidence_head.proj
        return nn.functional.linear(x.float(), proj.weight.float(), proj.bias.float())[..., 0]

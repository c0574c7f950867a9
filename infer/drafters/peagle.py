"""P-EAGLE head (parallel-drafting EAGLE-3; docs/reference.md §11): an EAGLE-3 head plus one
learned vector ``mask_hidden``, trained so that ONE forward gives K drafts.

Inference rows of a step (after the usual EAGLE-3 catch-up pairs ``(g_t, x_{t+1})``)::

    K - 1 mask rows:  input_id = mask_token_id,  g = prepare(mask_hidden),  positions continuing

``mask_hidden`` ``[1, 1, n_aux * H_t]`` lives in the *pre-fc* feature space, so the mask rows'
hidden input is ``prepare(mask_hidden)`` (``input_norm`` / ``fc_norm`` when configured, then
``fc``), exactly what vLLM 0.32 does: ``llm_base_proposer.py::load_model`` copies
``model.combine_hidden_states(mask_hidden.view(-1))`` into ``parallel_drafting_hidden_state_tensor``
(``combine_hidden_states`` = ``input_norm`` -> ``fc_norm`` chunks -> ``fc``,
``model_executor/models/llama_eagle3.py``), and ``_copy_and_expand_eagle_inputs``
(``v1/spec_decode/utils.py``) writes the mask token with positions ``start + j``.

Checkpoint = EAGLE-3's (:mod:`infer.drafters.eagle3`) plus, matched to vLLM 0.32:

- ``speculators_model_type: "peagle"``; ``transformers_utils/configs/speculators/algos.py::
  update_peagle`` reads the top-level ``mask_token_id`` (required: it indexes it) into
  ``pard_token``, defaults a missing ``norm_before_residual`` to **False** and picks
  ``PeagleLlamaForCausalLM`` (= ``Eagle3LlamaForCausalLM``); ``base.py`` maps the type to
  ``{"method": "eagle3", "parallel_drafting": true}``.
- ``mask_token_id`` also inside ``transformer_layer_config``: the proposer's
  ``_init_parallel_drafting_params`` reads the HF config's ``mask_token_id`` before
  ``pard_token``, and an eagle3-typed copy of the config only keeps it there.
- ``speculators_config.algorithm: "peagle"``, ``architectures: ["PEagleSpeculator"]``
  (speculators' ``PEagleSpeculatorConfig``), ``proposal_methods[0].speculative_tokens`` = the
  depths trained (vLLM does not check K against it; this engine refuses a larger K).
- tensor ``mask_hidden`` (``Eagle3LlamaForCausalLM.load_weights`` raises without it; it takes
  any shape that ``view(1, -1)``s to ``n_aux * H_t``) and ``embed_tokens.weight`` when the mask
  row was trained (``embed_requires_grad``, the peagle default), else vLLM shares the target's
  untrained row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from infer.foundation.errors import FileFormatError
from infer.foundation.validation import config_error

MODEL_TYPE = "peagle"
ARCHITECTURE = "PEagleSpeculator"  # speculators' name; vLLM derives its own from model_type
_WHERE = "peagle config.json"


@dataclass
class PEagleConfig(Eagle3Config):
    """EAGLE-3's config plus the mask token; ``speculative_tokens`` = depths trained."""

    norm_before_residual: bool = False  # vLLM's default for peagle when the key is absent
    embed_requires_grad: bool = True  # the mask token's embedding row is learned
    mask_token_id: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        m, vocab = self.mask_token_id, self.vocab_size
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < vocab:
            raise config_error("mask_token_id", m, f"a token id in [0, {vocab}) (the P-EAGLE "
                               "mask token; vLLM requires it)", _WHERE)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["architectures"] = [ARCHITECTURE]
        d["speculators_model_type"] = MODEL_TYPE
        d["mask_token_id"] = self.mask_token_id
        d["transformer_layer_config"] = {**d["transformer_layer_config"],
                                         "mask_token_id": self.mask_token_id}
        d["speculators_config"] = {**d["speculators_config"], "algorithm": MODEL_TYPE}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PEagleConfig":
        """Parse a speculators peagle ``config.json`` (EAGLE-3's keys + ``mask_token_id``, at the
        top level or inside ``transformer_layer_config``); vLLM's defaults for missing keys."""
        if d.get("speculators_model_type") != MODEL_TYPE:
            raise config_error("speculators_model_type", d.get("speculators_model_type"),
                               f"'{MODEL_TYPE}'", _WHERE)
        base = Eagle3Config.from_dict({
            **d, "speculators_model_type": "eagle3",
            "norm_before_residual": d.get("norm_before_residual", False),
            "embed_requires_grad": d.get("embed_requires_grad", True)})
        extra = dict(base.extra)
        mask = extra.pop("mask_token_id", None)
        layer = dict(base.transformer_layer_config)  # to_dict writes the mask id back
        inner = layer.pop("mask_token_id", None)
        values = {f.name: getattr(base, f.name) for f in fields(Eagle3Config)}
        return cls(**{**values, "extra": extra, "transformer_layer_config": layer},
                   mask_token_id=inner if mask is None else mask)

    def eagle3(self) -> Eagle3Config:
        """The same head as a plain EAGLE-3 config (no mask token)."""
        return Eagle3Config(**{f.name: getattr(self, f.name) for f in fields(Eagle3Config)})


class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3 head + ``mask_hidden [1, 1, n_aux * H_t]`` (module doc)."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, *, with_embedding: bool | None = None):
        super().__init__(config, with_embedding=with_embedding)
        # speculators initialises it as randn; from_pretrained overwrites it
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, self.fc.in_features))

    def mask_features(self) -> Tensor:
        """The mask rows' hidden input ``prepare(mask_hidden)`` ``[1, 1, H]`` (vLLM's
        ``combine_hidden_states(mask_hidden)``)."""
        return self.prepare(self.mask_hidden.to(self.fc.weight.dtype))

    @classmethod
    def check_state(cls, state: dict[str, Tensor], model_dir: Path) -> None:
        if "mask_hidden" not in state:
            raise FileFormatError(f"{model_dir}/model.safetensors has no 'mask_hidden' tensor, "
                                  "which a P-EAGLE (speculators_model_type 'peagle') checkpoint "
                                  "needs (the mask rows' features; vLLM refuses it too)")

    def as_eagle3(self) -> Eagle3Drafter:
        """A plain EAGLE-3 head with this head's weights (no ``mask_hidden``), e.g. to start an
        objective's common initialisation from a P-EAGLE checkpoint."""
        head = Eagle3Drafter(self.config.eagle3(), with_embedding=self.embed_tokens is not None)
        head.load_state_dict({k: v for k, v in self.state_dict().items() if k != "mask_hidden"})
        head.share_embedding(self.shared_embed)
        return head

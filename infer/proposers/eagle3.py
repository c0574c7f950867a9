"""EAGLE-3 chain proposer (``method: eagle3``): the shared EAGLE chain drafting of
:mod:`infer.proposers.eagle` over the speculators EAGLE-3 head of :mod:`infer.drafters.eagle3`.

Features are the target's aux residual streams ``eagle_aux_hidden_state_layer_ids`` (sorted;
missing in the config -> :func:`default_aux_layer_ids` of the target, as vLLM does), concatenated
and projected by the head's ``fc`` once when they arrive. Drafts are in the head's reduced
vocabulary and mapped to target ids through ``d2t``; draft probabilities are scattered into the
full target vocabulary. With ``speculative_token_map`` and greedy drafts the head keeps only the
map's tokens (:func:`~infer.drafters.common.restrict_vocab`).
"""

from __future__ import annotations

import logging
from typing import ClassVar

from torch import Tensor

from infer.foundation.errors import FileFormatError
from infer.drafters.common import read_token_map, restrict_vocab
from infer.drafters.eagle3 import Eagle3Drafter, default_aux_layer_ids
from infer.models.output import FeatureSpec, ModelOutput
from infer.proposers.base import PROPOSERS, ProposerContext, aux_features, check_head_fits
from infer.proposers.eagle import EagleChainProposer
from infer.spec_config import SpeculativeConfig

log = logging.getLogger(__name__)


@PROPOSERS.register("eagle3")
class Eagle3Proposer(EagleChainProposer):
    #: the head class loaded (P-EAGLE's proposer loads its subclass with the same checks)
    drafter_class: ClassVar[type[Eagle3Drafter]] = Eagle3Drafter

    def load_drafter(self, spec: SpeculativeConfig, ctx: ProposerContext) -> Eagle3Drafter:
        drafter = self.drafter_class.from_pretrained(spec.model, dtype=ctx.dtype,
                                                     device=ctx.device)
        cfg, target = drafter.config, ctx.target_config
        where = f"eagle3 drafter {spec.model}"
        if cfg.eagle_aux_hidden_state_layer_ids is None:
            cfg.eagle_aux_hidden_state_layer_ids = default_aux_layer_ids(target.num_layers)
        check_head_fits(where, "eagle_aux_hidden_state_layer_ids",
                        cfg.eagle_aux_hidden_state_layer_ids, cfg.vocab_size, cfg.target_hidden,
                        ctx)
        if drafter.embed_tokens is None:  # no embed_tokens.weight: share the target's
            if drafter.layer_config.hidden_size != target.hidden_size:
                raise FileFormatError(f"{where}: has no embed_tokens.weight and its hidden_size "
                                 f"{drafter.layer_config.hidden_size} differs from the target's "
                                 f"{target.hidden_size}, so the target's embedding cannot be "
                                 "shared")
            drafter.share_embedding(ctx.target.embed_tokens)
        if spec.speculative_token_map and spec.draft_sample_method == "greedy":
            restrict_to_map(drafter, spec.speculative_token_map, ctx.vocab_size, where)
        return drafter

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=self.drafter.aux_layer_ids)  # sorted

    def target_features(self, target_output: ModelOutput) -> Tensor:
        return aux_features(target_output, self.drafter.aux_layer_ids, "eagle3")


def restrict_to_map(drafter: Eagle3Drafter, token_map: str, vocab_size: int, where: str) -> None:
    """Greedy drafts over the ``speculative_token_map`` file's tokens only
    (:func:`~infer.drafters.common.restrict_vocab`); a map that shares no token with the head is
    a user error naming both."""
    before, ids = drafter.lm_head.weight.shape[0], read_token_map(token_map, vocab_size)
    try:
        kept = restrict_vocab(drafter, ids)
    except ValueError as e:
        raise FileFormatError(f"{where}: {e} (speculative_token_map {token_map!r})") from None
    log.info("%s: greedy drafts over %d of its %d draft tokens (speculative_token_map %s)",
             where, kept, before, token_map)

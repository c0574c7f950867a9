"""``method: mtp``: draft with the target's own multi-token-prediction layers
(``infer/drafters/mtp.py``; docs/reference.md §14).

The chain is EAGLE's (:class:`~infer.proposers.eagle.EagleChainProposer`): a catch-up pass over
the newly verified pairs ``(h_t, x_{t+1})`` keeps the MTP layer's KV cache in step with the
target, then ``k - 1`` single-pair steps feed the layer's own output back, one position further
each time. The feature is the target's pre-final-norm residual stream (aux stream
``num_layers``), as vLLM's MiMo hands its MTP layer. ``speculative_config.model`` is the
target itself (the engine fills it in when omitted, as vLLM does).
"""

from __future__ import annotations

from torch import Tensor

from infer.drafters.mtp import MTPDrafter
from infer.models.output import FeatureSpec, ModelOutput
from infer.proposers.base import PROPOSERS, ProposerContext
from infer.proposers.eagle import EagleChainProposer
from infer.spec_config import SpeculativeConfig


@PROPOSERS.register("mtp")
class MTPProposer(EagleChainProposer):
    """The target's MTP layer(s) drafting a chain (module doc)."""

    def load_drafter(self, spec: SpeculativeConfig, ctx: ProposerContext) -> MTPDrafter:
        drafter = MTPDrafter.from_target(spec.model, dtype=ctx.dtype, device=ctx.device)
        drafter.attach_target(ctx.target)
        return drafter

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=(self.ctx.target_config.num_layers,))

    def target_features(self, target_output: ModelOutput) -> Tensor:
        return target_output.aux[0]  # [B, T, H] before the final norm

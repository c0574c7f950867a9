"""MTP objective: fine-tune a target's own multi-token-prediction layer (FastMTP,
arXiv 2509.18362; docs/reference.md §14).

The target, its embedding and its LM head stay frozen; only the MTP layer(s) of
``infer/drafters/mtp.py`` train, on answers the target regenerated itself
(``regenerate.enabled``). The one shared layer is unrolled ``objective.ttt_steps`` (3) steps,
teacher-forced, exactly as the engine's chain drafts (``ttt.py``)::

    step 0: pair (h_t, x_{t+1})         at position t       -> o^0_t predicts x_{t+2}
    step s: pair (o^{s-1}_t, x_{t+1+s}) at position t + s   -> o^s_t predicts x_{t+2+s}

``h_t``: the target's residual stream before its final norm (aux stream ``num_layers``, what
vLLM's MiMo hands its MTP layer). Loss: cross-entropy to the data token ``x_{t+2+s}``, step ``s``
weighted ``step_weight ** s`` (FastMTP's beta 0.6: 1, 0.6, 0.36, proportional to its normalised
0.51 / 0.31 / 0.18). Unlike FastMTP's unroll, step ``s`` attends to the step-0 states of earlier
tokens and its own earlier steps (TTT's mask), which is what the layer's KV cache holds when it
drafts, so training and serving see the same inputs.

Start: the target's own MTP layers when its config.json declares them (MiMo); otherwise (the
embedded tiny Llama) a fresh layer initialised from the target's LAST decoder layer (zero q/k/v
biases), ``input_proj = [I | I]`` (the normed hidden state plus the normed embedding), unit
input norms and the target's final norm as ``final_layernorm``; ``drafter.init_from`` starts from an earlier export. Export: a stitched target
(``train/stitch.py``) that vLLM and the engine serve as ``{"method": "mtp"}``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.mtp import PREFIX, MTPDrafter, num_mtp_layers
from infer.foundation.files import read_json
from infer.models.llama import ModelConfig
from train.objectives.base import OBJECTIVES, FeatureSpec, last_layer_state
from train.objectives.ttt import TTTObjective, shift_left
from train.stitch import write_stitched

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab


@OBJECTIVES.register("mtp")
class MTPObjective(TTTObjective):
    """The target's MTP layer + TTT unroll (module doc); ``self.drafter`` is an ``MTPDrafter``."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        source = cfg.drafter.init_from or target_dir
        if num_mtp_layers(read_json(Path(source) / "config.json")):
            drafter = MTPDrafter.from_target(source, dtype=torch.float32)
        else:
            drafter = from_last_layer(target_dir, heads.config)
        self.drafter = drafter.requires_grad_(True).train()
        self.drafter.attach_target(heads)  # shared embedding + LM head (frozen, not saved)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=(self.heads.config.num_layers,))

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=(target.num_layers,))

    # ---- TTT hooks ---------------------------------------------------------------------------

    def features(self, batch: dict[str, Tensor]) -> Tensor:
        dtype = self.drafter.mtp_layers[0].input_proj.weight.dtype
        return self.noisy(batch["aux"].to(dtype))  # [B, T, H] before the final norm

    def targets(self, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        return {"next": shift_left(batch["input_ids"], 1)[rows]}  # [M]: row r holds x_{r+1}

    def step_loss(self, step, logits, hidden, targets):
        tokens = targets["next"]  # [N]: x_{t+2+step}
        ce = F.cross_entropy(logits.float(), tokens, reduction="none")  # [N]
        return ce, logits.argmax(-1) == tokens, {"ce": ce}

    # ---- export ------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """The stitched target (``train/stitch.py``): serve with ``{"method": "mtp"}``."""
        state = self.drafter_state(state_dict)
        mtp = {PREFIX + k.removeprefix("mtp_layers."): v for k, v in state.items()
               if k.startswith("mtp_layers.")}
        return write_stitched(self.target_dir, path, mtp, len(self.drafter.mtp_layers))

    @classmethod
    def served_config(cls, path: str | Path) -> dict:
        return {"method": "mtp", "model": str(path)}


def from_last_layer(target_dir: str | Path, target: ModelConfig) -> MTPDrafter:
    """A fresh MTP layer from the target's last decoder layer (module doc), float32."""
    cfg = replace(target, qkv_bias=True, o_bias=False, model_type="mimo",
                  architecture="MiMoForCausalLM")
    drafter = MTPDrafter(cfg, 1)
    layer, h = drafter.mtp_layers[0], target.hidden_size
    state, norm = last_layer_state(target_dir, target, "drafter=mtp")
    state["final_layernorm.weight"] = norm  # o feeds the LM head as the target's norm does
    with torch.no_grad():
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, proj).bias.zero_()
        for norm in ("token_layernorm", "hidden_layernorm"):
            getattr(layer, norm).weight.fill_(1.0)
        eye = torch.eye(h)
        layer.input_proj.weight.copy_(torch.cat([eye, eye], dim=1))  # [H, 2H]
    missing = layer.load_state_dict(state, strict=False).missing_keys
    expected_missing = {"token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                        "self_attn.q_proj.bias",
                        "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    if set(missing) - expected_missing:
        raise ValueError(f"the target's last layer lacks {sorted(set(missing) - expected_missing)}")
    return drafter

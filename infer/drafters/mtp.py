"""A target's native multi-token-prediction (MTP) layers, MiMo format (vLLM ``method: mtp``;
docs/reference.md §14).

MiMo (``MiMoForCausalLM``: a Qwen2 body with attention biases) ships
``num_nextn_predict_layers`` extra layers under ``model.mtp_layers.{i}.*`` in the target's own
checkpoint. Per pair ``(h_t, x_{t+1})`` at position ``t``, as vLLM's ``mimo_mtp.py`` computes it::

    e = embed(x_{t+1}), zeroed where the position is 0
    u = input_proj(cat(hidden_layernorm(h_t), token_layernorm(e)))   # HIDDEN FIRST, 2H -> H
    o = final_layernorm(qwen2_layer(u))                             # the layer's own KV cache
    logits = lm_head(o)                                             # the target's head

``h_t`` is the target's residual stream after its last layer and BEFORE its final norm (vLLM's
``MiMoModel.forward`` returns it and applies the norm in ``compute_logits``): aux stream
``num_layers`` of this engine's targets. Drafts 2..k feed ``o`` back in place of ``h``, at
position + 1 each step: the EAGLE chain (``infer/proposers/mtp.py``). vLLM 0.32 runs MiMo's
layer 0 at every step (its forward asserts ``spec_step_idx == 0``), and so does this drafter;
further layers are loaded and exported but not drafted with.

Tensors per layer (relative to ``model.mtp_layers.{i}.``): ``token_layernorm``,
``hidden_layernorm``, ``input_proj`` (no bias), the Qwen2 decoder layer's ``input_layernorm``,
``self_attn.{q,k,v}_proj.{weight,bias}``, ``self_attn.o_proj.weight``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, and ``final_layernorm``. The
embedding and LM head are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.drafters.common import PairDrafter, StepKV, share_target_heads
from infer.foundation.errors import FileFormatError
from infer.foundation.files import check_tensors, open_safetensors, read_json
from infer.kv_cache import CacheStep
from infer.models.functional import Embed, LayerWeights, ModelParts, Norm, Proj
from infer.models.llama import DecoderLayer, ModelConfig, RMSNorm, proj_of
from infer.models.loader import load_config, resolve_dtype, resolve_model_dir, weight_files
from infer.models.rope import rope_frequencies, step_rope
from infer.models.snapshot import snapshot_of, uses_snapshot

PREFIX = "model.mtp_layers."
NUM_LAYERS_KEY = "num_nextn_predict_layers"


def num_mtp_layers(hf_config: dict) -> int:
    """MTP layers a target's config.json declares (0: none)."""
    return int(hf_config.get(NUM_LAYERS_KEY) or 0)


def mtp_predict(layer: "MTPLayer | MTPLayerWeights", embeds: Tensor, hidden: Tensor,
                cos: Tensor, sin: Tensor, mask: Tensor | None,
                step: CacheStep | StepKV | None) -> Tensor:
    """``embeds``, ``hidden`` ``[B, T, H]`` -> ``o [B, T, H]`` (module doc), for the module or
    its bundle (the decoder layer is called as itself: the module's hooks run)."""
    u = layer.input_proj(torch.cat([layer.hidden_layernorm(hidden),
                                    layer.token_layernorm(embeds)], dim=-1))  # [B, T, H]
    return layer.final_layernorm(layer(u, cos, sin, mask, step))


@dataclass(frozen=True, slots=True)
class MTPLayerWeights(LayerWeights):
    """An MTP layer's bundle (:mod:`infer.models.functional`), member names as the module's."""

    token_layernorm: Norm
    hidden_layernorm: Norm
    input_proj: Proj
    final_layernorm: Norm

    def predict(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | None, step: CacheStep | StepKV | None) -> Tensor:
        return mtp_predict(self, embeds, hidden, cos, sin, mask, step)


class MTPLayer(DecoderLayer):
    """One MiMo MTP layer: the Qwen2 decoder layer (its tensors keep their names) plus the
    input glue and the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, 0)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)

    def weights(self) -> MTPLayerWeights:
        base = super().weights()
        return MTPLayerWeights(base.input_layernorm, base.self_attn, base.post_attention_layernorm,
                               base.mlp, self.token_layernorm.weights(),
                               self.hidden_layernorm.weights(), proj_of(self.input_proj),
                               self.final_layernorm.weights())

    def predict(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                mask: Tensor | None, step: CacheStep | StepKV | None) -> Tensor:
        """``embeds``, ``hidden`` ``[B, T, H]`` -> ``o [B, T, H]`` (module doc)."""
        return mtp_predict(self, embeds, hidden, cos, sin, mask, step)


class MTPDrafter(PairDrafter):
    """The target's MTP layers as a chain drafter. Call :meth:`attach_target` before use."""

    def __init__(self, target_config: ModelConfig, num_layers: int = 1) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP drafter needs at least one layer, got {num_layers}")
        self.target_config = target_config
        self.layer_config = replace(target_config, num_layers=1)  # one KV-cache layer
        self.mtp_layers = nn.ModuleList([MTPLayer(target_config) for _ in range(num_layers)])
        self.init_shared_heads()
        self.init_buffers()

    def init_buffers(self) -> None:
        device = self.mtp_layers[0].input_proj.weight.device
        self.inv_freq, self.rope_scale = rope_frequencies(self.layer_config, device)

    def attach_target(self, target: nn.Module) -> None:
        """Share the target's ``embed_tokens`` and ``lm_head`` (frozen, never saved here)."""
        share_target_heads(self, target, self.target_config, "MTP layer")

    def prepare(self, feature: Tensor) -> Tensor:
        """The target feature (pre-final-norm residual stream) as the layer takes it: as is."""
        return feature

    def to_target_ids(self, ids: Tensor) -> Tensor:
        return ids  # the target's full vocabulary

    def to_target_probs(self, q: Tensor) -> Tensor:
        return q

    def _states(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor | None,
                step: CacheStep | StepKV | None) -> Tensor:
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError("MTPDrafter shares the target's embedding and LM head; call "
                               "attach_target(target) first")
        parts = self.parts(step)
        embeds = parts.embed(input_ids).to(hidden.dtype)  # [B, T, H]
        embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)  # vLLM: no embedding at 0
        cos, sin = step_rope(self, positions, embeds.dtype, step)
        return parts.layers[0].predict(embeds, hidden, cos, sin, mask, step)  # [B, T, H]

    def _logits(self, o: Tensor, step=None) -> Tensor:
        lm_head = self.parts(step).lm_head
        return lm_head(o.to(lm_head.weight.dtype))  # [..., V]

    def parts(self, step) -> ModelParts:
        """The modules, or for a cached forward without gradients their bundles, built once
        (:func:`~infer.models.snapshot.snapshot_of`; the target's shared modules watched too).
        Layer 0 drafts (module doc)."""
        if not uses_snapshot(step):
            return ModelParts(self.embed_tokens, self.mtp_layers, None, self.lm_head)
        return snapshot_of(self, lambda: ModelParts(
            Embed(self.embed_tokens.weight), (self.mtp_layers[0].weights(),), None,
            proj_of(self.lm_head)), step, shared=[self.embed_tokens, self.lm_head])

    def _feedback(self, o: Tensor, step=None) -> Tensor:
        return o

    # ---- the target's checkpoint ---------------------------------------------------------------

    def native_state_dict(self) -> dict[str, Tensor]:
        """The layers' tensors under the target checkpoint's names (``model.mtp_layers.i.*``)."""
        return {PREFIX + k.removeprefix("mtp_layers."): v
                for k, v in self.state_dict().items() if k.startswith("mtp_layers.")}

    @classmethod
    def from_target(cls, path: str | Path, *, dtype: str | torch.dtype = "auto",
                    device: str | torch.device = "cpu") -> "MTPDrafter":
        """The MTP layers of the target checkpoint at ``path``, frozen, eval mode. A target
        whose config.json declares none is refused, naming the key."""
        model_dir = resolve_model_dir(path, "speculative_config.model")
        hf = read_json(model_dir / "config.json", what="the model's config")
        n = num_mtp_layers(hf)
        if n == 0:
            raise FileFormatError(
                f"{model_dir}/config.json declares no MTP layers ({NUM_LAYERS_KEY} is "
                f"{hf.get(NUM_LAYERS_KEY)!r}); method 'mtp' serves a target's own "
                "multi-token-prediction layers (MiMo, DeepSeek-V3 ...): use eagle3 or "
                "draft_model for this target")
        state = _read_mtp_tensors(model_dir)
        with torch.device("meta"):
            model = cls(load_config(model_dir), n)
        expected = {PREFIX + k.removeprefix("mtp_layers."): v
                    for k, v in model.state_dict().items()}
        check_tensors(model_dir, expected, state, " (its MTP layers)")
        torch_dtype = resolve_dtype(dtype, hf)
        model.load_state_dict({"mtp_layers." + k.removeprefix(PREFIX):
                               v.to(device=device, dtype=torch_dtype) for k, v in state.items()},
                              assign=True)
        model.init_buffers()
        return model.requires_grad_(False).eval()


def _read_mtp_tensors(model_dir: Path) -> dict[str, Tensor]:
    state = {}
    for file in weight_files(model_dir):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    state[name] = f.get_tensor(name)
    return state

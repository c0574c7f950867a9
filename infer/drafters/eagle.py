"""EAGLE-1 draft head in the format vLLM's ``EagleLlamaForCausalLM`` loads (docs/reference.md §4).

Architecture (per position ``t``)::

    x = fc(cat(embed(token_{t+1}), f_t))     # [.., 2H] -> [.., H]; embedding FIRST, as in
                                             # EAGLE's cnets.py and vLLM
    f_{t+1} ~ layer(x)                       # one Llama decoder layer WITHOUT input_layernorm,
                                             # no final norm
    logits  = target.lm_head(f_{t+1})        # the target's head and embedding, frozen, shared

The feature ``f_t`` is the target's last hidden state AFTER the final norm (Hugging Face's
``hidden_states[-1]``, this engine's ``ModelOutput.hidden``): EAGLE trains the head to regress
exactly the vector the target's ``lm_head`` consumes, which is why the draft output goes to the
LM head without a norm, and it is what vLLM passes to non-EAGLE-3 drafters (the model output).
The next draft step feeds the predicted feature back in place of ``f``. Positions follow vLLM:
the pair ``(f_t, token_{t+1})`` sits at position ``t``.

``fc`` bias: EAGLE's paper and original Vicuna heads have one, vLLM's Llama EAGLE builds ``fc``
*without* bias (a checkpoint carrying ``fc.bias`` fails to load there) and its Qwen2 EAGLE with
one. So it is a flag, and on load the weights decide (``fc.bias`` present or not);
:meth:`EagleConfig.for_target` picks vLLM's choice for the target family.

Checkpoint: ``config.json`` in vLLM's ``EAGLEConfig`` shape::

    {"model_type": "eagle", "architectures": ["EagleLlamaForCausalLM"], "bias": false,
     "model": {<the draft layer's Llama config: num_hidden_layers 1, target hidden/vocab>}}

(a plain Llama ``config.json``, as in the original EAGLE releases, is also read), and
``model.safetensors`` with ``fc.weight`` (+ ``fc.bias``), ``layers.0.self_attn.*``,
``layers.0.mlp.*``, ``layers.0.post_attention_layernorm.weight``. No embedding or LM head is saved;
an ``embed_tokens.weight`` found on load is ignored (vLLM shares the target's the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.drafters.common import (PairDrafter, StepKV, hf_layer_config,
                                   read_checkpoint, share_target_heads, write_checkpoint)
from infer.foundation.files import check_tensors
from infer.kv_cache import CacheStep
from infer.models.functional import Embed, ModelParts
from infer.models.llama import DecoderLayer, ModelConfig, proj_of
from infer.models.rope import rope_frequencies, step_rope
from infer.models.snapshot import snapshot_of, uses_snapshot
from infer.models.loader import config_from_hf, resolve_dtype
from infer.foundation.validation import config_error

_WHERE = "eagle config.json"
_IGNORED = ("embed_tokens.weight",)


@dataclass
class EagleConfig:
    """vLLM's ``EAGLEConfig`` for an EAGLE-1 head: the nested draft-layer config + fc bias."""

    model: dict  # HF config of the draft layer (hidden_size / vocab_size = the target's)
    fc_bias: bool = False
    extra: dict = field(default_factory=dict)  # other top-level keys, written back unchanged

    def __post_init__(self) -> None:
        if not isinstance(self.model, dict):
            raise config_error("model", self.model, "a JSON object (the draft layer's config)",
                               _WHERE)
        layers = self.model.get("num_hidden_layers", 1)
        if layers != 1:
            raise config_error("model.num_hidden_layers", layers, "1 (one EAGLE decoder layer)",
                               _WHERE)

    @property
    def layer(self) -> ModelConfig:
        return config_from_hf(self.model)

    def to_dict(self) -> dict:
        archs = self.model.get("architectures") or ["LlamaForCausalLM"]
        return {
            **self.extra,
            "model_type": "eagle",
            "architectures": [a if a.startswith("Eagle") else f"Eagle{a}" for a in archs],
            "bias": self.fc_bias,
            "model": dict(self.model),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "EagleConfig":
        """vLLM's nested ``EAGLEConfig`` or a plain one-layer Llama config (original EAGLE)."""
        if isinstance(d.get("model"), dict):
            extra = {k: v for k, v in d.items()
                     if k not in ("model", "model_type", "architectures", "bias")}
            return cls(model=d["model"], fc_bias=bool(d.get("bias", False)), extra=extra)
        if d.get("model_type") == "eagle":
            raise config_error("model", d.get("model"), "the nested draft-layer config (vLLM's "
                               "EAGLEConfig format)", _WHERE)
        model = {k: v for k, v in d.items() if k != "bias"}
        return cls(model=model, fc_bias=bool(d.get("bias", False)))

    @classmethod
    def for_target(cls, target: ModelConfig, *, intermediate_size: int | None = None,
                   fc_bias: bool | None = None) -> "EagleConfig":
        """A head shaped like ``target``; ``fc_bias`` None = what vLLM builds for the family
        (Qwen2: with bias; Llama and the rest: without)."""
        if fc_bias is None:
            fc_bias = target.model_type == "qwen2"
        return cls(model=hf_layer_config(target, intermediate_size=intermediate_size),
                   fc_bias=fc_bias)


class EagleDrafter(PairDrafter):
    """EAGLE-1 head: see the module doc. Call :meth:`attach_target` before any forward."""

    aux_layer_ids: tuple[int, ...] = ()  # uses ModelOutput.hidden (after the final norm)

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        lc = self.layer_config = config.layer
        h = lc.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        layer = DecoderLayer(lc, 0)
        layer.input_layernorm = nn.Identity()  # EAGLE drops it: fc output goes straight in
        self.layers = nn.ModuleList([layer])
        self.init_shared_heads()
        self.init_buffers()

    def init_buffers(self) -> None:
        self.inv_freq, self.rope_scale = rope_frequencies(self.layer_config, self.fc.weight.device)

    def attach_target(self, target: nn.Module) -> None:
        """Share the target's ``embed_tokens`` and ``lm_head`` (frozen, never saved)."""
        share_target_heads(self, target, self.layer_config, "EAGLE head")

    def _need_target(self) -> None:
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError("EagleDrafter shares the target's embedding and LM head; call "
                               "attach_target(target) first")

    def prepare(self, feature: Tensor) -> Tensor:
        """The target feature as the head consumes it: unchanged (``ModelOutput.hidden``)."""
        return feature

    def to_target_ids(self, ids: Tensor) -> Tensor:
        return ids  # the head predicts over the full target vocabulary

    def to_target_probs(self, q: Tensor) -> Tensor:
        return q

    def _states(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor | None,
                step: CacheStep | StepKV | None) -> Tensor:
        parts = self.parts(step)
        embeds = parts.embed(input_ids).to(hidden.dtype)  # [B, T, H]
        x = parts.fc(torch.cat([embeds, hidden], dim=-1))  # [B, T, H]
        cos, sin = step_rope(self, positions, x.dtype, step)
        return parts.layers[0](x, cos, sin, mask, step)  # [B, T, H]

    def _logits(self, h: Tensor, step=None) -> Tensor:
        lm_head = self.parts(step).lm_head
        # the shared head may be in the target's dtype while a trained head is fp32
        return lm_head(h.to(lm_head.weight.dtype))  # [..., V]

    def parts(self, step) -> ModelParts:
        """The modules, or for a cached forward without gradients their bundles, built once
        (:func:`~infer.models.snapshot.snapshot_of`; the target's shared modules watched too)."""
        self._need_target()
        if not uses_snapshot(step):
            return ModelParts(self.embed_tokens, self.layers, None, self.lm_head, self.fc)
        return snapshot_of(self, lambda: ModelParts(
            Embed(self.embed_tokens.weight), (self.layers[0].weights(),), None,
            proj_of(self.lm_head), proj_of(self.fc)), step,
            shared=[self.embed_tokens, self.lm_head])

    def _feedback(self, h: Tensor, step=None) -> Tensor:
        return h

    # ---- checkpoint --------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        return write_checkpoint(path, self.config.to_dict(), self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "cpu") -> "EagleDrafter":
        """Load an EAGLE-1 head (the weights decide ``fc_bias``), frozen, eval mode."""
        raw, state, model_dir = read_checkpoint(path, "eagle")
        config = EagleConfig.from_dict(raw)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if k not in _IGNORED}
        config.fc_bias = "fc.bias" in state
        with torch.device("meta"):
            model = cls(config)
        check_tensors(model_dir, model.state_dict(), state)
        torch_dtype = resolve_dtype(dtype, {**config.model, **config.extra})
        model.load_state_dict({k: v.to(device=device, dtype=torch_dtype)
                               for k, v in state.items()}, assign=True)
        model.init_buffers()
        return model.requires_grad_(False).eval()

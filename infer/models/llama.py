"""Native Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3(-MoE), Phi-3 in one class.

The families differ only in small options (``ModelConfig.qkv_bias``, ``qk_norm``, sliding
window, RoPE scaling, tied embeddings, sparse experts in place of the MLP), so there is one model with flags rather than one class per
family; :mod:`infer.models.loader` maps a Hugging Face config to these flags. Module names follow
Hugging Face's minus the ``model.`` prefix (``layers.3.self_attn.q_proj.weight``), which keeps the
checkpoint mapping trivial and matches the names EAGLE-style drafters use for their own layers.

Two forwards share the layer stack:

- :meth:`Llama.forward` decodes with a static :class:`~infer.kv_cache.KVCache` (ragged rows,
  per-row lengths, the cache advances itself; see that module for rollback and host syncs);
- :meth:`Llama.forward_train` runs full sequences without a cache (training, feature extraction),
  optionally with a block-diagonal mask over packed documents.

Outputs (``ModelOutput``) and the hidden-state index semantics of ``aux_layer_ids`` are defined in
:mod:`infer.models.output`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from infer.kv_cache import CacheStep, KVCache
from infer.models.attention import (cache_mask, group_mask, grouped_pays, position_mask,
                                    tree_mask)
from infer.models.functional import (AttentionWeights, Embed, LayerWeights, MLPWeights,
                                     ModelParts, MoEWeights, Norm, Proj, attention,
                                     decoder_layer, mlp, moe, rms_norm)
from infer.models.groups import (ForwardGroup, GroupedStep, flat_logits_at, flat_tokens,
                                 plan_groups, split_groups)
from infer.models.layout import FusedLinear, pack_for_cpu_
from infer.models.output import ModelOutput
from infer.models.rope import RopeConfig, rope_frequencies, step_rope
from infer.models.snapshot import snapshot_of, uses_snapshot

if TYPE_CHECKING:
    from infer.draft_tree import SiblingTree


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs; built from a Hugging Face config by the loader."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # key k visible from query q iff q - window < k <= q
    sliding_layers: tuple[int, ...] = ()  # layers that use sliding_window
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # sparse mixture of experts (Qwen3-MoE) on ``moe_layers``; the others keep the dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")


# ---- modules -----------------------------------------------------------------------------------
# Each runs the math of infer/models/functional.py over itself; ``weights()`` is its bundle, what
# a model's cached forwards run instead (built once: infer/models/snapshot.py).

def proj_of(lin: nn.Linear) -> Proj:
    """The :class:`Proj` of a linear (with its packed weight when it has one)."""
    return Proj(lin.weight, lin.bias, getattr(lin, "_packed", None))


def fused_proj(fused: FusedLinear | None) -> Proj | None:
    """The :class:`Proj` of a fused projection while it is active, else None (the separate
    linears run: replaced parameters, or a gradient to record)."""
    if fused is None or not fused.active():
        return None
    return Proj(fused.weight, fused.bias, fused.packed)


def norm_weights(norm: nn.Module) -> Callable[[Tensor], Tensor]:
    """An :class:`RMSNorm`'s bundle; any other module as is (EAGLE-1's ``nn.Identity``)."""
    return norm.weights() if isinstance(norm, RMSNorm) else norm


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back before the weight (Hugging Face's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def weights(self) -> Norm:
        return Norm(self.weight, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; writes to / reads from the KV cache when given one
    (the math: :func:`~infer.models.functional.attention`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        h, q_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self._qkv: FusedLinear | None = None  # see fuse()

    def fuse(self) -> None:
        """Back q/k/v by one fused weight so a forward runs one projection instead of three
        (parameter names and ``state_dict`` are unchanged), where :meth:`FusedLinear.can_fuse`."""
        lins = [self.q_proj, self.k_proj, self.v_proj]
        if FusedLinear.can_fuse(lins):
            self._qkv = FusedLinear(lins)

    def weights(self) -> AttentionWeights:
        return AttentionWeights(
            self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
            proj_of(self.q_proj), proj_of(self.k_proj), proj_of(self.v_proj),
            proj_of(self.o_proj), fused_proj(self._qkv),
            None if self.q_norm is None else self.q_norm.weights(),
            None if self.k_norm is None else self.k_norm.weights())

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``([B, T, q_dim + kv_dim], v [B, T, kv_dim])``: q and k side by side (one tensor, so
        RoPE can rotate both at once), then v; the fused weight while it is active, else the
        three linears, each called (their hooks run)."""
        q_dim, kv_dim = self.q_proj.out_features, self.k_proj.out_features
        if self._qkv is not None and self._qkv.active():
            qk, v = self._qkv(x).split([q_dim + kv_dim, kv_dim], dim=-1)
            return qk, v
        return torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1), self.v_proj(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                step: CacheStep | None = None) -> Tensor:
        """``x [B, T, H]`` -> ``[B, T, H]`` (:func:`~infer.models.functional.attention`)."""
        return attention(self, x, cos, sin, mask, step)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        h, i = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self._gate_up: FusedLinear | None = None  # see fuse()

    def fuse(self) -> None:
        """Back gate/up by one fused weight (one projection per forward; same names)."""
        if FusedLinear.can_fuse([self.gate_proj, self.up_proj]):
            self._gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def weights(self) -> MLPWeights:
        return MLPWeights(proj_of(self.gate_proj), proj_of(self.up_proj),
                          proj_of(self.down_proj), fused_proj(self._gate_up))

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self._gate_up is not None and self._gate_up.active():
            gate, up = self._gate_up(x).chunk(2, dim=-1)
            return gate, up
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: Tensor) -> Tensor:
        return mlp(self, x)


class SparseMoE(nn.Module):
    """Qwen3-MoE's feed-forward: a router (``gate``) over ``experts`` SwiGLU MLPs of
    ``moe_intermediate_size`` (:func:`~infer.models.functional.moe`); Hugging Face's names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.top_k, self.norm_topk_prob = cfg.experts_per_token, cfg.norm_topk_prob

    def weights(self) -> MoEWeights:
        return MoEWeights(proj_of(self.gate), tuple(e.weights() for e in self.experts),
                          self.top_k, self.norm_topk_prob)

    def forward(self, x: Tensor) -> Tensor:
        return moe(self, x)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP (:func:`decoder_layer`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if layer_idx in cfg.moe_layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def weights(self) -> LayerWeights:
        return LayerWeights(norm_weights(self.input_layernorm), self.self_attn.weights(),
                            norm_weights(self.post_attention_layernorm), self.mlp.weights())

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                step: CacheStep | None = None) -> Tensor:
        return decoder_layer(self, x, cos, sin, mask, step)


class Llama(nn.Module):
    """The Llama-family causal LM (see the module doc for the supported variants)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.rope_scale = 1.0
        self.init_buffers()
        self.tie_weights()

    def init_buffers(self) -> None:
        """(Re)compute the RoPE frequencies on the embedding's device (after a meta build)."""
        device = self.embed_tokens.weight.device
        self.inv_freq, self.rope_scale = rope_frequencies(self.config, device)  # [hd / 2]

    def fuse_projections(self) -> "Llama":
        """:func:`fuse_projections` of this model."""
        return fuse_projections(self)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Tensor, cache: KVCache, slots: Tensor | None = None, *,
                num_tokens: Tensor | None = None, aux_layer_ids=None, kv_len: int | None = None,
                logits_at: Tensor | None = None, tree: "SiblingTree | None" = None
                ) -> ModelOutput:
        """Cached forward: append ``input_ids [B, T]`` to cache rows ``slots [B]`` and decode them.

        Row ``b``'s tokens take positions ``lens[b] .. lens[b] + T - 1``; only the first
        ``num_tokens[b]`` are real (default: all ``T``), the rest are padding whose outputs are
        garbage. Query ``t`` of row ``b`` attends cache positions ``0 .. lens[b] + t``. ``slots``
        None = rows ``0 .. B-1`` (no gather). Afterwards ``lens[slots] += num_tokens`` has been
        applied; to roll back, ``cache.truncate(slots, new_lens)``. ``kv_len`` None reads
        ``max(lens + num_tokens)`` on the host once; pass ``cache.capacity`` for a sync-free,
        fixed-shape step. ``logits_at [B, K]`` computes logits only at those indices of ``T``.
        """
        b, t = input_ids.shape
        if tree is None:
            step = cache.plan(b, t, slots, num_tokens, kv_len)
            masks = self._layer_masks(lambda w: cache_mask(step, w))
        else:  # a draft tree (infer/draft_tree.py): depth positions, ancestor mask
            if self.config.sliding_layers and self.config.sliding_window is not None:
                raise ValueError("draft_tree_siblings: sliding-window targets are not supported")
            depths = tree.depths(cache.lens.device)  # [T]
            step = cache.plan(b, t, slots, num_tokens, kv_len, depths=depths)
            mask = tree_mask(step, tree.ancestors(cache.lens.device))
            masks = [mask] * self.config.num_layers
        out = self._run(input_ids, step.positions, masks, step, aux_layer_ids, logits_at)
        cache.advance(step)
        return out

    def forward_groups(self, groups: list[ForwardGroup], cache: KVCache, *,
                       aux_layer_ids=None) -> list[ModelOutput]:
        """Several cached forwards as one (:class:`GroupedStep`): e.g. a decode step's rows and
        new prompts, each prompt unpadded. Each group gets what :meth:`forward` with its
        arguments would return (the same math; float rounding may differ with the row count).
        One group is the plain :meth:`forward` (nothing to flatten or split)."""
        if len(groups) == 1:
            g = groups[0]
            return [self(g.input_ids, cache, g.slots, num_tokens=g.num_tokens,
                         aux_layer_ids=aux_layer_ids, logits_at=g.logits_at)]
        step = plan_groups(cache, groups, self._layer_masks)
        ids, positions = flat_tokens(groups, step)  # [1, N] each
        out = self._run(ids, positions, [None] * self.config.num_layers, step, aux_layer_ids,
                        flat_logits_at(groups))
        return split_groups(out, groups)

    def forward_train(self, input_ids: Tensor, position_ids: Tensor | None = None,
                      attention_mask: Tensor | None = None, aux_layer_ids=None,
                      logits_at: Tensor | None = None) -> ModelOutput:
        """Full-sequence forward without a cache (training, feature extraction).

        ``attention_mask``: bool ``[B, T, T]`` or ``[B, 1, T, T]``, True = may attend, used as
        given (it must include causality, e.g. :func:`packed_causal_mask` for packed documents,
        with ``position_ids`` restarting per document); every query must see at least one key.
        None = causal. Sliding-window layers intersect it with the window over sequence indices.
        """
        b, t = input_ids.shape
        idx = torch.arange(t, device=input_ids.device)  # [T]
        if position_ids is None:
            position_ids = idx.expand(b, t)
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool (True = attend), got "
                                 f"{attention_mask.dtype}")
            if attention_mask.dim() == 3:
                attention_mask = attention_mask[:, None]  # [B, 1, T, T]

        def mask_for(window: int | None) -> Tensor | None:
            if window is None:
                return attention_mask
            win = position_mask(idx[None], idx, window)  # [1, 1, T, T]
            return win if attention_mask is None else attention_mask & win

        masks = self._layer_masks(mask_for)
        return self._run(input_ids, position_ids, masks, None, aux_layer_ids, logits_at)

    def _layer_masks(self, make) -> list:
        """One mask per layer: ``make(None)`` for full attention, ``make(window)`` for sliding."""
        cfg = self.config
        full = make(None)
        if not cfg.sliding_layers or cfg.sliding_window is None:
            return [full] * cfg.num_layers
        sliding = make(cfg.sliding_window)
        return [sliding if i in cfg.sliding_layers else full for i in range(cfg.num_layers)]

    def _run(self, input_ids: Tensor, positions: Tensor, masks: list, step: CacheStep | None,
             aux_layer_ids, logits_at: Tensor | None) -> ModelOutput:
        """Embed, run the layer stack, keep the requested residual streams, norm, project."""
        aux_ids = check_aux_ids(aux_layer_ids, self.config.num_layers)
        masks = self._group_masks(masks, input_ids.device)
        keep = set(aux_ids)
        parts = self.parts(step)
        h = parts.embed(input_ids)  # [B, T, H]
        cos, sin = step_rope(self, positions, h.dtype, step)
        saved = {0: h} if 0 in keep else {}
        for i, layer in enumerate(parts.layers):
            h = layer(h, cos, sin, masks[i], step)
            if i + 1 in keep:
                saved[i + 1] = h
        hidden = parts.norm(h)  # [B, T, H]
        picked = hidden
        if logits_at is not None:  # [B, K] -> hidden rows [B, K, H]
            picked = hidden.gather(1, logits_at[..., None].expand(-1, -1, hidden.shape[-1]))
        return ModelOutput(parts.lm_head(picked), hidden, tuple(saved[k] for k in aux_ids))

    def parts(self, step: CacheStep | GroupedStep | None) -> ModelParts:
        """The modules, or for a cached forward without gradients their bundles, built once
        (:func:`~infer.models.snapshot.snapshot_of`)."""
        if not uses_snapshot(step):
            return ModelParts(self.embed_tokens, self.layers, self.norm, self.lm_head)
        return snapshot_of(self, lambda: ModelParts(
            Embed(self.embed_tokens.weight), tuple(layer.weights() for layer in self.layers),
            self.norm.weights(), proj_of(self.lm_head)), step)

    def _group_masks(self, masks: list, device: torch.device) -> list:
        """Where :func:`grouped_pays` (CUDA; a few queries on the CPU), each distinct mask in
        :func:`group_mask`'s layout, built once per forward (not once per layer), for
        :func:`grouped_attention`."""
        rep = self.config.num_heads // self.config.num_kv_heads
        cuda = device.type == "cuda"
        grouped: dict[int, Tensor] = {}
        for m in masks:
            if (m is not None and m.shape[1] == 1 and id(m) not in grouped
                    and grouped_pays(m.shape[-2], rep, cuda)):
                grouped[id(m)] = group_mask(m, rep)
        return [grouped.get(id(m), m) if m is not None else None for m in masks]


def check_aux_ids(aux_layer_ids, n: int) -> tuple[int, ...]:
    """Residual-stream ids of an ``n``-layer model (vLLM's aux-layer ids), checked."""
    ids = tuple(int(k) for k in (aux_layer_ids or ()))
    bad = [k for k in ids if not 0 <= k <= n]
    if bad:
        raise ValueError(f"invalid value for 'aux_layer_ids': {list(ids)}; expected ids in "
                         f"[0, {n}] (0 = embeddings, {n} = last layer before the final norm)")
    return ids


def fuse_projections(module: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up of every :class:`Attention` / :class:`MLP` in ``module`` (a
    target, an EAGLE head) into one weight each (see :meth:`Attention.fuse`); numerics and
    parameter names are unchanged. An in-place ``load_state_dict`` stays fused (it writes into
    the fused storage); one that replaces tensors (``assign=True``) or a ``.to()`` falls back to
    separate projections. Returns ``module``."""
    for sub in module.modules():
        if isinstance(sub, (Attention, MLP)):
            sub.fuse()
    return module


def inference_layout(module: nn.Module) -> nn.Module:
    """Fused projections, then (on CPU) packed linear weights (:mod:`infer.models.layout`): how
    the loader prepares a target and the proposers their drafters. Frozen weights only."""
    return pack_for_cpu_(fuse_projections(module))

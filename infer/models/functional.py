"""The Llama-family layer math, written once over plain bundles of weights.

Why bundles: on a CPU at decode sizes every module call costs microseconds of Python whatever
its arithmetic (``nn.Module.__call__``, an ``nn.Module.__getattr__`` per parameter and
submodule, the fused-projection checks): measured, 29 % of the 8-layer tiny target's one-token
forward and about 45 % of a one-layer EAGLE-3 head's step (docs/benchmarks-history.md, twelfth and
thirteenth sessions). So the math of a projection, a norm, attention, the MLP and a decoder
layer lives here in functions (:func:`attention`, :func:`mlp`, :func:`decoder_layer`) over
anything with the members of the module they stand for: the modules of
:mod:`infer.models.llama` themselves, or frozen dataclasses of tensors with the same member
names (:class:`AttentionWeights`, :class:`MLPWeights`, :class:`LayerWeights`, built of
:class:`Proj`, :class:`Norm`). Training and any forward recording gradients run the modules, so
each submodule is called and hooks on them run (DeepSpeed ZeRO-3 gathers a linear's weight in
one, FSDP unshards a layer in one); a model's cached forwards run the bundles it built once
(:mod:`infer.models.snapshot`). One implementation, so the two paths are the same arithmetic in
the same order, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.kv_cache import CacheStep
from infer.models.attention import attend
from infer.models.layout import PackedWeight, linear
from infer.models.rope import apply_rope

_HAS_RMS_NORM = hasattr(F, "rms_norm")  # torch >= 2.4


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS norm computed in fp32, cast back before the weight (Hugging Face's order)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and _HAS_RMS_NORM:
        # the same math in one fused op (no up/down cast to mirror in fp32)
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True, slots=True)
class Proj:
    """A linear projection as inference runs it: through oneDNN's packed weight where there is
    one that still describes ``weight`` (:func:`infer.models.layout.linear`)."""

    weight: Tensor  # [out, in]
    bias: Tensor | None = None  # [out]
    packed: PackedWeight | None = None

    def __call__(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)


@dataclass(frozen=True, slots=True)
class Norm:
    """An RMS norm's weight and epsilon."""

    weight: Tensor  # [dim]
    eps: float

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class Embed:
    """A token embedding table (no padding index, max norm or sparse gradients: the models
    build plain ``nn.Embedding`` tables)."""

    weight: Tensor  # [V, H]

    def __call__(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class AttentionLike(Protocol):
    """What :func:`attention` reads: an ``Attention`` module or an :class:`AttentionWeights`."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    o_proj: Callable[[Tensor], Tensor]
    q_norm: Callable[[Tensor], Tensor] | None
    k_norm: Callable[[Tensor], Tensor] | None

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor]: ...


def attention(a: AttentionLike, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
              step: CacheStep | None = None) -> Tensor:
    """Grouped-query attention with RoPE, ``x [B, T, H]`` -> ``[B, T, H]``. ``mask`` None:
    causal over ``x`` alone, or, for one query (``T == 1``), every key (a cached decode step of
    one row attends its whole cache and needs no mask: see
    :func:`~infer.models.attention.cache_mask`). ``step``: a cache step, or training-time-test
    keys; keys that know their own structure (``attend``, e.g. ``TTTKeys``) compute the
    attention themselves and ``mask`` is unused."""
    b, t, _ = x.shape
    causal = mask is None and t > 1
    qk, v = a.project_qkv(x)  # [B, T, (heads + kv_heads) * hd], [B, T, kv_heads * hd]
    qk = qk.view(b, t, a.num_heads + a.num_kv_heads, a.head_dim)
    v = v.view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)  # [B, kv_heads, T, hd]
    if a.q_norm is None:  # rotate q and k together: one RoPE instead of two
        qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, heads + kv_heads, T, hd]
        q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
    else:
        q, k = qk.split([a.num_heads, a.num_kv_heads], dim=2)  # [B, T, heads, hd], ...
        q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if step is not None and hasattr(step, "attend"):  # TTT keys with a known structure
        out = step.attend(a.layer_idx, q, k, v)  # [B, heads, T, hd]
    else:
        if step is not None:
            k, v = step.update(a.layer_idx, k, v)  # [B, kv_heads, S, hd]
        out = attend(q, k, v, mask, causal)  # [B, heads, T, hd]
    return a.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, H]


@dataclass(frozen=True, slots=True)
class AttentionWeights:
    """One attention block's bundle (member names as the ``Attention`` module's). ``qkv`` is
    q/k/v fused into one weight where the model fused them (then the three are unused);
    ``q_norm`` / ``k_norm`` exist with Qwen3's qk-norm."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_proj: Proj
    k_proj: Proj
    v_proj: Proj
    o_proj: Proj
    qkv: Proj | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``([B, T, q_dim + kv_dim], v [B, T, kv_dim])``: q and k side by side (one tensor, so
        RoPE can rotate both at once), then v."""
        if self.qkv is not None:
            kv_dim = self.num_kv_heads * self.head_dim
            qk, v = self.qkv(x).split([self.num_heads * self.head_dim + kv_dim, kv_dim], dim=-1)
            return qk, v
        return torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1), self.v_proj(x)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                 step: CacheStep | None = None) -> Tensor:
        return attention(self, x, cos, sin, mask, step)


class MLPLike(Protocol):
    """What :func:`mlp` reads: an ``MLP`` module or an :class:`MLPWeights`."""

    down_proj: Callable[[Tensor], Tensor]

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]: ...


def mlp(m: MLPLike, x: Tensor) -> Tensor:
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))``."""
    gate, up = m.project_gate_up(x)
    return m.down_proj(F.silu(gate) * up)


@dataclass(frozen=True, slots=True)
class MLPWeights:
    """The MLP's bundle (member names as the module's); ``gate_up`` fused where the model fused
    them (then ``gate_proj`` and ``up_proj`` are unused)."""

    gate_proj: Proj
    up_proj: Proj
    down_proj: Proj
    gate_up: Proj | None = None

    def project_gate_up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return gate, up
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x: Tensor) -> Tensor:
        return mlp(self, x)


def moe(m: "MoELike", x: Tensor) -> Tensor:
    """Sparse mixture of SwiGLU experts (Qwen3-MoE): each token's router softmax (float32), its
    ``top_k`` experts weighted by their probabilities (renormalised to sum to 1 when
    ``norm_topk_prob``), summed. ``x [B, T, H]`` -> ``[B, T, H]``. Only the experts some token
    chose run, each on its tokens (a data-dependent dispatch: MoE targets step eagerly)."""
    flat = x.reshape(-1, x.shape[-1])  # [N, H]
    probs = torch.softmax(m.gate(flat).float(), dim=-1)  # [N, E]
    weights, chosen = probs.topk(m.top_k, dim=-1)  # [N, k] each
    if m.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(flat)
    for e in chosen.unique().tolist():
        tokens, slot = torch.where(chosen == e)  # [n] each
        out.index_add_(0, tokens, m.experts[e](flat[tokens]) * weights[tokens, slot, None])
    return out.view_as(x)


class MoELike(Protocol):
    """What :func:`moe` reads: a ``SparseMoE`` module or a :class:`MoEWeights`."""

    gate: Callable[[Tensor], Tensor]
    experts: Sequence[Callable[[Tensor], Tensor]]
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """A sparse MoE block's bundle (member names as the module's)."""

    gate: Proj
    experts: tuple[MLPWeights, ...]
    top_k: int
    norm_topk_prob: bool

    def __call__(self, x: Tensor) -> Tensor:
        return moe(self, x)


class LayerLike(Protocol):
    """What :func:`decoder_layer` reads: a ``DecoderLayer`` module or a :class:`LayerWeights`."""

    input_layernorm: Callable[[Tensor], Tensor]
    self_attn: Callable[..., Tensor]
    post_attention_layernorm: Callable[[Tensor], Tensor]
    mlp: Callable[[Tensor], Tensor]


def decoder_layer(layer: LayerLike, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                  step: CacheStep | None = None) -> Tensor:
    """Pre-norm residual block ``x [B, T, H]`` -> ``[B, T, H]``: attention, then the MLP."""
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, mask, step)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's bundle (member names as :class:`~infer.models.llama.DecoderLayer`'s,
    so :func:`decoder_layer` reads either)."""

    input_layernorm: Norm
    self_attn: AttentionWeights
    post_attention_layernorm: Norm
    mlp: MLPWeights | MoEWeights

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                 step: CacheStep | None = None) -> Tensor:
        return decoder_layer(self, x, cos, sin, mask, step)


class ModelParts(NamedTuple):
    """What a model's forward calls: its modules (training forwards) or their bundles (cached
    forwards, built once: :mod:`infer.models.snapshot`). ``norm``: the final norm (None: EAGLE-1
    has none); ``fc``: a head's input projection of the pair (EAGLE-1), else None."""

    embed: Callable[[Tensor], Tensor]
    layers: Sequence[Callable[..., Tensor]]
    norm: Callable[[Tensor], Tensor] | None
    lm_head: Callable[[Tensor], Tensor]
    fc: Callable[[Tensor], Tensor] | None = None

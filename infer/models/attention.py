"""Attention math and masks shared by the target, the drafters and training.

Grouped-query attention through SDPA (``enable_gqa`` where torch has it, the grouped layout of
:func:`grouped_attention` for masked CUDA calls), and the boolean masks (True = may attend) of
cached steps, draft trees and packed documents. Split from :mod:`infer.models.llama` so that
the grouped forward (:mod:`infer.models.groups`) can use them without importing the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.kv_cache import CacheStep


def _sdpa_supports_gqa() -> bool:
    """Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch >= 2.5)."""
    try:
        import inspect
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: probe it
        try:
            x = torch.zeros(1, 2, 1, 1)
            F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
            return True
        except TypeError:
            return False


_SDPA_GQA = _sdpa_supports_gqa()


def group_mask(mask: Tensor, rep: int) -> Tensor:
    """``[B, 1, T, S]`` -> ``[B, 1, rep * T, S]``: the mask of :func:`grouped_attention`'s rows."""
    b, _, t, s = mask.shape
    return mask[:, :, None].expand(-1, -1, rep, -1, -1).reshape(b, 1, rep * t, s)


# On the CPU, folding the query heads of a kv head into rows (grouped_attention) pays for a few
# query rows per kv head and loses for one (a decode step) or many (a prefill): SDPA's CPU flash
# kernel splits work by (batch, head, query block), and few rows in many heads is its slow case.
# Measured (docs/benchmarks-history.md, fourteenth session): 2-4 queries of 2 query heads per kv head,
# 60-1000 keys: 0.66-0.96 of the time at batch 1-8; 9 queries: 0.96-1.28; 1 query: ~1.3.
CPU_GROUPED_MAX_ROWS = 16


def grouped_pays(q_len: int, rep: int, on_cuda: bool) -> bool:
    """Whether a masked attention of ``q_len`` queries with ``rep`` query heads per kv head runs
    as :func:`grouped_attention`: always on CUDA (the memory-efficient kernel, where SDPA's own
    GQA takes the math one), on the CPU for 2 .. ``CPU_GROUPED_MAX_ROWS / rep`` queries (verify
    and catch-up steps; see above). Both :func:`attend` and ``Llama._group_masks`` ask it."""
    if rep == 1:
        return False
    return on_cuda or 1 < q_len and rep * q_len <= CPU_GROUPED_MAX_ROWS


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """Scaled dot-product attention with grouped-query heads: ``q [B, heads, T, hd]``, ``k, v
    [B, kv_heads, S, hd]``, bool ``mask [B, 1, T, S]`` (True = attend; where
    :func:`grouped_pays`, possibly already in :func:`group_mask`'s layout) or None with
    ``causal`` -> ``[B, heads, T, hd]``."""
    rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    if mask is not None and mask.shape[1] == 1 and grouped_pays(t, rep, q.is_cuda):
        if mask.shape[-2] != rep * t:  # not grouped yet (Llama._run groups once per forward)
            mask = group_mask(mask, rep)
        return grouped_attention(q, k, v, mask)
    if rep > 1 and _SDPA_GQA:  # SDPA maps query head h to kv head h // rep, no copy
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)
    if rep > 1:  # expand kv heads to query heads (a copy; older torch)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, grouped_mask: Tensor) -> Tensor:
    """Masked grouped-query attention without repeating keys: the query heads that share a kv
    head become ``rep * T`` query rows of that head (``grouped_mask`` from :func:`group_mask`).

    ``q [B, heads, T, hd]``, ``k, v [B, kv_heads, S, hd]`` -> ``[B, heads, T, hd]``. Same math as
    SDPA's ``enable_gqa``, but on CUDA a mask with ``enable_gqa`` only runs in the math kernel
    (scores for every head, keys repeated per head), while this shape runs in the
    memory-efficient kernel. On the CPU it is faster for a few query rows (:func:`grouped_pays`).
    """
    b, h, t, d = q.shape
    grouped = q.reshape(b, k.shape[1], -1, d)  # head g * rep + r -> group g, row r * T + t
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=grouped_mask)
    return out.reshape(b, h, t, d)


# ---- attention masks ---------------------------------------------------------------------------

def position_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """Causal (optionally sliding-window) mask ``[B, 1, T, S]``; True = may attend.

    ``q_pos [B, T]``, ``k_pos [S]``: key ``k`` is visible from query ``q`` iff ``k <= q`` (and
    ``k > q - window``).
    """
    q = q_pos[:, None, :, None]  # [B, 1, T, 1]
    mask = k_pos <= q  # [B, 1, T, S]
    if window is not None:
        mask = mask & (k_pos > q - window)
    return mask


def cache_mask(step: CacheStep, window: int | None = None) -> Tensor | None:
    """The :func:`position_mask` of a cached step, or None where it needs none: one row, one
    query, and keys read up to exactly that row's length (no fixed ``kv_len``, no window), so
    the query attends every key (:class:`Attention` reads None with ``T == 1`` so)."""
    if step.exact and step.positions.shape == (1, 1) and window is None:
        return None
    key_pos = torch.arange(step.kv_len, device=step.positions.device)  # [S]
    return position_mask(step.positions, key_pos, window)  # [B, 1, T, S]


def tree_mask(step: CacheStep, ancestors: Tensor) -> Tensor:
    """The mask of a draft tree's verify step ``[B, 1, T, S]``: every query sees the row's cached
    keys and, among the new tokens (consecutive columns from the row's start), its
    ``ancestors [T, T]`` (infer/draft_tree.py)."""
    t = ancestors.shape[0]
    start = step.write_pos[:, :1]  # [B, 1] the pending token's column (never padding)
    rel = torch.arange(step.kv_len, device=start.device)[None, :] - start  # [B, S]
    inside = (rel >= 0) & (rel < t)  # [B, S]
    seen = ancestors[None].expand(rel.shape[0], -1, -1).gather(
        2, rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1))  # [B, T, S]
    return ((rel < 0)[:, None, :] | (inside[:, None, :] & seen))[:, None]


def packed_causal_mask(doc_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask ``[B, 1, T, T]`` for packed documents ``doc_ids [B, T]``."""
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()  # [T, T]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
    return (same_doc & causal)[:, None]

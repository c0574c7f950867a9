"""Triton kernels for the rejection sampler; ``rejection_core_reference`` and
``block_core_reference`` are their specifications.

One program per request row does the whole deterministic part:

1. acceptance scan: load the row's k drafts, their target probabilities ``p(x_j)`` (and ``q(x_j)``),
   and uniforms; ``num_accepted`` = index of the first failing test (capped at ``n`` drafts),
   found with one ``min`` reduction instead of a sequential loop;
2. final token: stream the vocabulary at position ``num_accepted`` in ``BLOCK_V`` chunks, keeping
   two running exponential-race argmaxes, one over ``p / noise`` (bonus token, synthetic, and the
   all-zero-residual fallback) and one over ``residual / noise`` (recovered token), plus the
   residual's max; so the residual is never written to memory;
3. store accepted drafts, the final token and -1 padding into ``out[row, :k + 1]``.

Every float operation mirrors the reference one for one (IEEE ``div_rn`` for the race, the same
comparisons, first-index tie-breaks), which is why the two agree token for token given the same
random tensors. This module imports triton at the top; ``infer.rejection`` imports it lazily.

Block verification (``_block_kernel``) walks the row's block positions in order, keeping
``p_i`` and the last position that may end the block; each position below the row's draft count
streams the next position's vocabulary once for ``Z_{i+1}`` (a sum: its chunked order differs
from torch's, so the two can disagree where a uniform lies within float rounding of ``h_i``),
then ``_final_token`` streams position ``tau`` with the residual scaled by ``p_tau``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

ONE_HOT_Q: tl.constexpr = tl.constexpr(0)  # strict, or probabilistic without draft_probs
DRAFT_Q: tl.constexpr = tl.constexpr(1)  # probabilistic with draft_probs
SYNTHETIC: tl.constexpr = tl.constexpr(2)
MAX_BLOCK_V = 2048  # vocabulary chunk per loop step (tests lower it to exercise several chunks)


@triton.jit
def _acceptance_scan(probs_ptr, draft_ptr, uniform_ptr, q_ptr, accept_ptr, row, n_drafts, K,
                     VOCAB, METHOD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Number of accepted drafts in this row: first j whose test fails, at most n_drafts."""
    j = tl.arange(0, BLOCK_K)
    drafted = j < n_drafts
    x = tl.maximum(tl.load(draft_ptr + row * K + j, mask=drafted, other=0), 0)
    u = tl.load(uniform_ptr + row * K + j, mask=drafted, other=1.0)
    p_x = tl.load(probs_ptr + (row * (K + 1) + j) * VOCAB + x, mask=drafted, other=0.0)
    if METHOD == SYNTHETIC:
        ok = u < tl.load(accept_ptr + row)
    elif METHOD == ONE_HOT_Q:
        ok = u < p_x
    else:
        q_x = tl.load(q_ptr + (row * K + j) * VOCAB + x, mask=drafted, other=1.0)
        ok = u * q_x < p_x
    ok = ok & drafted
    first_fail = tl.min(tl.where(ok, BLOCK_K, j), axis=0)
    return tl.minimum(first_fail, n_drafts)


@triton.jit
def _race_update(score, start, best, best_idx):
    """Fold one chunk into a running argmax; strict ``>`` keeps the first index on ties."""
    m = tl.max(score, axis=0)
    i = tl.argmax(score, axis=0, tie_break_left=True) + start
    take = m > best
    return tl.where(take, m, best), tl.where(take, i, best_idx)


@triton.jit
def _final_token(probs_ptr, draft_ptr, noise_ptr, q_ptr, row, num_acc, n_drafts, K, VOCAB,
                 METHOD: tl.constexpr, BLOCK_V: tl.constexpr, scale=1.0):
    """Recovered token (first rejection) or bonus token (all accepted) for this row; the
    residual is ``max(scale * p - q, 0)`` (block verification's ``p_tau``; 1 otherwise)."""
    rejected = num_acc < n_drafts
    p_base = (row * (K + 1) + num_acc) * VOCAB
    q_base = (row * K + num_acc) * VOCAB
    x_rej = tl.load(draft_ptr + row * K + num_acc, mask=rejected, other=-1)
    best_p = tl.full([], float("-inf"), tl.float32)
    idx_p = tl.full([], 0, tl.int32)
    best_r = tl.full([], float("-inf"), tl.float32)
    idx_r = tl.full([], 0, tl.int32)
    r_max = tl.full([], 0.0, tl.float32)
    for start in range(0, VOCAB, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inb = cols < VOCAB
        p = tl.load(probs_ptr + p_base + cols, mask=inb, other=0.0)
        e = tl.load(noise_ptr + row * VOCAB + cols, mask=inb, other=1.0)
        best_p, idx_p = _race_update(tl.where(inb, tl.math.div_rn(p, e), float("-inf")), start,
                                     best_p, idx_p)
        if METHOD != SYNTHETIC:
            if METHOD == ONE_HOT_Q:
                r = tl.where(cols == x_rej, 0.0, scale * p)
            else:
                # a block-shaped mask (the interpreter rejects scalar & block masks)
                q_mask = inb & ((cols * 0 + num_acc) < n_drafts)
                q = tl.load(q_ptr + q_base + cols, mask=q_mask, other=0.0)
                r = tl.maximum(scale * p - q, 0.0)
            r_max = tl.maximum(r_max, tl.max(r, axis=0))
            best_r, idx_r = _race_update(tl.where(inb, tl.math.div_rn(r, e), float("-inf")),
                                         start, best_r, idx_r)
    if METHOD == SYNTHETIC:
        return idx_p
    return tl.where(rejected & (r_max > 0.0), idx_r, idx_p)


@triton.jit
def _rejection_kernel(probs_ptr, draft_ptr, num_drafts_ptr, uniform_ptr, noise_ptr, q_ptr,
                      accept_ptr, out_ptr, K, VOCAB, METHOD: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_drafts = tl.load(num_drafts_ptr + row)
    num_acc = _acceptance_scan(probs_ptr, draft_ptr, uniform_ptr, q_ptr, accept_ptr, row,
                               n_drafts, K, VOCAB, METHOD, BLOCK_K)
    final = _final_token(probs_ptr, draft_ptr, noise_ptr, q_ptr, row, num_acc, n_drafts, K,
                         VOCAB, METHOD, BLOCK_V)
    slots = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + row * K + slots, mask=slots < num_acc, other=-1)
    out = tl.where(slots == num_acc, final.to(tl.int64), drafts)
    tl.store(out_ptr + row * (K + 1) + slots, out, mask=slots < K + 1)


def rejection_core_triton(probs: torch.Tensor, draft_ids: torch.Tensor,
                          num_drafts: torch.Tensor, uniforms: torch.Tensor,
                          noise: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
                          accept_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as ``infer.rejection.rejection_core_reference``; returns ``[batch, k + 1]``."""
    batch, k1, vocab = probs.shape
    out = torch.empty(batch, k1, dtype=torch.long, device=probs.device)  # [batch, k + 1]
    if batch == 0:
        return out
    if accept_prob is not None:
        method = SYNTHETIC.value
    else:
        method = (ONE_HOT_Q if draft_probs is None else DRAFT_Q).value
    # pointer slots a method never reads (constexpr-pruned) get any valid tensor
    q = draft_probs if draft_probs is not None else probs
    accept = accept_prob if accept_prob is not None else uniforms
    args = [t.contiguous() for t in (probs, draft_ids, num_drafts, uniforms, noise, q, accept)]
    # launch under the tensors' device: Triton binds the current device's context
    on_device = torch.cuda.device(probs.device) if probs.is_cuda else contextlib.nullcontext()
    with on_device:
        _rejection_kernel[(batch,)](
            *args, out, k1 - 1, vocab, METHOD=method, BLOCK_K=triton.next_power_of_2(k1),
            BLOCK_V=min(MAX_BLOCK_V, triton.next_power_of_2(vocab)))
    return out


@triton.jit
def _block_z(probs_ptr, q_ptr, row, i, p_i, x_next, K, VOCAB, ONE_HOT: tl.constexpr,
             BLOCK_V: tl.constexpr):
    """Z_{i+1} = sum_v max(p_i * p_i(v) - q_{i+1}(v), 0) over position i's vocabulary."""
    base = (row * (K + 1) + i) * VOCAB
    if ONE_HOT:  # q one-hot at the next draft: p_i * (1 - p_i(x_{i+1}))
        return p_i * (1.0 - tl.load(probs_ptr + base + x_next))
    z = tl.full([], 0.0, tl.float32)
    for start in range(0, VOCAB, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inb = cols < VOCAB
        p = tl.load(probs_ptr + base + cols, mask=inb, other=0.0)
        q = tl.load(q_ptr + (row * K + i) * VOCAB + cols, mask=inb, other=0.0)
        z += tl.sum(tl.maximum(p_i * p - q, 0.0), axis=0)
    return z


@triton.jit
def _block_tau(probs_ptr, draft_ptr, uniform_ptr, q_ptr, row, n_drafts, K, VOCAB,
               ONE_HOT: tl.constexpr, BLOCK_V: tl.constexpr):
    """(tau, p_tau): the last block position whose uniform is <= h_i, and its p_i."""
    p_blk = tl.full([], 1.0, tl.float32)
    tau = tl.full([], 0, tl.int64)
    p_tau = tl.full([], 1.0, tl.float32)
    for i in range(1, K + 1):
        active = i <= n_drafts
        x = tl.maximum(tl.load(draft_ptr + row * K + i - 1), 0)
        p_x = tl.load(probs_ptr + (row * (K + 1) + i - 1) * VOCAB + x)
        if ONE_HOT:
            ratio = p_x
        else:
            q_x = tl.load(q_ptr + (row * K + i - 1) * VOCAB + x)
            ratio = tl.where(q_x > 0, tl.math.div_rn(p_x, tl.maximum(q_x, 1e-30)), 0.0)
        p_blk = tl.where(active, tl.minimum(p_blk * ratio, 1.0), p_blk)
        more = i < n_drafts
        x_next = tl.maximum(tl.load(draft_ptr + row * K + tl.minimum(i, K - 1)), 0)
        z = _block_z(probs_ptr, q_ptr, row, tl.minimum(i, K - 1), p_blk, x_next, K, VOCAB,
                     ONE_HOT, BLOCK_V)
        denom = z + 1.0 - p_blk
        h = tl.where(denom > 0, tl.math.div_rn(z, tl.maximum(denom, 1e-30)), 0.0)
        h = tl.where(more, h, p_blk)
        take = active & (tl.load(uniform_ptr + row * K + i - 1) <= h)
        tau = tl.where(take, i, tau)
        p_tau = tl.where(take, p_blk, p_tau)
    return tau, p_tau


@triton.jit
def _block_kernel(probs_ptr, draft_ptr, num_drafts_ptr, uniform_ptr, noise_ptr, q_ptr, out_ptr,
                  K, VOCAB, ONE_HOT: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n_drafts = tl.load(num_drafts_ptr + row)
    tau, p_tau = _block_tau(probs_ptr, draft_ptr, uniform_ptr, q_ptr, row, n_drafts, K, VOCAB,
                            ONE_HOT, BLOCK_V)
    # the token after the kept drafts: from the block's residual at tau when it ended early
    final = _final_token(probs_ptr, draft_ptr, noise_ptr, q_ptr, row, tau, n_drafts, K, VOCAB,
                         ONE_HOT_Q if ONE_HOT else DRAFT_Q, BLOCK_V, p_tau)
    slots = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + row * K + slots, mask=slots < tau, other=-1)
    out = tl.where(slots == tau, final.to(tl.int64), drafts)
    tl.store(out_ptr + row * (K + 1) + slots, out, mask=slots < K + 1)


def block_core_triton(probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                      uniforms: torch.Tensor, noise: torch.Tensor,
                      draft_probs: Optional[torch.Tensor] = None,
                      accept_prob: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as ``infer.rejection.block_core_reference``; returns ``[batch, k + 1]``."""
    batch, k1, vocab = probs.shape
    out = torch.empty(batch, k1, dtype=torch.long, device=probs.device)  # [batch, k + 1]
    if batch == 0:
        return out
    q = draft_probs if draft_probs is not None else probs  # never read when one-hot
    args = [t.contiguous() for t in (probs, draft_ids, num_drafts, uniforms, noise, q)]
    on_device = torch.cuda.device(probs.device) if probs.is_cuda else contextlib.nullcontext()
    with on_device:
        _block_kernel[(batch,)](
            *args, out, k1 - 1, vocab, ONE_HOT=draft_probs is None,
            BLOCK_K=triton.next_power_of_2(k1),
            BLOCK_V=min(MAX_BLOCK_V, triton.next_power_of_2(vocab)))
    return out

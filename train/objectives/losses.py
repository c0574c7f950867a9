"""The losses the objectives share, written once (argument order: the drafter's side first).

- ``forward_kl(logits, target_logp)``: ``KL(p || q)`` per position, p the target's distribution
  (log-probabilities), q the drafter's (logits). Soft cross-entropy minus the target's entropy:
  the same gradient as the soft CE, and 0 at a perfect match, so its value reads as a distance.
- ``distill_loss(kind, logits, target_logp)``: ``objective.loss``, the distance a drafter is
  trained down, per position. Besides ``kl``: ``rkl`` = KL(q || p) (mode-seeking); ``jsd``, the
  Jensen-Shannon divergence; ``ce``, cross-entropy to p's argmax; and three shaped by what
  verification accepts, ``alpha = sum_v min(p, q)`` being the probability that a draft sampled
  from q is accepted against p: ``tv = 1 - alpha``, ``nla = -log max(alpha, 1e-5)`` and
  ``lk_hybrid = lambda KL + (1 - lambda) TV`` with ``lambda = exp(-3 alpha)`` (no gradient
  through lambda): KL's strong gradient while q is far, TV's direct one once it is close
  (vllm-project/speculators' options; docs/reference.md).
- ``expected_acceptance(accs)``: EAL = ``sum_k prod_{i <= k} acc_i`` over per-position top-1
  accuracies, the accepted drafts a chain would expect if its positions failed independently
  (speculators' training metric, logged as ``eal`` by every objective; ``1 + eal`` compares with
  ``acceptance_length_est``, which counts whole right chains instead).
- ``dpace_weights(losses, valid)``: D-PACE position weights (speculators): with
  ``q_k = exp(-loss_k)`` (how likely step k of an anchor's chain is right) and ``s_k = 0.5 q_k +
  0.5``, ``P_k = prod_{j <= k} s_j`` and ``w_k = sum_{m >= k} P_m valid_m``: a step weighs what
  the steps after it still stand to accept; no gradient.
- ``masked_mean(values, valid)``: the mean over the positions that train.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def forward_kl(logits: Tensor, target_logp: Tensor) -> Tensor:
    """``KL(p || q)`` per position: ``logits [..., V]`` of q, ``target_logp [..., V]`` of p
    -> ``[...]`` (computed in fp32)."""
    logq = F.log_softmax(logits.float(), dim=-1)
    return (target_logp.exp() * (target_logp - logq)).sum(-1)


def distill_loss(kind: str, logits: Tensor, target_logp: Tensor) -> Tensor:
    """``objective.loss`` per position (module doc): ``logits [..., V]`` of q, ``target_logp
    [..., V]`` of p -> ``[...]`` fp32."""
    if kind == "kl":
        return forward_kl(logits, target_logp)
    logq = F.log_softmax(logits.float(), dim=-1)
    logp = target_logp.float()
    p, q = logp.exp(), logq.exp()
    if kind == "rkl":
        return (q * (logq - logp)).sum(-1)
    if kind == "jsd":
        logm = torch.log((0.5 * (p + q)).clamp_min(1e-30))
        return 0.5 * (p * (logp - logm)).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
    if kind == "ce":
        return -logq.gather(-1, logp.argmax(-1, keepdim=True)).squeeze(-1)
    alpha = torch.minimum(p, q).sum(-1)  # [...]: acceptance of a draft sampled from q
    if kind == "tv":
        return 1.0 - alpha
    if kind == "nla":
        return -torch.log(alpha.clamp_min(1e-5))
    if kind == "lk_hybrid":
        lam = torch.exp(-3.0 * alpha.detach())
        return lam * (p * (logp - logq)).sum(-1) + (1 - lam) * (1.0 - alpha)
    raise ValueError(f"distill_loss: unknown kind {kind!r}")


def expected_acceptance(accs: Sequence[Tensor] | Tensor) -> Tensor:
    """EAL (module doc) from the per-position accuracies ``accs`` ([k] or k scalars)."""
    accs = accs if isinstance(accs, Tensor) else torch.stack([a.float() for a in accs])
    return torch.cumprod(accs.float().detach(), 0).sum()


def dpace_weights(losses: Tensor, valid: Tensor, floor: float = 0.5) -> Tensor:
    """``losses``, ``valid`` ``[K, ...]`` (step first; invalid entries ignored) -> weights
    ``[K, ...]`` (module doc), detached."""
    q = torch.exp(-losses.detach().float()) * valid
    s = (1 - floor) * q + floor
    prefix = torch.cumprod(torch.where(valid.bool(), s, torch.ones_like(s)), dim=0)  # P_k
    kept = prefix * valid
    return torch.flip(torch.cumsum(torch.flip(kept, [0]), 0), [0])  # sum over m >= k


def masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values`` over ``valid`` (same shape; 0 when nothing is valid; keeps grad)."""
    return (values * valid).sum() / valid.sum().clamp(min=1)

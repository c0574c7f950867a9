"""The losses the objectives share, written once (argument order: the drafter's side first).

- ``forward_kl(logits, target_logp)``: ``KL(p || q)`` per position, p the target's distribution
  (log-probabilities), q the drafter's (logits). Soft cross-entropy minus the target's entropy:
  the same gradient as the soft CE, and 0 at a perfect match, so its value reads as a distance.
- ``masked_mean(values, valid)``: the mean over the positions that train.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def forward_kl(logits: Tensor, target_logp: Tensor) -> Tensor:
    """``KL(p || q)`` per position: ``logits [..., V]`` of q, ``target_logp [..., V]`` of p
    -> ``[...]`` (computed in fp32)."""
    logq = F.log_softmax(logits.float(), dim=-1)
    return (target_logp.exp() * (target_logp - logq)).sum(-1)


def masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values`` over ``valid`` (same shape; 0 when nothing is valid; keeps grad)."""
    return (values * valid).sum() / valid.sum().clamp(min=1)

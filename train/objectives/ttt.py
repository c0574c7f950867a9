"""Training-time test (TTT): the unroll shared by the EAGLE heads (``eagle3.py``, ``eagle.py``).

At inference an EAGLE head drafts a chain: the catch-up pass pairs the target's feature at ``t``
with ``token_{t+1}`` (position ``t``), and every later draft feeds the head's *own* output state
back. Training only on the first kind of pair teaches the head inputs it never sees after draft
one, so the unroll replays the chain during training (EAGLE-3's "training-time test").

Conventions, per packed row of ``T`` tokens ``x_0 .. x_{T-1}`` (``f_t``: target feature at t)::

    step 0: pair (f_t, x_{t+1})           at position_ids[t]      -> h^0_t predicts x_{t+2}
    step s: pair (h^{s-1}_t, x_{t+1+s})   at position_ids[t] + s  -> h^s_t predicts x_{t+2+s}
            target: the target's distribution at t + 1 + s (the one that predicts x_{t+2+s})
    (t, s) counts when loss_mask[t+2+s], t + 2 + s < T and doc_ids[t+2+s] == doc_ids[t]

Attention of step ``s`` (keys of steps ``0 .. s`` concatenated, ``StepKV``): query ``t`` sees the
step-0 keys ``<= t`` of its own document (``document_attention_mask``) and, of steps ``1 .. s``,
only its own index ``t`` -- exactly the keys the chain drafted from anchor ``t`` has at inference
(the verified prefix, then its own earlier drafts). Token inputs past the row end are filled with
id 0; they only reach queries whose (t, s) is invalid.

Gradients flow through the fed-back states (as in speculators and SpecForge): step ``s``'s loss
also trains how the earlier steps shape the state they hand on.

Loss of step ``s``: per-position loss (the method's) averaged over its valid positions; total =
``sum_s step_weight ** s * loss_s``. Metrics (detached, no host sync): ``loss/step_s``, ``acc_s``
(draft argmax == target argmax), ``full_acc_s`` (steps ``0 .. s`` all right from the same anchor:
the chance a greedy chain accepts ``s + 1`` drafts), ``cond_acc_s`` (right at ``s`` given
``0 .. s-1`` right) and ``acceptance_length_est = 1 + sum_s full_acc_s`` (docs/reference.md §3).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Iterator

import torch
from torch import Tensor

from infer.drafters.common import StepKV
from train.config import validate_section
from train.data import document_attention_mask
from train.objectives.base import LossOutput, Objective
from train.objectives.losses import masked_mean


def ttt_attention_mask(doc_ids: Tensor, step: int) -> Tensor:
    """Bool ``[B, T, (step + 1) * T]`` mask of TTT step ``step`` (True = may attend).

    Block ``0`` is the block-diagonal causal mask over step-0 keys; blocks ``1 .. step`` are the
    identity (query ``t`` sees only the key its own chain wrote at index ``t`` in that step).
    """
    base = document_attention_mask(doc_ids)  # [B, T, T]
    if step == 0:
        return base
    b, t = doc_ids.shape
    eye = torch.eye(t, dtype=torch.bool, device=doc_ids.device).expand(b, t, t)  # [B, T, T]
    return torch.cat([base] + [eye] * step, dim=-1)  # [B, T, (step + 1) * T]


def step_valid(loss_mask: Tensor, doc_ids: Tensor, step: int) -> Tensor:
    """Bool ``[B, T]``: whether anchor ``t`` trains at ``step`` (its target token ``t + 2 +
    step`` exists, is a loss token and lies in the document of ``t``)."""
    k = 2 + step
    t = loss_mask.shape[-1]
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)  # [B, T]
    if t > k:
        valid[:, : t - k] = loss_mask[:, k:].bool() & (doc_ids[:, k:] == doc_ids[:, : t - k])
    return valid


def shift_left(x: Tensor, n: int, fill: int = 0) -> Tensor:
    """``y[:, t] = x[:, t + n]`` (``fill`` past the end): ``[B, T, ...]`` -> same shape."""
    y = torch.full_like(x, fill)
    if n < x.shape[1]:
        y[:, : x.shape[1] - n] = x[:, n:]
    return y


class StepStats:
    """Per-step loss and greedy-chain accuracies of one unroll (module doc: definitions)."""

    def __init__(self) -> None:
        self.metrics: dict[str, Tensor] = {}
        self.full: Tensor | None = None  # [B, T] bool: steps 0 .. s-1 right from anchor t
        self.accept = None

    def add(self, step: int, loss: Tensor, correct: Tensor, valid: Tensor,
            extras: dict[str, Tensor]) -> None:
        """``correct``/``valid`` bool ``[B, T]``; ``extras``: name -> scalar, logged per step."""
        prev = self.full if self.full is not None else torch.ones_like(correct)
        full = prev & correct  # [B, T]
        count = valid.sum().clamp(min=1)
        m = self.metrics
        m[f"loss/step_{step}"] = loss.detach()
        for name, value in extras.items():
            m[f"{name}/step_{step}"] = value.detach()
        m[f"acc_{step}"] = (correct & valid).sum() / count
        m[f"full_acc_{step}"] = (full & valid).sum() / count
        m[f"cond_acc_{step}"] = (full & valid).sum() / (prev & valid).sum().clamp(min=1)
        self.accept = m[f"full_acc_{step}"] + (0 if self.accept is None else self.accept)
        m["acceptance_length_est"] = 1 + self.accept
        self.full = full


class TTTObjective(Objective):
    """Base of the EAGLE objectives: the unroll, masks, weighting and metrics live here; a
    subclass says what the step-0 hidden input is (``features``), what it is compared with
    (``targets``, computed once without grad) and the per-position loss (``step_loss``)."""

    def __init__(self, cfg, heads, vocab, target_dir):
        super().__init__(cfg, heads, vocab, target_dir)
        o = cfg.objective
        validate_section("objective", o)  # ttt_steps, step_weight, feature_noise, weights ...
        self.ttt_steps, self.step_weight = int(o.ttt_steps), float(o.step_weight)
        self.feature_noise = float(o.feature_noise)

    def noisy(self, x: Tensor) -> Tensor:
        """``x`` plus uniform noise in ``[-a, a]`` (``objective.feature_noise``) while training:
        target features at inference come from a slightly different context than at training
        (EAGLE's robustness trick)."""
        if not self.training or self.feature_noise <= 0:
            return x
        return x + (torch.rand_like(x) * 2 - 1) * self.feature_noise

    @abstractmethod
    def features(self, batch: dict[str, Tensor]) -> Tensor:
        """Step-0 hidden input of the drafter ``[B, T, H]`` (noise applied)."""

    @abstractmethod
    def targets(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-position targets over the whole row, ``[B, T, ...]`` (called under no_grad)."""

    @abstractmethod
    def step_loss(self, step: int, logits: Tensor, hidden: Tensor, targets: dict[str, Tensor]
                  ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Rows ``0 .. n-1`` of step ``step``'s ``logits [B, n, V]`` / ``hidden [B, n, H]``
        against ``targets`` rows ``1 + step ..`` -> ``(loss [B, n], correct [B, n] bool,
        extras {name: [B, n]})``."""

    def unroll(self, batch: dict[str, Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
        """The TTT chain: per step ``(logits [B, T, V], hidden [B, T, H])`` (module doc)."""
        ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]  # [B, T]
        hidden, kv = self.features(batch), StepKV()  # [B, T, H]
        for s in range(self.ttt_steps):
            logits, hidden = self.drafter.forward_train(
                shift_left(ids, 1 + s), hidden, pos + s, ttt_attention_mask(docs, s), kv)
            yield logits, hidden  # the next step feeds the head's own state back

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        loss_mask, docs = batch["loss_mask"].bool(), batch["doc_ids"]  # [B, T]
        t = loss_mask.shape[1]
        with torch.no_grad():
            targets = self.targets(batch)
        stats, total, num_tokens = StepStats(), 0.0, None
        for s, (logits, hidden) in enumerate(self.unroll(batch)):
            n = max(t - 1 - s, 0)  # anchors whose target row t + 1 + s is inside the row
            valid = step_valid(loss_mask, docs, s)  # [B, T]
            loss_pos, correct, extras = self.step_loss(s, logits[:, :n], hidden[:, :n], targets)
            loss = masked_mean(loss_pos, valid[:, :n])
            total = total + self.step_weight ** s * loss
            padded = torch.zeros_like(valid)  # [B, T]
            padded[:, :n] = correct
            stats.add(s, loss, padded, valid,
                      {k: masked_mean(v, valid[:, :n]) for k, v in extras.items()})
            num_tokens = valid.sum() if num_tokens is None else num_tokens
        return LossOutput(total, stats.metrics, num_tokens)

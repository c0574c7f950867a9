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

Attention of step ``s`` (keys of steps ``0 .. s``): query ``t`` sees the step-0 keys ``<= t`` of
its own document (``document_attention_mask``) and, of steps ``1 .. s``, only its own index ``t``
-- exactly the keys the chain drafted from anchor ``t`` has at inference (the verified prefix,
then its own earlier drafts). ``ttt_attention_mask`` is that rule as a dense mask over the
concatenated keys; ``TTTKeys`` (infer/drafters/common.py) computes the same attention without
the masked-out blocks, and is what the unroll uses. Token inputs past the row end are filled with
id 0; they only reach queries whose (t, s) is invalid.

Gradients flow through the fed-back states (as in speculators and SpecForge): step ``s``'s loss
also trains how the earlier steps shape the state they hand on.

Loss of step ``s``: per-position loss (the method's) averaged over its valid positions; the LM
head, the targets and the loss are computed at those positions only (``forward_train(select=)``,
``target_rows``): computed everywhere, the ``[B, T, V]`` tensors took over half of a default
EAGLE-3 step with the whole vocabulary (docs/benchmarks-history.md); the boolean selections cost one
small host sync per step. Total = ``sum_s step_weight ** s * loss_s``. Metrics (detached, no
host sync of their own): ``loss/step_s``, ``acc_s``
(draft argmax == target argmax), ``full_acc_s`` (steps ``0 .. s`` all right from the same anchor:
the chance a greedy chain accepts ``s + 1`` drafts), ``cond_acc_s`` (right at ``s`` given
``0 .. s-1`` right) and ``acceptance_length_est = 1 + sum_s full_acc_s`` (docs/reference.md §3).
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from infer.drafters.common import TTTKeys
from train.config import validate_section
from train.objectives.losses import dpace_weights
from train.data import document_attention_mask
from train.objectives.base import LossOutput, Objective

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab


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


def target_rows(loss_mask: Tensor) -> Tensor:
    """Bool ``[B, T]``: the rows whose target distribution some step compares with. Anchor
    ``t`` of step ``s`` compares with row ``r = t + 1 + s`` and trains only if ``loss_mask[r +
    1]``, so these are the rows before a loss token: targets are computed there only (the
    assistant tokens were ~40 % of the default recipe's packed rows)."""
    return shift_left(loss_mask.bool(), 1, fill=False)


def step_index(rows: Tensor, valid: Tensor, step: int) -> Tensor:
    """``[N]`` indices into targets computed at ``rows`` (one per True, row-major) for the
    ``N`` valid anchors of ``step`` (``valid`` bool ``[B, T]``, the order of ``x[valid]``):
    anchor ``t`` reads row ``t + 1 + step``, which ``target_rows`` always holds."""
    t = valid.shape[1]
    at = torch.zeros_like(valid)  # [B, T]: the rows the valid anchors read
    if t > 1 + step:
        at[:, 1 + step:] = valid[:, : t - 1 - step]
    compact = rows.flatten().cumsum(0) - 1  # [B * T]: index of each row among ``rows``
    return compact[at.flatten()]


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
        self.run, self.eal = 1.0, 0.0  # running product of acc_s, and EAL = its sum

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
        self.run = self.run * m[f"acc_{step}"].detach()  # EAL (losses.expected_acceptance)
        self.eal = m["eal"] = self.eal + self.run
        self.full = full


class TTTObjective(Objective):
    """Base of the EAGLE objectives: the unroll, masks, weighting and metrics live here; a
    subclass says what the step-0 hidden input is (``features``), what it is compared with
    (``targets``, computed once without grad) and the per-position loss (``step_loss``)."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        o = cfg.objective
        validate_section("objective", o)  # ttt_steps, step_weight, feature_noise, weights ...
        self.ttt_steps, self.step_weight = int(o.ttt_steps), float(o.step_weight)
        self.position_weights = str(o.position_weights)
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
    def targets(self, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        """Targets at the ``M`` True positions of ``rows`` (bool ``[B, T]``, ``target_rows``),
        each ``[M, ...]`` in row-major order (called under no_grad)."""

    @abstractmethod
    def step_loss(self, step: int, logits: Tensor, hidden: Tensor, targets: dict[str, Tensor]
                  ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Step ``step``'s ``logits [N, V]`` / ``hidden [N, H]`` at its ``N`` valid anchors
        against ``targets`` at the rows they read (``[N, ...]``) -> ``(loss [N], correct [N]
        bool, extras {name: [N]})``."""

    def unroll(self, batch: dict[str, Tensor], valids: list[Tensor] | None = None
               ) -> Iterator[tuple[Tensor, Tensor]]:
        """The TTT chain: per step ``s`` (``logits`` at the anchors ``valids[s]``, ``[N_s, V]``,
        or everywhere without ``valids``, ``[B, T, V]``; ``hidden [B, T, H]``) (module doc)."""
        ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]  # [B, T]
        hidden, kv = self.features(batch), TTTKeys(document_attention_mask(docs))  # [B, T, H]
        for s in range(self.ttt_steps):
            logits, hidden = self.drafter.forward_train(
                shift_left(ids, 1 + s), hidden, pos + s, None, kv,
                select=None if valids is None else valids[s])
            yield logits, hidden  # the next step feeds the head's own state back

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        loss_mask, docs = batch["loss_mask"].bool(), batch["doc_ids"]  # [B, T]
        rows = target_rows(loss_mask)  # [B, T]
        with torch.no_grad():
            targets = self.targets(batch, rows)  # {name: [M, ...]}
        valids = [step_valid(loss_mask, docs, s) for s in range(self.ttt_steps)]  # [B, T] each
        stats, total, grids = StepStats(), 0.0, []
        for s, (logits, hidden) in enumerate(self.unroll(batch, valids)):
            valid = valids[s]
            index = step_index(rows, valid, s)  # [N]
            loss_pos, correct, extras = self.step_loss(
                s, logits, hidden[valid], {k: v[index] for k, v in targets.items()})
            count = max(index.numel(), 1)
            loss = loss_pos.sum() / count
            total = total + self.step_weight ** s * loss
            if self.position_weights == "dpace":  # the anchors' losses, [B, T]
                grid = torch.zeros(valid.shape, device=valid.device)
                grids.append(grid.masked_scatter(valid, loss_pos.float()))
            padded = torch.zeros_like(valid)  # [B, T]
            padded[valid] = correct
            stats.add(s, loss, padded, valid, {k: v.sum() / count for k, v in extras.items()})
        if self.position_weights == "dpace":  # replaces the geometric total
            total = dpace_total(torch.stack(grids), torch.stack(valids))
        return LossOutput(total, stats.metrics, valids[0].sum())


def dpace_total(losses: Tensor, valid: Tensor) -> Tensor:
    """``losses``, ``valid`` ``[K, B, T]`` -> sum over steps of each step's D-PACE-weighted
    mean loss over its valid anchors (train/objectives/losses.py ``dpace_weights``)."""
    weighted = dpace_weights(losses, valid) * losses  # [K, B, T]
    return (weighted.sum((1, 2)) / valid.sum((1, 2)).clamp(min=1)).sum()

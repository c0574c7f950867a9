"""DFlash objective: the block drafter of ``infer/drafters/dflash.py`` trained on same-position
blocks (docs/reference.md §12). There is NO EAGLE shift: a block anchored at index ``a`` is
exactly the block the proposer builds when ``x_a`` is the pending token (applying EAGLE's
shift here trained a misaligned model, SpecForge #471-473).

Block at anchor ``a`` (``B = objective.block_size`` slots)::

    slot 0 = x_a, slots 1 .. B-1 = MASK, at positions position_ids[a] .. + B - 1
    keys   = context (target aux states -> fc / hidden_norm -> per-layer k/v) at indices < a in
             a's document, then the block's own B rows, bidirectionally
    slot j predicts x_{a+j}: trained where a + j is in the row, in a's document and loss-masked

Anchors: indices ``a`` with ``loss_mask[a]`` (x_a is a generated token, as at serving) whose slot
1 trains; up to ``objective.max_anchors`` per row, drawn at random while training and evenly
spaced in eval mode; blocks may overlap. Unlike the reference we keep anchors within B of the
document end (their later slots are simply invalid), so the last tokens of an answer are trained
at small j too.

Loss: forward KL from the target's distribution at ``a + j - 1`` (``lm_head(hidden)``, which
predicts x_{a+j}), restricted to the draft vocabulary as EAGLE-3 does, per slot weight
``exp(-(j - 1) / decay_gamma)``, weighted mean over valid slots. KL rather than CE on tokens:
it carries the target's whole distribution (sampled serving) and needs no argmax labels.

Layout: context k/v are computed once per layer for all T positions; queries are the A x B
block rows; the mask is ``[A*B, T + A*B]`` (context part by index and document, block part
block-diagonal). The block-to-block part is mostly masked out; a two-part attention merged by
log-sum-exp would save that compute (not done yet).

Metrics (draft index from 0 like the other families: ``acc_0`` is slot 1): ``acc_i`` per slot
(drafted target id == the target's full-vocabulary argmax), ``full_acc_i`` (slots 1 .. i + 1
all right, over anchors where they all train), ``loss/slot_i``, and
``acceptance_length_est = 1 + sum_i prod_{i' <= i} acc_i'``.

Embedding and LM head: the target's, frozen and not saved, unless ``embed_requires_grad`` (own
embedding, a trained copy) or a draft vocabulary smaller than the target's (own ``lm_head`` over
the draft rows, started as the target's rows, trained; ``d2t`` exported).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.common import write_checkpoint
from infer.drafters.dflash import ContextKV, DFlashDrafter, default_aux_layer_ids
from infer.foundation.files import check_tensors, read_json
from infer.models.loader import resolve_model_dir
from infer.foundation.validation import config_error
from train.objectives.base import OBJECTIVES, FeatureSpec, LossOutput, Objective, from_end
from train.objectives.pard import choose_mask_token
from train.real.targets import verifier_name

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab

_WHERE = "train config"


def anchor_candidates(loss_mask: Tensor, doc: Tensor) -> Tensor:
    """bool ``[B, T]``: ``a`` may anchor a block (loss-masked, and slot 1 trains: ``a + 1`` is
    in the row, in a's document and loss-masked)."""
    nxt = torch.zeros_like(loss_mask)
    nxt[:, :-1] = loss_mask[:, 1:] & (doc[:, 1:] == doc[:, :-1])
    return loss_mask & nxt


def sample_anchors(candidates: Tensor, max_anchors: int, random: bool) -> tuple[Tensor, Tensor]:
    """Up to ``max_anchors`` sorted anchors per row: ``(anchors [B, A], valid [B, A])``; padding
    anchors are index 0 and invalid. ``random``: drawn uniformly, else evenly spaced."""
    rows = []
    for cand in candidates.cpu():
        idx = cand.nonzero().flatten()  # [n]
        if idx.numel() > max_anchors:
            if random:
                idx = idx[torch.randperm(idx.numel())[:max_anchors]].sort().values
            else:
                idx = idx[torch.linspace(0, idx.numel() - 1, max_anchors).round().long()]
        rows.append(idx)
    a = max(1, max(r.numel() for r in rows))
    anchors = torch.zeros(len(rows), a, dtype=torch.long)
    valid = torch.zeros(len(rows), a, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : r.numel()], valid[i, : r.numel()] = r, True
    return anchors.to(candidates.device), valid.to(candidates.device)


def block_mask(anchors: Tensor, doc: Tensor, block: int) -> Tensor:
    """bool ``[B, 1, A*Bk, T + A*Bk]``: block row (anchor a, slot j) sees context index t iff
    ``t < a`` in a's document, and every row of its own block."""
    b, a = anchors.shape
    t = doc.shape[1]
    idx = torch.arange(t, device=doc.device)  # [T]
    anchor_doc = doc.gather(1, anchors)  # [B, A]
    ctx = (idx[None, None, :] < anchors[:, :, None]) & (doc[:, None, :] == anchor_doc[:, :, None])
    ctx = ctx[:, :, None, :].expand(b, a, block, t).reshape(b, a * block, t)  # [B, A*Bk, T]
    own = torch.arange(a, device=doc.device).repeat_interleave(block)  # [A*Bk]
    blk = (own[:, None] == own[None, :]).expand(b, -1, -1)  # [B, A*Bk, A*Bk]
    return torch.cat([ctx, blk], dim=-1)[:, None]


def slot_targets(anchors: Tensor, valid: Tensor, loss_mask: Tensor, doc: Tensor,
                 block: int) -> tuple[Tensor, Tensor]:
    """For slots 1 .. Bk-1: the index whose target state predicts x_{a+j} (``a + j - 1``,
    clamped into the row) ``[B, A, Bk-1]`` and where slot j trains (bool, same shape)."""
    t = doc.shape[1]
    j = torch.arange(1, block, device=anchors.device)  # [Bk-1]
    tok = anchors[:, :, None] + j  # [B, A, Bk-1]: the predicted token's index
    inside = tok < t
    tok_c = tok.clamp(max=t - 1)
    flat = tok_c.flatten(1)  # [B, A*(Bk-1)]
    same_doc = doc.gather(1, flat).view_as(tok) == doc.gather(1, anchors)[:, :, None]
    trains = valid[:, :, None] & inside & same_doc & loss_mask.gather(1, flat).view_as(tok)
    return tok_c - 1, trains


def _aux_ids(d, target, init_ids: list[int] | None) -> list[int]:
    """``drafter.aux_layer_ids`` (negative: from the end), else ``init_from``'s, else the
    default spread; distinct and in ``[0, n]``."""
    ids = (from_end(d.aux_layer_ids or [], target.num_layers) or init_ids
           or default_aux_layer_ids(target.num_layers, d.num_layers))
    if len(set(ids)) != len(ids) or any(not 0 <= k <= target.num_layers for k in ids):
        raise config_error("drafter.aux_layer_ids", d.aux_layer_ids or ids, "distinct ids in "
                           f"[0, {target.num_layers}] (k = residual stream after k layers, -1 = "
                           f"{target.num_layers})", _WHERE)
    return ids


@OBJECTIVES.register("dflash")
class DFlashObjective(Objective):
    """DFlash block drafter + same-position block loss (module doc)."""

    DRAFTER = DFlashDrafter  # DSpark's objective trains its subclass

    @staticmethod
    def head_settings(cfg: TrainConfig) -> dict:
        """Config keys the drafter class adds to DFlash's (DSpark's heads); none here."""
        return {}

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        d, o, target = cfg.drafter, cfg.objective, heads.config
        init = self.DRAFTER.from_pretrained(d.init_from) if d.init_from else None
        ids = _aux_ids(d, target, list(init.aux_layer_ids) if init is not None else None)
        mask = choose_mask_token(d.mask_token_id, {"mask_token_id": init.config.mask_token_id}
                                 if init is not None else {}, vocab, target)
        config = self.DRAFTER.CONFIG.for_target(
            target, num_layers=d.num_layers, mask_token_id=mask, block_size=o.block_size,
            aux_layer_ids=sorted(ids), draft_vocab_size=vocab.draft_vocab_size,
            intermediate_size=d.intermediate_size,
            verifier_name_or_path=verifier_name(cfg.target.path, self.target_dir),
            **self.head_settings(cfg))
        self.block, self.max_anchors, self.gamma = o.block_size, o.max_anchors, o.decay_gamma
        self.drafter = self.DRAFTER(config, with_embedding=bool(d.embed_requires_grad))
        self.drafter.share_target(heads.embed_tokens, heads.lm_head)
        self.drafter.set_vocab(vocab.target_ids())
        with torch.no_grad():
            if self.drafter.lm_head is not None:  # draft vocabulary: the target's rows
                rows = vocab.target_ids().to(heads.lm_head.weight.device)
                self.drafter.lm_head.weight.copy_(heads.lm_head.weight[rows])
            if self.drafter.embed_tokens is not None:
                self.drafter.embed_tokens.weight.copy_(heads.embed_tokens.weight)
        if init is not None:
            load_init(self.drafter, init, d.init_from)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=self.drafter.aux_layer_ids, hidden=True,
                           greedy=True)

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        d, init = cfg.drafter, None
        if d.init_from and not d.aux_layer_ids:  # its config.json only, no weights
            path = resolve_model_dir(d.init_from, "drafter.init_from") / "config.json"
            init = cls.DRAFTER.CONFIG.from_dict(read_json(path)).aux_layer_ids
        return FeatureSpec(aux_layer_ids=tuple(sorted(_aux_ids(d, target, init))), hidden=True,
                           greedy=True)

    # ---- forward -----------------------------------------------------------------------------

    def block_hidden(self, batch: dict[str, Tensor], anchors: Tensor) -> Tensor:
        """Normed hidden states of slots 1 .. Bk-1 of the blocks at ``anchors [B, A]``:
        ``[B, A, Bk-1, H]`` (the same computation the proposer runs, batched)."""
        ids, pos, doc = batch["input_ids"], batch["position_ids"], batch["doc_ids"]  # [B, T]
        aux = batch["aux"]  # [B, T, n_t * H_t]
        want = self.drafter.fc.in_features
        if aux.shape[-1] != want:
            raise ValueError(f"batch['aux'] has width {aux.shape[-1]}; the dflash drafter "
                             f"expects {want} (aux layers {list(self.drafter.aux_layer_ids)})")
        b, a, bk = *anchors.shape, self.block
        kv = ContextKV(self.drafter.context_kv(self.drafter.context(aux), pos))
        block_ids = torch.full((b, a, bk), self.drafter.config.mask_token_id,
                               dtype=torch.long, device=ids.device)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        offsets = torch.arange(bk, device=ids.device)
        block_pos = pos.gather(1, anchors)[:, :, None] + offsets  # [B, A, Bk]
        mask = block_mask(anchors, doc, bk)  # [B, 1, A*Bk, T + A*Bk]
        h = self.drafter.block_forward(block_ids.view(b, a * bk), block_pos.view(b, a * bk),
                                       mask, kv)  # [B, A*Bk, H]
        return h.view(b, a, bk, -1)[:, :, 1:]  # [B, A, Bk-1, H]

    def slot_logits(self, h: Tensor, ids: Tensor, at: Tensor) -> Tensor:
        """Slot logits ``[B, A, Bk-1, Vd]`` from their hidden states ``h``; ``ids [B, T]`` and
        ``at [B, A, Bk-1]`` (the index before each predicted token) for what DSpark adds."""
        return self.drafter.logits(h)

    def extra_loss(self, h: Tensor, logits: Tensor, target: Tensor, ids: Tensor, at: Tensor,
                   trains: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """A loss term beside the distillation and its metrics (DSpark's confidence head);
        none here. ``target``: the target's log-probabilities per slot ``[B, A, Bk-1, Vd]``."""
        return logits.new_zeros(()), {}

    def targets(self, hidden: Tensor) -> Tensor:
        """The target's log-probabilities over the draft vocabulary at every index,
        ``[B, T, Vd]`` (fp32); its full-vocabulary argmax comes with the features (greedy)."""
        head = self.heads.lm_head
        rows = self.drafter.to_target_ids(torch.arange(self.drafter.config.draft_vocab_size,
                                                       device=head.weight.device))
        bias = head.bias[rows] if head.bias is not None else None
        logits = F.linear(hidden.to(head.weight.dtype), head.weight[rows], bias).float()
        return F.log_softmax(logits, dim=-1)  # [B, T, Vd]

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        loss_mask, doc = batch["loss_mask"].bool(), batch["doc_ids"]
        anchors, valid = sample_anchors(anchor_candidates(loss_mask, doc), self.max_anchors,
                                        random=self.training)
        at, trains = slot_targets(anchors, valid, loss_mask, doc, self.block)  # [B, A, Bk-1]
        h = self.block_hidden(batch, anchors)  # [B, A, Bk-1, H]
        logits = self.slot_logits(h, batch["input_ids"], at)  # [B, A, Bk-1, Vd]
        logp, argmax = self.targets(batch["hidden"]), batch["greedy"]  # [B, T, Vd], [B, T]
        b, a, s = at.shape
        flat = at.view(b, a * s)
        target = logp.gather(1, flat[..., None].expand(-1, -1, logp.shape[-1])).view(b, a, s, -1)
        kl = self.distill(logits, target)  # [B, A, Bk-1]
        right = self.drafter.to_target_ids(logits.argmax(-1)) == argmax.gather(1, flat).view_as(at)
        w = torch.exp(-torch.arange(s, device=kl.device, dtype=torch.float32) / self.gamma)
        wt = trains.float() * w  # [B, A, Bk-1]
        extra, extra_metrics = self.extra_loss(h, logits, target, batch["input_ids"], at, trains)
        loss = (kl * wt).sum() / wt.sum().clamp(min=1e-6) + extra
        return LossOutput(loss, {**slot_metrics(kl, right, trains), **extra_metrics},
                          trains[..., 0].sum())

    # ---- export ------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """The speculators DFlash checkpoint (``config.json`` + ``model.safetensors``)."""
        state = self.drafter_state(state_dict)
        check_tensors(path, self.drafter.state_dict(), state)
        return write_checkpoint(path, self.drafter.config.to_dict(), state)

    def speculative_config(self, path: str | Path, k: int) -> dict:
        return {**self.served_config(path), "num_speculative_tokens": min(k, self.block - 1)}


def load_init(drafter: DFlashDrafter, init: DFlashDrafter, path: str) -> None:
    """Start from an exported DFlash checkpoint (``drafter.init_from``) of the same shape; the
    draft vocabulary must be the same too (no row matching as EAGLE-3 does)."""
    own, src = drafter.state_dict(), init.state_dict()
    if set(src) - set(own) or any(src[k].shape != own[k].shape for k in src):
        raise config_error("drafter.init_from", path, "a dflash checkpoint shaped like this "
                           f"drafter (its tensors: {sorted(src)[:6]} ...)", _WHERE)
    drafter.load_state_dict(src, strict=False)


def slot_metrics(kl: Tensor, right: Tensor, trains: Tensor) -> dict[str, Tensor]:
    """Per-slot loss / accuracy, chained accuracy and the acceptance-length estimate from
    ``kl, right, trains [B, A, Bk-1]`` (module doc; detached, no host sync)."""
    metrics: dict[str, Tensor] = {}
    chain_ok = torch.cumprod((right & trains).int(), dim=-1).bool()  # slots 1 .. j all right
    chain_valid = torch.cumprod(trains.int(), dim=-1).bool()  # slots 1 .. j all train
    est, run = torch.ones((), device=kl.device), torch.ones((), device=kl.device)
    for i in range(kl.shape[-1]):
        n = trains[..., i].sum().clamp(min=1)
        acc = (right[..., i] & trains[..., i]).sum() / n
        metrics[f"loss/slot_{i}"] = ((kl[..., i] * trains[..., i]).sum() / n).detach()
        metrics[f"acc_{i}"] = acc.detach()
        metrics[f"full_acc_{i}"] = (chain_ok[..., i].sum()
                                    / chain_valid[..., i].sum().clamp(min=1)).detach()
        run = run * acc.detach()
        est = est + run
    metrics["acceptance_length_est"] = est
    metrics["eal"] = est - 1  # this estimate is the product form already
    return metrics


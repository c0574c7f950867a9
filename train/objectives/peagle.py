"""P-EAGLE objective (docs/reference.md §11): an EAGLE-3 head plus ``mask_hidden`` trained so that
one forward over ``[catch-up pairs, MASK x (K - 1)]`` gives K drafts (``infer/proposers/peagle.py``).

Layout: PARD's k-copy layout (``train/objectives/pard.py::copy_layout``) over EAGLE-3's shifted
data, with ``K = objective.parallel_depths`` copies ("depths")::

    depth 0, index t:      pair (g_t, x_{t+1})             at position_ids[t]
    depth d, index a + d:  (prepare(mask_hidden), MASK)    at position_ids[a] + d   (anchor a)
    every row at index i:  target = the target's distribution at i + 1 (predicts x_{i+2})

A depth-d row of anchor ``a`` sees the depth-0 rows ``<= a`` of its document and its own chain's
rows of depths ``1 .. d`` (``copy_layout``'s diagonal): exactly the keys causal attention gives
mask row ``d`` at inference, where the chain's real context ends with the pair at ``a``.
Rows train where ``x_{i+2}`` is a loss token of the anchor's document.

Conditional drop-token (training mode only): depth ``d >= 1`` keeps
``int((n - d) * max(cod_ratio ** d, cod_min))`` positions (``n``: positions with a loss target
in some row of the micro-batch), at most ``objective.max_anchors``, drawn among the successors
of the previous depth's kept positions (``cod_selection(eligible=..., max_keep=...)``, contiguous
chains, as speculators samples). Eval mode keeps every chain.

Loss: forward KL against the target's distribution over the draft vocabulary (EAGLE-3's
``targets``), the mean over every trained row (no per-depth decay). COD leaves depth 0 about a
third of the rows, and so of the weight: averaging each depth first and then the depths (each
depth pulling equally) gave depth 0 an eighth at 8 depths and cost it, on the tiny target, 0.58
-> 0.51 first-position acceptance and AL 1.93 -> 1.71 at k=3 (docs/benchmarks-history.md). Metrics: ``loss/depth_d``, ``acc_d``, ``full_acc_d`` (drafts
``1 .. d + 1`` of one anchor all right) and ``acceptance_length_est`` (``chain_accuracy``).

Settings: EAGLE-3's drafter keys (aux ids, norms, ``lm_head_init``), ``drafter.mask_token_id``
(None: ``choose_mask_token``, an id never seen as a target), ``drafter.init_from`` (an eagle3 or
peagle export); ``objective.parallel_depths``, ``cod_ratio``, ``cod_min``, ``max_anchors``,
``feature_noise``. The embedding is always the drafter's own (copied from the target, trained,
shipped): the mask token's row must be learned, so P-EAGLE has no ``embed_requires_grad``.
Export: the speculators peagle checkpoint (``infer/drafters/peagle.py``) with
``speculative_tokens`` = ``parallel_depths``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from infer.drafters.common import token_map_entry
from infer.drafters.eagle3 import Eagle3Drafter
from infer.drafters.peagle import PEagleConfig, PEagleDrafter
from infer.foundation.files import read_json
from infer.models.loader import resolve_model_dir
from infer.draft_config import checkpoint_type
from train.objectives.base import OBJECTIVES, FeatureSpec, LossOutput
from train.objectives.eagle3 import (Eagle3Objective, init_aux_layer_ids, load_init,
                                     resolve_aux_layer_ids)
from train.objectives.losses import masked_mean
from train.objectives.pard import chain_accuracy, choose_mask_token, cod_selection, copy_layout
from train.objectives.ttt import shift_left

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab


@dataclass
class PEagleRows:
    """One micro-batch laid out for the head; ``N`` = kept rows over all depths."""

    input_ids: Tensor  # int64 [B, N]: x_{t+1} at depth 0, MASK elsewhere
    position_ids: Tensor  # int64 [B, N]: position_ids[anchor] + depth
    attention_mask: Tensor  # bool [B, 1, N, N]
    target_index: Tensor  # int64 [N]: where the target distribution is read (index + 1)
    valid: Tensor  # bool [B, N]
    depth: Tensor  # int64 [N]
    index: Tensor  # int64 [N]


def peagle_rows(batch: dict[str, Tensor], k: int, mask_id: int,
                keep: list[Tensor] | None = None) -> PEagleRows:
    """The depth layout of ``batch`` (``input_ids``, ``position_ids``, ``doc_ids``,
    ``loss_mask`` ``[B, T]``) restricted to ``keep`` (indices per depth; None = all)."""
    ids, pos, doc = batch["input_ids"], batch["position_ids"], batch["doc_ids"]  # [B, T]
    t = ids.shape[1]
    keep = keep if keep is not None else [torch.arange(d, t) for d in range(k)]
    if len(keep) != k:
        raise ValueError(f"peagle_rows: keep has {len(keep)} depths, expected k={k}")
    depth, index, mask = copy_layout(keep, doc)  # [N], [N], [B, 1, N, N]
    anchor = (index - depth).clamp(min=0)  # [N]
    goal = (index + 2).clamp(max=t - 1)  # [N]: the token the row predicts
    valid = ((index + 2 < t) & (index >= depth) & batch["loss_mask"].bool()[:, goal]
             & (doc[:, goal] == doc[:, anchor]))  # [B, N]
    real = shift_left(ids, 1)[:, index]  # [B, N]
    inputs = torch.where(depth == 0, real, torch.full_like(real, mask_id))
    return PEagleRows(inputs, pos[:, anchor] + depth, mask, (index + 1).clamp(max=t - 1),
                      valid, depth, index)


@OBJECTIVES.register("peagle")
class PEagleObjective(Eagle3Objective):
    """EAGLE-3's head construction, targets and export; its own one-forward layout and loss."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        d, o = cfg.drafter, cfg.objective
        init, init_mask = load_peagle_init(d.init_from)
        ids = d.aux_layer_ids
        if ids is None and init is not None:
            ids = init.config.eagle_aux_hidden_state_layer_ids
        # EAGLE-3's init without init_from (applied below, mask_hidden aside), own embedding
        base_cfg = dataclasses.replace(cfg, drafter=d.as_eagle3(
            init_from=None, aux_layer_ids=ids, embed_requires_grad=True), objective=o.as_eagle3())
        super().__init__(base_cfg, heads, vocab, target_dir)
        self.cfg = cfg
        self.depths = int(o.parallel_depths)
        if init is not None:
            load_init(self.drafter, init, d.init_from)
        source = {"mask_token_id": init_mask[1]} if init_mask is not None else {}
        mask_id = choose_mask_token(d.mask_token_id, source, vocab, heads.config)
        base = self.drafter
        config = PEagleConfig(**{f.name: getattr(base.config, f.name)
                                 for f in dataclasses.fields(base.config)},
                              mask_token_id=mask_id)
        config.speculative_tokens = self.depths
        self.drafter = PEagleDrafter(config, with_embedding=True)
        missing, _ = self.drafter.load_state_dict(base.state_dict(), strict=False)
        if missing != ["mask_hidden"]:  # the head is EAGLE-3's plus mask_hidden, nothing else
            raise RuntimeError(f"P-EAGLE head built from the EAGLE-3 head lacks {missing}")
        if init_mask is not None:
            with torch.no_grad():
                self.drafter.mask_hidden.copy_(init_mask[0].view_as(self.drafter.mask_hidden))

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        ids = cfg.drafter.aux_layer_ids  # as __init__: the configured ids win over init_from's
        if ids is None:
            ids = init_aux_layer_ids(cfg.drafter.init_from)
        return FeatureSpec(tuple(resolve_aux_layer_ids(ids, target.num_layers)),
                           hidden=True, greedy=True)

    @classmethod
    def served_config(cls, path: str | Path) -> dict:
        return {"method": "eagle3", "model": str(path), "parallel_drafting": True,
                **token_map_entry(path)}

    def rows(self, batch: dict[str, Tensor], keep: list[Tensor] | None = None
             ) -> tuple[PEagleRows, Tensor]:
        """The head over the depth layout: ``(PEagleRows, logits [B, N, Vd])``."""
        r = peagle_rows(batch, self.depths, self.drafter.config.mask_token_id, keep)
        g = self.features(batch)  # [B, T, H]
        mask_g = self.drafter.mask_features().to(g.dtype)  # [1, 1, H]
        hidden = torch.where((r.depth == 0)[None, :, None], g[:, r.index], mask_g)  # [B, N, H]
        logits, _ = self.drafter.forward_train(r.input_ids, hidden, r.position_ids,
                                               r.attention_mask)
        return r, logits

    def selection(self, batch: dict[str, Tensor]) -> list[Tensor] | None:
        """COD in training mode (module doc); None (every chain) in eval mode. One small
        device-to-host copy per micro-batch: which positions have a loss target."""
        if not self.training:
            return None
        o, loss_mask = self.cfg.objective, batch["loss_mask"].bool()  # [B, T]
        t = loss_mask.shape[1]
        eligible = torch.zeros(t, dtype=torch.bool)
        eligible[: max(t - 2, 0)] = loss_mask[:, 2:].any(0).cpu()  # row i predicts x_{i+2}
        return cod_selection(t, self.depths, o.cod_ratio, o.cod_min, eligible=eligible,
                             max_keep=int(o.max_anchors))

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        t = batch["input_ids"].shape[1]
        with torch.no_grad():
            targets = self.distributions(batch["hidden"], batch["greedy"])  # [B, T, ...]
        r, logits = self.rows(batch, self.selection(batch))  # [B, N, Vd]
        kl = self.distill(logits, targets["logp"][:, r.target_index])  # [B, N]
        loss = masked_mean(kl, r.valid)  # every trained row once (module doc)
        with torch.no_grad():
            proposed = self.drafter.to_target_ids(logits.argmax(-1))  # [B, N]
            right = proposed == targets["argmax"][:, r.target_index]
            metrics = chain_accuracy(r.depth, r.index, r.valid, right, kl.detach(),
                                     self.depths, t, label="depth")
        return LossOutput(loss, metrics, (r.valid & (r.depth == 0)).sum())


def load_peagle_init(path: str | None) -> tuple[Eagle3Drafter | None,
                                                 tuple[Tensor, int] | None]:
    """``drafter.init_from``: an eagle3 export (mask state fresh) or a peagle one, as
    ``(EAGLE-3 view of the head, (mask_hidden, mask_token_id) or None)``."""
    if not path:
        return None, None
    raw = read_json(resolve_model_dir(path) / "config.json", what="drafter.init_from config")
    if checkpoint_type(raw) != "peagle":
        return Eagle3Drafter.from_pretrained(path), None
    head = PEagleDrafter.from_pretrained(path)
    return head.as_eagle3(), (head.mask_hidden.detach().clone(), head.config.mask_token_id)

"""PARD objective (docs/reference.md §6): adapt a small causal LM into a parallel drafter.

Serving feeds ``[context..., last token, MASK x (k-1)]`` and reads k drafts off the last k
logits. Training teaches every mask count at once: each packed row (``T`` tokens) is repeated
``k = objective.pard_k`` times, copy 0 holding the real tokens and copies ``1..k-1`` only MASK,
with the position ids repeated per copy. Query ``(copy j, index t)`` sees

* copy 0 (real tokens) at indices ``<= t - j``, and
* copies ``j' = 1..j`` on its own diagonal, index ``t - j + j'`` (itself included),

all within its document, and predicts token ``t + 1``: the last real token it sees is
``t - j``, so it is draft ``j + 1`` — exactly the layout of the serving input, where mask ``j'``
sits at index ``t - j + j'`` with that index's position id. It is trained where
``loss_mask[t + 1]``, ``t + 1`` in the document of ``t`` and ``t - j`` not before the document
start (at least one real token of context, as in serving).

Conditional drop-token (COD): copy ``i`` keeps ``int(T * max(cod_ratio ** i, cod_min))``
positions (fewer only if its predecessor has fewer successors inside the row), drawn uniformly among those whose predecessor on the diagonal (copy ``i - 1`` at
index ``t - 1``) was kept; copy 0 keeps all. Dropped positions are cut out of the sequence (the
kept indices are gathered and the mask restricted to them), so a kept query still sees every key
it would see without dropping (its diagonal chain is kept by construction). With k = 8 the
sequence holds ``sum_i max(0.7^i, 0.2) ~ 3.4`` copies' worth of positions instead of 8 (and the
attention, quadratic in length, shrinks more: the paper's ~3x). The selection is shared by the rows of a
micro-batch (one rectangular sequence) and applied only in training mode; in eval mode all
positions are kept.

Conventions checked against AMD's PARD training code (``pard/pard_train.py``): the same mask,
position ids and COD (counts relative to ``T``, nested via the predecessor at ``t - 1``), one
token-mean CE over all copies. Deliberate differences: PARD also trains copy ``j`` at ``t = j - 1``
(no real context at all, and its diagonal wraps into the previous copy); here such positions
are not trained and nothing wraps. Documents of a packed row never see each other here.

Mask token: ``drafter.mask_token_id``; else a ``pard_token`` / ``mask_token_id`` /
``ptd_token_id`` already in the draft's config.json (a PARD checkpoint being trained further);
else the highest token id never seen as a training target (``DraftVocab.counts == 0``) that is
not a special (eos / bos / pad) id. Real vocabularies keep their unused reserved tokens at the
top (Llama-3's ``<|reserved_special_token_*|>``, Qwen's padded rows), which is what PARD uses;
the mask's embedding is trained with the rest of the draft. Written to the export as
``pard_token`` (what vLLM and draftsmith's draft_model proposer read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.common import write_checkpoint
from infer.foundation.files import TOKENIZER_FILES
from infer.models.loader import load_config, load_model, resolve_dtype
from infer.proposers.draft_model import MASK_KEYS
from infer.foundation.validation import config_error
from train.config import validate_section
from train.objectives.base import OBJECTIVES, FeatureSpec, LossOutput, Objective
from train.objectives.losses import expected_acceptance, masked_mean

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab

_WHERE = "train config"


# ---- the repeated sequence ---------------------------------------------------------------------

def cod_selection(t: int, k: int, ratio: float = 1.0, minimum: float = 1.0,
                  generator: torch.Generator | None = None, *, eligible: Tensor | None = None,
                  max_keep: int | None = None) -> list[Tensor]:
    """Kept indices per copy (sorted int64 ``[n_i]``; see the module doc). ``ratio = minimum = 1``
    keeps every position that has a kept predecessor (copy i: indices ``i .. T-1``).

    P-EAGLE's variant (speculators' rule): ``eligible`` (bool ``[T]``, CPU) restricts copies
    ``>= 1`` to those positions (the ones with a loss target) and counts relative to them,
    ``int((n_eligible - i) * fraction)``; ``max_keep`` caps every copy ``>= 1`` (max anchors).
    """
    kept = [torch.arange(t)]
    n_eligible = int(eligible.sum()) if eligible is not None else None
    for i in range(1, k):
        cand = kept[-1] + 1  # successors on the diagonal of the previous copy's kept positions
        cand = cand[cand < t]
        base = t
        if eligible is not None:
            cand, base = cand[eligible[cand]], max(n_eligible - i, 0)
        n = min(int(base * max(ratio ** i, minimum)), cand.numel())
        if max_keep is not None:
            n = min(n, max_keep)
        pick = cand[torch.randperm(cand.numel(), generator=generator)[:n]]
        kept.append(pick.sort().values)
    return kept


def copy_layout(keep: list[Tensor], doc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The k-copy layout shared by PARD and P-EAGLE: kept indices per copy (``keep[j]``,
    sorted ``[n_j]``) and ``doc [B, T]`` -> ``copy [N]``, ``index [N]`` (on ``doc``'s device)
    and the attention mask bool ``[B, 1, N, N]`` (True = may attend).

    Query ``(copy j, index t)`` (anchor ``t - j``) sees copy 0 at indices ``<= t - j`` and
    copies ``1 .. j`` on its own diagonal (copy ``j'`` at ``t - j + j'``), within its document:
    PARD's masks after the real context, P-EAGLE's depth-``j`` chain after anchor ``t - j``.
    """
    device = doc.device
    copy = torch.cat([torch.full((len(x),), c, dtype=torch.long) for c, x in enumerate(keep)])
    index = torch.cat(list(keep)).long()
    copy, index = copy.to(device), index.to(device)  # [N], [N]
    qc, qt, kc, ks = copy[:, None], index[:, None], copy[None, :], index[None, :]
    visible = (((kc == 0) & (ks <= qt - qc))  # real tokens up to t - j
               | ((kc >= 1) & (kc <= qc) & (ks == qt - qc + kc)))  # masks on the diagonal
    d = doc[:, index]  # [B, N]
    mask = visible & (d[:, :, None] == d[:, None, :])  # [B, N, N]
    return copy, index, mask[:, None]


@dataclass
class PardBatch:
    """One micro-batch laid out for the drafter; ``N`` = kept positions over all copies."""

    input_ids: Tensor  # int64 [B, N]: real tokens in copy 0, MASK elsewhere
    position_ids: Tensor  # int64 [B, N]: the row's position id at each index
    attention_mask: Tensor  # bool [B, 1, N, N], True = may attend
    targets: Tensor  # int64 [B, N]: token index + 1 (0 where there is none)
    valid: Tensor  # bool [B, N]: trained positions
    copy: Tensor  # int64 [N]: copy of each position
    index: Tensor  # int64 [N]: index in the row of each position


def pard_batch(batch: dict[str, Tensor], k: int, mask_id: int,
               keep: list[Tensor] | None = None) -> PardBatch:
    """The k-copy sequence of ``batch`` (``input_ids``, ``position_ids``, ``doc_ids``,
    ``loss_mask`` ``[B, T]``) restricted to ``keep`` (indices per copy; None = all)."""
    ids, doc = batch["input_ids"], batch["doc_ids"]  # [B, T]
    t = ids.shape[1]
    keep = keep if keep is not None else [torch.arange(t)] * k
    if len(keep) != k:
        raise ValueError(f"pard_batch: keep has {len(keep)} copies, expected k={k}")
    copy, index, mask = copy_layout(keep, doc)  # [N], [N], [B, 1, N, N]
    d = doc[:, index]  # [B, N]
    nxt = (index + 1).clamp(max=t - 1)  # [N]
    anchor = index - copy  # [N]: the last real token the query sees
    valid = ((index + 1 < t) & (anchor >= 0) & batch["loss_mask"].bool()[:, nxt]
             & (doc[:, nxt] == d) & (doc[:, anchor.clamp(min=0)] == d))  # [B, N]
    inputs = torch.where(copy == 0, ids[:, index], torch.full_like(ids[:, index], mask_id))
    return PardBatch(inputs, batch["position_ids"][:, index], mask,
                     torch.where(index + 1 < t, ids[:, nxt], 0), valid, copy, index)


# ---- the objective -----------------------------------------------------------------------------

@OBJECTIVES.register("pard")
class PardObjective(Objective):
    """Trains a draft causal LM (``drafter.model``, or ``drafter.init_from``: an exported PARD
    directory) as a parallel drafter; see the module doc. ``objective.pard_k``, ``cod_ratio``,
    ``cod_min``, ``kd_weight`` (KL to the target's next-token distribution, on top of the CE)."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        o = cfg.objective
        validate_section("objective", o)  # pard_k, cod_ratio, cod_min, kd_weight ...
        self.k, self.kd_weight = o.pard_k, float(o.kd_weight)
        self.source_dir = resolve_draft_dir(cfg.drafter.init_from or cfg.drafter.model,
                                            "drafter.init_from" if cfg.drafter.init_from
                                            else "drafter.model", target_dir)
        self.source_config = json.loads((self.source_dir / "config.json").read_text())
        draft_vocab = load_config(self.source_dir).vocab_size  # checked before loading weights
        if draft_vocab != heads.config.vocab_size:
            raise config_error("drafter.model", str(self.source_dir),
                               f"a causal LM with the target's vocab_size "
                               f"({heads.config.vocab_size}, same tokenizer); its vocab_size is "
                               f"{draft_vocab}", _WHERE)
        self.drafter = load_model(self.source_dir, dtype=torch.float32, fuse=False
                                  ).requires_grad_(True).train()
        self.mask_token_id = choose_mask_token(cfg.drafter.mask_token_id, self.source_config,
                                               vocab, heads.config)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=self.kd_weight > 0)

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        return FeatureSpec(hidden=float(cfg.objective.kd_weight) > 0)

    @classmethod
    def served_config(cls, path: str | Path) -> dict:
        return {"method": "draft_model", "model": str(path), "parallel_drafting": True}

    def draft_logits(self, batch: dict[str, Tensor], keep: list[Tensor] | None = None
                     ) -> tuple[PardBatch, Tensor]:
        """The drafter over the k-copy layout: ``(PardBatch, logits [B, N, V])``."""
        pb = pard_batch(batch, self.k, self.mask_token_id, keep)
        cfg = self.drafter.config
        if cfg.sliding_layers and pb.index.numel() > cfg.sliding_window:
            raise ValueError(f"pard: the draft's sliding_window ({cfg.sliding_window}) is shorter "
                             f"than the {pb.index.numel()}-token training layout (k copies); "
                             "lower data.max_length or objective.pard_k")
        out = self.drafter.forward_train(pb.input_ids, pb.position_ids, pb.attention_mask)
        return pb, out.logits

    def forward(self, batch: dict[str, Tensor]) -> LossOutput:
        t = batch["input_ids"].shape[1]
        o = self.cfg.objective
        keep = (cod_selection(t, self.k, o.cod_ratio, o.cod_min) if self.training
                else cod_selection(t, self.k))
        pb, logits = self.draft_logits(batch, keep)  # [B, N, V]
        count = pb.valid.sum()
        ce = F.cross_entropy(logits.float().flatten(0, 1), pb.targets.flatten(),
                             reduction="none").view_as(pb.targets)  # [B, N]
        ce_loss = masked_mean(ce, pb.valid)
        loss, metrics = ce_loss, {"loss/ce": ce_loss.detach()}
        if self.kd_weight > 0:
            kd = self._kd(batch["hidden"], pb, logits)  # [B, N]
            kd_loss = masked_mean(kd, pb.valid)
            metrics["loss/kd"] = kd_loss.detach()
            loss = loss + self.kd_weight * kd_loss
        with torch.no_grad():
            metrics.update(chain_accuracy(pb.copy, pb.index, pb.valid,
                                          logits.argmax(dim=-1) == pb.targets,
                                          ce.detach(), self.k, t))
        return LossOutput(loss, metrics, count)

    def _kd(self, hidden: Tensor, pb: PardBatch, logits: Tensor) -> Tensor:
        """``objective.loss`` (default KL(target || draft)) per position ``[B, N]``; the
        target's distribution for token ``t + 1`` is ``lm_head(hidden_t)``."""
        lm = self.heads.lm_head
        with torch.no_grad():
            h = hidden[:, pb.index]  # [B, N, H]
            target_logp = F.log_softmax(lm(h.to(lm.weight.dtype)).float(), dim=-1)  # [B, N, V]
        return self.distill(logits, target_logp)

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """A Hugging Face causal-LM directory: the draft's config.json with ``pard_token``,
        ``model.safetensors`` under HF names (in the draft's original dtype), its tokenizer and
        generation config. Loads with transformers' AutoModelForCausalLM and, as
        ``served_config(path)``, in draftsmith's engine / vLLM. Written atomically."""
        state = self.drafter_state(state_dict)
        hf_config = {**self.source_config, "pard_token": self.mask_token_id}
        dtype = resolve_dtype("auto", self.source_config)
        tied = bool(self.source_config.get("tie_word_embeddings", False))
        tensors = {hf_name(n): (v.to(dtype) if v.is_floating_point() else v)
                   for n, v in state.items() if not (tied and n == "lm_head.weight")}
        extra = [self.source_dir / f for f in ("generation_config.json",)]
        has_tokenizer = any((self.source_dir / f).is_file()
                            for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
        tok_dir = self.source_dir if has_tokenizer else Path(self.target_dir)
        extra += [tok_dir / f for f in TOKENIZER_FILES]
        return write_checkpoint(path, hf_config, tensors, [f for f in extra if f.is_file()])


# ---- helpers -----------------------------------------------------------------------------------

def hf_name(native: str) -> str:
    """Native weight name -> Hugging Face's (inverse of ``infer.models.loader.native_name``)."""
    return native if native.startswith("lm_head.") else f"model.{native}"


def chain_accuracy(copy: Tensor, index: Tensor, valid: Tensor, right: Tensor, loss: Tensor,
                   k: int, t: int, label: str = "copy") -> dict[str, Tensor]:
    """Metrics of a k-copy layout (:func:`copy_layout`): ``loss/{label}_j`` and ``acc_j`` per
    copy, ``full_acc_j`` (drafts 1..j+1 all right from the same anchor: copy j' at
    ``t - j + j'``) and ``acceptance_length_est = 1 + sum_j full_acc_j``. ``copy``/``index``
    ``[N]``; ``valid``/``right`` bool and ``loss`` ``[B, N]``. Dense index arithmetic only (no
    boolean indexing): no host sync. Shared by PARD and P-EAGLE."""
    b = right.shape[0]
    dense = right.new_zeros(k, b, t)  # [k, B, T]; dropped positions count as wrong
    dense[copy, :, index] = right.T
    for j in range(1, k):  # chain: copy j at t needs copy j-1 at t - 1 right
        dense[j] &= F.pad(dense[j - 1], (1, 0))[:, :t]
    full = dense[copy, :, index].T  # [B, N]
    per_copy = valid[:, :, None] & F.one_hot(copy, k).bool()  # [B, N, k]
    count = per_copy.sum((0, 1)).clamp(min=1)  # [k]
    mean_loss = (loss[:, :, None] * per_copy).sum((0, 1)) / count  # [k]
    acc = (right[:, :, None] & per_copy).sum((0, 1)) / count
    full_acc = (full[:, :, None] & per_copy).sum((0, 1)) / count
    out = {}
    for j in range(k):
        out[f"loss/{label}_{j}"], out[f"acc_{j}"] = mean_loss[j], acc[j]
        out[f"full_acc_{j}"] = full_acc[j]
    out["acceptance_length_est"] = 1 + full_acc.sum()
    out["eal"] = expected_acceptance(acc)
    return out


def resolve_draft_dir(model: str | None, key: str, target_dir: str | Path) -> Path:
    """The draft LM directory: a local dir, a hub id (downloaded), or None = the embedded tiny
    draft, which exists only beside the embedded tiny target (it shares that tokenizer)."""
    if model:
        if Path(model).expanduser().is_dir():
            return Path(model).expanduser()
        from train.pipeline import download

        return Path(download(model, key))
    from train.tiny.corpus import default_target_dir, paired_draft_dir

    target = Path(target_dir).expanduser().resolve()
    if target == default_target_dir().expanduser().resolve():
        from train.tiny.build import ensure_tiny_draft

        return Path(ensure_tiny_draft())
    paired = paired_draft_dir(target)
    if (paired / "config.json").is_file():
        return paired
    raise config_error(key, None, f"a draft causal LM sharing the tokenizer of {target_dir} (the "
                       "embedded tiny draft pairs only with the embedded tiny target, and no "
                       f"{paired} exists)", _WHERE)


def choose_mask_token(configured: int | None, draft_config: dict, vocab, target_cfg) -> int:
    """The mask token id (see the module doc for the order of choices)."""
    size = target_cfg.vocab_size
    if configured is not None:
        if isinstance(configured, bool) or not isinstance(configured, int) \
                or not 0 <= configured < size:
            raise config_error("drafter.mask_token_id", configured,
                               f"a token id in [0, {size})", _WHERE)
        return configured
    for key in MASK_KEYS:
        value = draft_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size:
            return value
    special = set(target_cfg.eos_token_ids) | {target_cfg.bos_token_id, target_cfg.pad_token_id}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = draft_config.get(key)
        special |= set(value) if isinstance(value, list) else {value}
    counts = vocab.counts[:size]  # [V]: loss-masked occurrences
    unseen = [i for i in (counts == 0).nonzero().flatten().tolist() if i not in special]
    if not unseen:
        raise config_error("drafter.mask_token_id", None, "a token id for the PARD mask: every "
                           "non-special token occurs in the training targets, so none can be "
                           "picked automatically; set drafter.mask_token_id (e.g. a reserved "
                           "token)", _WHERE)
    return unseen[-1]



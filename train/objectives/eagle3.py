"""EAGLE-3 objective: the speculators head of ``infer/drafters/eagle3.py`` trained with the
training-time-test unroll of ``ttt.py`` against the target's distribution over the draft
vocabulary (forward KL, docs/reference.md §4), plus, with ``objective.argmax_weight``, the
cross-entropy of the target's greedy token where the draft vocabulary has it (a flat target
distribution leaves a KL-trained head's argmax on the wrong token of a near tie; greedy drafts
are judged by that argmax alone).

Per step ``s`` the head's logits over the ``draft_vocab_size`` draft ids are compared with the
target's logits at ``t + 1 + s`` restricted to the same ids (``lm_head.weight[target_ids]``,
``[Vd, H]``: only the rows needed, never the full ``[B, T, vocab]``) and renormalised: the head
can only ever propose draft-vocabulary tokens, so it learns the target's preference among them.

Accuracy metrics compare the head's proposal (mapped to target ids) with the target's argmax
over the *full* vocabulary, the token a greedy verifier emits: a position whose target token lies
outside the draft vocabulary can never be accepted and counts as wrong; ``oov_rate`` logs how
often that happens (the ceiling the draft vocabulary sets).

Settings: ``drafter.aux_layer_ids`` (None: ``default_aux_layer_ids(n)``), ``num_layers`` (the
EAGLE-3 layer + ``num_layers - 1`` plain Llama layers; vLLM >= 0.11.1 serves more than one),
``intermediate_size``, ``norm_before_residual``, ``norm_output``, ``fc_norm``, ``norm_before_fc``,
``embed_requires_grad`` (own embedding, initialised as a copy of the target's and shipped;
otherwise the target's is shared, frozen and not saved), ``lm_head_init`` (``target_rows``: the
LM head starts as the target's rows of the draft vocabulary, as speculators does, which reads
the same normed state a target head does), ``init_from`` (an exported checkpoint to start
from); ``objective.ttt_steps``, ``step_weight``, ``feature_noise``. ``export`` writes the
speculators checkpoint vLLM loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.common import token_map_entry, write_checkpoint, write_token_map
from infer.foundation.files import check_tensors, read_json
from infer.models.llama import ModelConfig
from infer.models.loader import resolve_model_dir
from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from infer.foundation.validation import config_error
from train.choices import LmHeadInit
from train.objectives.base import OBJECTIVES, FeatureSpec, from_end, last_layer_state
from train.objectives.ttt import TTTObjective
from train.real.targets import verifier_name
from train.vocab import DraftVocab

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.objectives.base import TargetHeads
    from train.vocab import DraftVocab

_WHERE = "train config"
DEFAULT_SPECULATIVE_TOKENS = 3  # vLLM's usual chain length; never more than the steps trained


def resolve_aux_layer_ids(configured, num_layers: int, init_ids=None) -> list[int]:
    """Sorted aux layer ids for an ``num_layers``-layer target (``drafter.aux_layer_ids``).

    Ids are residual streams after ``k`` layers: distinct, in ``[0, n]`` (vLLM serves ids 0 and
    n from 0.18 and other than three ids from 0.22; the default picks three in ``[1, n - 1]``,
    which every vLLM with custom ids serves); negative ones count from the end
    (:func:`from_end`). ``init_ids``: the ids of the ``drafter.init_from`` checkpoint, used
    when none are configured, else they must agree.
    """
    key, n = "drafter.aux_layer_ids", num_layers
    if configured is None:
        if init_ids is not None:
            configured = init_ids
        else:
            try:
                return default_aux_layer_ids(n)
            except ValueError:
                raise config_error(key, None, f"explicit ids for this {n}-layer target (the "
                                   "default [2, n // 2, n - 3] needs n >= 4): distinct layer "
                                   f"ids in [0, {n}]", _WHERE) from None
    ids = from_end(configured, n)
    if (not ids or len(set(ids)) != len(ids)
            or any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n for k in ids)):
        raise config_error(key, list(configured), f"a non-empty list of distinct layer ids in "
                           f"[0, {n}] for this {n}-layer target (id k = residual stream after k "
                           f"layers, -1 = {n}; vLLM < 0.22 needs three in [1, {n - 1}])",
                           _WHERE)
    if init_ids is not None and sorted(init_ids) != sorted(ids):
        raise config_error(key, ids, f"the ids of the drafter.init_from checkpoint "
                           f"({sorted(init_ids)}) or null", _WHERE)
    return sorted(ids)


def init_aux_layer_ids(init_from: str | None) -> list[int] | None:
    """The aux ids in ``drafter.init_from``'s config.json (no weights read); None without one."""
    if not init_from:
        return None
    path = resolve_model_dir(init_from, "drafter.init_from") / "config.json"
    return Eagle3Config.from_dict(read_json(path)).eagle_aux_hidden_state_layer_ids


@OBJECTIVES.register("eagle3")
class Eagle3Objective(TTTObjective):
    """EAGLE-3 head + TTT unroll (module doc); ``self.drafter`` is an ``Eagle3Drafter``."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, vocab: DraftVocab,
                 target_dir: str | Path):
        super().__init__(cfg, heads, vocab, target_dir)
        d = cfg.drafter
        init = Eagle3Drafter.from_pretrained(d.init_from) if d.init_from else None
        ids = resolve_aux_layer_ids(
            d.aux_layer_ids, heads.config.num_layers,
            init.config.eagle_aux_hidden_state_layer_ids if init is not None else None)
        config = Eagle3Config.for_target(
            heads.config, draft_vocab_size=vocab.draft_vocab_size, aux_layer_ids=ids,
            intermediate_size=d.intermediate_size, num_layers=d.num_layers,
            verifier_name_or_path=verifier_name(cfg.target.path, self.target_dir),
            norm_before_residual=bool(d.norm_before_residual), norm_output=bool(d.norm_output),
            fc_norm=bool(d.fc_norm), norm_before_fc=bool(d.norm_before_fc),
            embed_requires_grad=bool(d.embed_requires_grad),
            speculative_tokens=min(self.ttt_steps, DEFAULT_SPECULATIVE_TOKENS))
        self.drafter = Eagle3Drafter(config)
        self.drafter.set_vocab(vocab.target_ids())
        self.argmax_weight = float(cfg.objective.argmax_weight)
        if d.lm_head_init == LmHeadInit.target_rows:
            init_lm_head(self.drafter, heads.lm_head, vocab.target_ids())
        if d.layer_from_target:
            init_from_last_layer(self.drafter, target_dir, heads.config)
        if self.drafter.embed_tokens is not None:  # trained: start from the target's
            with torch.no_grad():
                self.drafter.embed_tokens.weight.copy_(heads.embed_tokens.weight)
        else:
            self.drafter.share_embedding(heads.embed_tokens)
        if init is not None:
            load_init(self.drafter, init, d.init_from)

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=self.drafter.aux_layer_ids, hidden=True,
                           greedy=True)

    @classmethod
    def planned_feature_spec(cls, cfg, target) -> FeatureSpec:
        ids = resolve_aux_layer_ids(cfg.drafter.aux_layer_ids, target.num_layers,
                                    init_aux_layer_ids(cfg.drafter.init_from))
        return FeatureSpec(aux_layer_ids=tuple(ids), hidden=True, greedy=True)

    def serving_notes(self) -> str:
        from train.export import vllm_report

        return vllm_report(self.drafter.config, self.heads.config.num_layers)

    # ---- TTT hooks ---------------------------------------------------------------------------

    def features(self, batch: dict[str, Tensor]) -> Tensor:
        aux = batch["aux"]  # [B, T, n_aux * H_t], sorted id order
        want = self.drafter.fc.in_features
        if aux.shape[-1] != want:
            raise ValueError(f"batch['aux'] has width {aux.shape[-1]}; the eagle3 head expects "
                             f"{want} (aux layers {list(self.drafter.aux_layer_ids)}); were the "
                             "features captured for another drafter.aux_layer_ids?")
        return self.drafter.prepare(self.noisy(aux.to(self.drafter.fc.weight.dtype)))  # [B, T, H]

    def targets(self, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        return self.distributions(batch["hidden"][rows], batch["greedy"][rows])  # [M, ...]

    def distributions(self, hidden: Tensor, greedy: Tensor) -> dict[str, Tensor]:
        """At the target's final states ``hidden [..., H]`` with its greedy tokens ``greedy
        [...]`` (the features' full-vocabulary argmax): its log-distribution over the draft
        vocabulary (``logp [..., Vd]``), that greedy token (``argmax [...]``, target ids), whether
        it lies outside the draft vocabulary (``oov [...]`` bool) and its draft id
        (``argmax_draft [...]``, -1 where outside)."""
        head = self.heads.lm_head
        ids = self.drafter.to_target_ids(
            torch.arange(self.drafter.config.draft_vocab_size, device=self.drafter.d2t.device))
        ids = ids.to(head.weight.device)
        weight = head.weight[ids]  # [Vd, H]: only the draft vocabulary's rows
        bias = head.bias[ids] if head.bias is not None else None
        logits = F.linear(hidden.to(weight.dtype), weight, bias).float()  # [..., Vd]
        argmax_draft = self.vocab.target_to_draft(greedy)  # [...] -1 outside the draft vocab
        return {"logp": F.log_softmax(logits, dim=-1), "argmax": greedy,
                "oov": argmax_draft < 0, "argmax_draft": argmax_draft}

    def step_loss(self, step, logits, hidden, targets):
        loss = self.distill(logits, targets["logp"])  # [N]
        if self.argmax_weight > 0:  # a greedy draft must hit the argmax, not the distribution
            want = targets["argmax_draft"]  # [N] draft ids, -1 outside the draft vocabulary
            ce = F.cross_entropy(logits.float(), want.clamp_min(0), reduction="none")  # [N]
            loss = loss + self.argmax_weight * ce * (want >= 0)
        proposed = self.drafter.to_target_ids(logits.argmax(-1))  # [N] target ids
        return loss, proposed == targets["argmax"], {"oov_rate": targets["oov"].float()}

    # ---- export ------------------------------------------------------------------------------

    def export(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """The speculators checkpoint (``config.json`` + ``model.safetensors``, atomic), and with
        ``drafter.token_map_size`` its ``speculative_token_map.json``."""
        state = self.drafter_state(state_dict)
        check_tensors(path, self.drafter.state_dict(), state)
        out = write_checkpoint(path, self.drafter.config.to_dict(), state)
        size = self.cfg.drafter.token_map_size
        if size:
            write_token_map(out, frequent_draft_tokens(self.vocab, size))
        return out

    @classmethod
    def served_config(cls, path: str | Path) -> dict:
        return {**super().served_config(path), **token_map_entry(path)}


def frequent_draft_tokens(vocab: DraftVocab, size: int) -> list[int]:
    """The ``size`` draft-vocabulary tokens (target ids, ascending) most frequent among the
    training targets (``vocab.counts``; ties: the smaller id), all of them when fewer."""
    ids = vocab.target_ids()  # [Vd]
    order = torch.argsort(-vocab.counts[ids], stable=True)[:size]  # [N] most frequent first
    return sorted(ids[order].tolist())


def init_lm_head(drafter: Eagle3Drafter, head: torch.nn.Linear, target_ids: Tensor) -> None:
    """``drafter.lm_head`` := the target's LM head rows of the draft vocabulary
    (``drafter.lm_head_init=target_rows``): the head starts out proposing what the target
    would from the same normed state, and training refines it."""
    weight = drafter.lm_head.weight  # [Vd, H]
    rows = head.weight[target_ids.to(head.weight.device)]  # [Vd, H_target]
    if rows.shape != weight.shape:
        raise config_error("drafter.lm_head_init", "target_rows", f"random: the target's LM head "
                           f"rows have shape {tuple(rows.shape)}, the draft head "
                           f"{tuple(weight.shape)}", _WHERE)
    with torch.no_grad():
        weight.copy_(rows.to(weight.dtype))


def init_from_last_layer(drafter: Eagle3Drafter, target_dir: str | Path,
                         target: ModelConfig) -> None:
    """``drafter.layer_from_target``: layer 0 := the target's last decoder layer reading
    ``hidden_norm(g) + input_layernorm(embeds)`` through its own q/k/v (both halves of the 2H
    input get the target's projection, as FastMTP's ``[I | I]`` input projection), both input
    norms the target's input norm, the final norm the target's, and ``fc`` the identity on the
    last aux stream, so the head starts as one more target layer over the target's deepest
    captured state, and training moves it to predicting one token further."""
    state, final_norm = last_layer_state(target_dir, target, "drafter.layer_from_target")
    layer, h = drafter.layers[0], drafter.config.layer.hidden_size
    have, want = layer.mlp.gate_proj.weight.shape, state["mlp.gate_proj.weight"].shape
    if have != want:  # [intermediate, H]: only the widths of the target's own layer fit
        raise config_error("drafter.intermediate_size", have[0],
                           f"{want[0]}, the target's MLP width, with drafter.layer_from_target "
                           "(or layer_from_target false)", _WHERE)
    with torch.no_grad():
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = state[f"self_attn.{proj}.weight"]  # [out, H]
            getattr(layer.self_attn, proj).weight.copy_(torch.cat([w, w], dim=1))
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            layer.get_submodule(name).weight.copy_(state[f"{name}.weight"])
        for norm in ("input_layernorm", "hidden_norm"):
            getattr(layer, norm).weight.copy_(state["input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(state["post_attention_layernorm.weight"])
        drafter.norm.weight.copy_(final_norm)
        fc = drafter.fc.weight  # [H, n_aux * H]: the aux streams in sorted id order
        fc.zero_()
        fc[:, -h:] = torch.eye(h)


def load_init(drafter: Eagle3Drafter, init: Eagle3Drafter, path: str) -> None:
    """Copy ``init``'s weights into ``drafter`` (``drafter.init_from``).

    The draft vocabulary stays the current data's: ``lm_head`` rows are matched by target id
    (rows of tokens new to the vocabulary keep their fresh init). An embedding is taken only
    when both have one (otherwise the copy of the target's stays).
    """
    if init.config.num_layers != drafter.config.num_layers:  # else: a name-by-name mismatch
        raise config_error("drafter.num_layers", drafter.config.num_layers,
                           f"{init.config.num_layers}, the decoder layers of the drafter.init_from "
                           f"checkpoint {path}", _WHERE)
    for flag in ("norm_before_residual", "norm_output"):  # behaviour flags without weights
        if getattr(init.config, flag) != getattr(drafter.config, flag):
            raise config_error(f"drafter.{flag}", getattr(drafter.config, flag),
                               f"{getattr(init.config, flag)}, as in the drafter.init_from "
                               f"checkpoint {path}", _WHERE)
    own, src = drafter.state_dict(), init.state_dict()
    skip = {"d2t", "t2d", "lm_head.weight", "embed_tokens.weight"}
    missing, unexpected = set(own) - set(src) - skip, set(src) - set(own) - skip
    if missing or unexpected:  # other norm flags (fc_norm, norm_before_fc)
        raise config_error("drafter.init_from", path, "an eagle3 checkpoint with this drafter's "
                           f"norm flags; it lacks {sorted(missing)[:4]} and has "
                           f"{sorted(unexpected)[:4]} extra", _WHERE)
    state = {k: v for k, v in src.items() if k in own and k not in ("d2t", "t2d")}
    src_ids = init.to_target_ids(torch.arange(init.config.draft_vocab_size))  # [Vs]
    dst_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))  # [Vd]
    where = torch.full((init.layer_config.vocab_size,), -1, dtype=torch.long)
    where[src_ids] = torch.arange(src_ids.numel())
    src_row = where[dst_ids]  # [Vd]: row of the same token in init's head, -1 if absent
    head = own["lm_head.weight"].clone()
    head[src_row >= 0] = init.lm_head.weight[src_row[src_row >= 0]].to(head.dtype)
    state["lm_head.weight"] = head
    try:
        drafter.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch: other hidden / intermediate size
        raise config_error("drafter.init_from", path, f"an eagle3 checkpoint shaped like this "
                           f"drafter ({e})", _WHERE) from None

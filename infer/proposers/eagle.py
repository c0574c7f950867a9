"""EAGLE-family chain proposers (``method: eagle`` here, ``eagle3`` in :mod:`.eagle3`).

An EAGLE head drafts from the *target's* hidden states, so it must be fed them for every
verified position. The draft KV cache of a request holds one entry per pair
``(target state after token t, token t+1)``, at position ``t``:

- ``prefilled`` (after the prompt's target forward) and ``observe`` (after each verify forward)
  hand over target outputs; the proposer keeps the features of the *verified* positions
  (prompt: all ``n``; verify: positions ``0 .. len(new_tokens) - 1``, i.e. the states after the
  pending token and the accepted drafts) as pending, already ``prepare``-d (EAGLE-3: ``fc``).
- ``propose`` first rolls the draft cache back to the verified pairs (a length reset: entries
  written while drafting used the head's own hidden states, not the target's), then *catches up*
  with one ragged forward over the pending pairs, whose tokens are the request's tokens after
  each feature's position (the last one is the pending token). Its last output gives draft 1;
  drafts 2..k come from single-pair forwards that feed the head's own hidden state back.

Drafts are argmax, except with ``probabilistic`` rejection on sampled rows, where they are sampled
from the head's distribution (target temperature / top-k / top-p applied over the head's
vocabulary) and that distribution is returned over the full target vocabulary (zero outside the
draft vocabulary) for the acceptance test.

Engine contract (``infer/proposers/base.py``): the target forwards of prefill and verify carry
the aux streams of ``feature_spec()`` (EAGLE-3; EAGLE-1 needs none: it uses
``ModelOutput.hidden``), ``prefilled`` is called for every newly prefilled request and the verify
output arrives as ``VerifiedStep.target_output``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infer.drafters.common import PairDrafter
from infer.drafters.eagle import EagleDrafter
from infer.graphs import StaticForward
from infer.kv_cache import KVCache, cache_rows
from infer.models.groups import ForwardGroup
from infer.models.llama import inference_layout
from infer.models.output import FeatureSpec, ModelOutput
from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  VerifiedStep, joined)
from infer.rejection import argmax_verify
from infer.sampling import logits_to_probs, sample_from_probs
from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import config_error

_WIRING = "the engine must call proposer.prefilled(...) after each prefill"


@dataclass
class CatchUp:
    """What a step's catch-up forward takes (:meth:`EagleChainProposer.begin_step`)."""

    slots: Tensor  # [B] the batch's draft cache rows
    rows: Tensor | None  # cache_rows of the batch: None when in order (views, no gathers)
    ids: Tensor  # [B, T] tokens of the pending pairs, right-padded
    feats: Tensor  # [B, T, H] their prepared features
    counts: list[int]  # pending pairs per row
    backlogs: list[ForwardGroup]  # new prompts' backlogs, to run before (``apart=False``)


class EagleChainProposer(Proposer):
    """Shared chain drafting for EAGLE heads; subclasses load the head and pick its features.

    The head (``self.drafter``) provides ``prepare(features) -> [.., H]``,
    ``forward(ids, hidden, cache, slots, num_tokens=, logits_at=) -> (logits, hidden)``,
    ``to_target_ids`` and ``to_target_probs``, and ``layer_config`` for its KV cache.
    """

    provides_draft_probs = True

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        self.drafter = inference_layout(self.load_drafter(spec, ctx))
        self.k = spec.num_speculative_tokens
        self.max_len = spec.max_model_len or ctx.max_model_len  # SpeculativeConfig.for_target
        # catch-up pairs of the longest sequence plus k - 1 drafted pairs
        self.cache = KVCache.for_model(self.drafter.layer_config, ctx.max_num_seqs,
                                       self.max_len + self.k, dtype=ctx.dtype, device=ctx.device)
        self.fed = [0] * ctx.max_num_seqs  # verified pairs held in each slot's draft cache
        self.pending: dict[int, Tensor] = {}  # slot -> [m, H] prepared features not yet fed
        self.sample = spec.draft_sample_method == "probabilistic"  # else argmax drafts
        self.siblings = 0 if self.sample else spec.draft_tree_siblings  # next-best per draft
        self.tree_max_batch = spec.draft_tree_max_batch  # larger steps keep the chain
        vocab = self.drafter.lm_head.weight.shape[0]  # the head's (draft) vocabulary
        if self.siblings >= vocab:
            raise config_error("draft_tree_siblings", self.siblings, f"fewer than the head's "
                               f"{vocab} draft tokens", f"speculative_config ({spec.model})")
        # the k - 1 one-pair draft steps in fixed shapes (CUDA graphs); the catch-up is ragged
        self.static = StaticForward(self.drafter, self.cache) if ctx.static_steps else None

    # ---- subclass hooks ----------------------------------------------------------------------

    def load_drafter(self, spec: SpeculativeConfig, ctx: ProposerContext) -> PairDrafter:
        raise NotImplementedError

    def target_features(self, target_output: ModelOutput) -> Tensor:
        """The raw per-position target features ``[B, T, F]`` the head's ``prepare`` takes."""
        raise NotImplementedError

    # ---- lifecycle ---------------------------------------------------------------------------

    def prefilled(self, slots: list[int], num_tokens: list[int],
                  target_output: ModelOutput) -> None:
        with torch.no_grad():
            feats = self.drafter.prepare(self.target_features(target_output))  # [B, T, H]
        for row, (slot, n) in enumerate(zip(slots, num_tokens)):
            self.fed[slot] = 0
            self.pending[slot] = feats[row, :n].clone()

    def observe(self, step: VerifiedStep) -> None:
        with torch.no_grad():
            feats = self.drafter.prepare(self.target_features(step.target_output))  # [B, k+1, H]
        for row, (slot, new) in enumerate(zip(step.slots, step.new_tokens)):
            if slot not in self.pending:
                raise RuntimeError(f"no target features for slot {slot}; {_WIRING}")
            self.pending[slot] = torch.cat([self.pending[slot], feats[row, : len(new)]])

    def finish(self, slot: int) -> None:
        self.pending.pop(slot, None)
        self.fed[slot] = 0

    # ---- drafting ----------------------------------------------------------------------------

    def begin_step(self, batch: DraftBatch, *, apart: bool = True) -> CatchUp:
        """Roll each row's draft cache back to its verified pairs and take the pending ones
        (:class:`CatchUp`); ``self.fed`` then counts the pairs this step's catch-up writes
        (drafted entries are rolled back at the next step). New prompts' backlogs
        (:meth:`_backlog_groups`) are fed now, in a forward of their own (``apart``), or left in
        ``CatchUp.backlogs`` for the caller's one grouped forward."""
        slots = torch.tensor(batch.slots, device=self.ctx.device)  # [B]
        rows = cache_rows(batch.slots, slots)  # None when in order: cache views, no gathers
        self.cache.truncate(slots, torch.tensor([self.fed[s] for s in batch.slots],
                                                device=self.ctx.device))
        backlogs = self._backlog_groups(batch)
        if apart and backlogs:
            self.drafter.forward_groups(backlogs, self.cache)  # writes the cache; outputs unused
            backlogs = []
        ids, feats, counts = self._catch_up_inputs(batch.slots, batch.token_ids)
        for slot, n in zip(batch.slots, counts):
            self.fed[slot] += n
        return CatchUp(slots, rows, ids, feats, counts, backlogs)

    def _backlog_groups(self, batch: DraftBatch) -> list[ForwardGroup]:
        """A request's first catch-up covers its whole prompt. In the batch's catch-up rows it
        would pad every row to the prompt's length (measured: 7 such steps were 12 % of a batch-8
        run, scripts/bench_spec_step.py). So rows holding more pairs than a verify step leaves
        (k + 1) feed all but their last pair as a group of their own, unpadded, planned before
        the catch-up (vLLM runs its drafter over the prompt right after the target's prefill).
        ``self.fed`` counts them already."""
        groups = []
        for slot, toks in zip(batch.slots, batch.token_ids):
            if len(toks) - 1 - self.fed[slot] <= self.k + 1:
                continue
            ids, feats, (n,) = self._catch_up_inputs([slot], [toks[:-1]])  # [1, n], [1, n, H]
            groups.append(ForwardGroup.last_of(ids, slot, hidden=feats))
            self.fed[slot] += n
        return groups

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        c = self.begin_step(batch, apart=False)
        slots, rows = c.slots, c.rows
        counts = torch.tensor(c.counts, device=self.ctx.device)  # [B]
        # rows of equal counts (one row always) have no padding: no counts to plan with, so a
        # batch-1 catch-up takes the cache's one-row plan
        ragged = counts if min(c.counts) < c.ids.shape[1] else None
        logits, hidden = self.catch_up(c, c.ids, c.feats, ragged, (counts - 1)[:, None])
        tokens, probs, sibs, conf = [], [], [], []  # from logits [B, 1, V'], hidden [B, 1, H]
        tree = (self.siblings and len(batch.slots) <= self.tree_max_batch
                and argmax_verify(batch.temperature, self.spec.rejection_sample_method))
        for step in range(batch.k):
            tok, q = self._choose(logits, batch)  # [B, 1] target ids, [B, 1, vocab] or None
            tokens.append(tok)
            probs.append(q)
            conf.append(self.confidence(logits))  # [B, 1] or None
            if tree:
                sibs.append(self._next_best(logits))  # [B, 1, S]
            if step + 1 < batch.k:
                logits, hidden = self._decode(tok, hidden, slots, rows, batch, step)
        draft_probs = torch.cat(probs, dim=1) if self.sample else None  # [B, k, vocab]
        siblings = torch.cat(sibs, dim=1) if sibs else None  # [B, k, S]
        return Proposal(torch.cat(tokens, dim=1), draft_probs, siblings, joined(conf))  # [B, k]

    def catch_up(self, c: CatchUp, ids: Tensor, feats: Tensor, num_tokens: Tensor | None,
                 logits_at: Tensor) -> tuple[Tensor, Tensor]:
        """The step's catch-up forward over ``ids [B, T]`` / ``feats [B, T, H]`` (``c``'s rows,
        ``num_tokens [B]`` real, None: all ``T``), after ``c.backlogs`` in the same forward when
        there are any: ``(logits [B, K, V'], hidden [B, K, H])`` at ``logits_at [B, K]``."""
        group = ForwardGroup(ids, c.rows, num_tokens, logits_at, feats)
        return self.drafter.forward_groups(c.backlogs + [group], self.cache)[-1]

    def _decode(self, tok: Tensor, hidden: Tensor, slots: Tensor, rows: Tensor | None,
                batch: DraftBatch, step: int) -> tuple[Tensor, Tensor]:
        """One pair per row (the head's own hidden state fed back) into the draft cache:
        ``(logits [B, 1, V'], hidden [B, 1, H])``; ``rows``: ``cache_rows`` of the batch."""
        if self.static is None:
            return self.drafter(tok, hidden, self.cache, rows)
        longest = max(len(t) for t in batch.token_ids) + step  # cache rows after this step
        return self.static(tok, hidden, slots=batch.slots, index=slots, max_len=longest)

    def _catch_up_inputs(self, slots: list[int], token_ids: list[list[int]]
                         ) -> tuple[Tensor, Tensor, list[int]]:
        """The pending pairs of each slot up to its tokens ``token_ids`` (taken from pending),
        right-padded: tokens ``[B, T]``, features ``[B, T, H]``, counts."""
        rows = []
        for slot, toks in zip(slots, token_ids):
            need = len(toks) - 1 - self.fed[slot]  # pairs (f_j, token_{j+1}) not yet fed
            have = self.pending.get(slot)
            if have is None or need < 1 or have.shape[0] < need:
                raise RuntimeError(f"slot {slot}: {need} verified positions to feed but "
                                   f"{0 if have is None else have.shape[0]} target features "
                                   f"held; {_WIRING}")
            rows.append((toks[len(toks) - need:], have[:need]))
            self.pending[slot] = have[need:]
        t = max(len(r[0]) for r in rows)
        hidden = rows[0][1].shape[-1]
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        feats = rows[0][1].new_zeros(len(rows), t, hidden)
        for row, (toks, f) in enumerate(rows):
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            feats[row, : len(toks)] = f
        return ids.to(self.ctx.device), feats, [len(r[0]) for r in rows]

    def _next_best(self, logits: Tensor) -> Tensor:
        """The head's 2nd .. (S + 1)-th tokens ``[B, 1, S]`` (target ids): a tree's siblings."""
        top = logits.topk(1 + self.siblings, dim=-1).indices  # [B, 1, 1 + S]
        return self.drafter.to_target_ids(top[..., 1:])

    def _choose(self, logits: Tensor, batch: DraftBatch) -> tuple[Tensor, Tensor | None]:
        """Target-id drafts ``[B, n]`` and, when sampling, their distribution ``[B, n, vocab]``."""
        if not self.sample:
            return self.drafter.to_target_ids(logits.argmax(dim=-1)), None
        temperature = batch.temperature if batch.temperature is not None else 0.0
        q = logits_to_probs(logits, temperature, batch.top_k, batch.top_p)  # [B, n, V']
        tok = sample_from_probs(q, batch.generator)
        return self.drafter.to_target_ids(tok), self.drafter.to_target_probs(q)


@PROPOSERS.register("eagle")
class EagleProposer(EagleChainProposer):
    """EAGLE-1: features = the target's last hidden state after the final norm."""

    def load_drafter(self, spec: SpeculativeConfig, ctx: ProposerContext) -> EagleDrafter:
        drafter = EagleDrafter.from_pretrained(spec.model, dtype=ctx.dtype, device=ctx.device)
        drafter.attach_target(ctx.target)  # checks hidden size and vocabulary against the target
        return drafter

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def target_features(self, target_output: ModelOutput) -> Tensor:
        return target_output.hidden  # [B, T, H]

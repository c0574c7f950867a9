"""MLP speculator proposer (``method: mlp_speculator``, docs/reference.md §5).

The speculator needs, per request, the target's final hidden state (``ModelOutput.hidden``, after
the final norm) at the position that predicted the pending token, plus the pending token itself:

- ``prefilled``: the prompt's last position ``num_tokens - 1`` predicted the first output token,
  which is the pending one at the next ``propose``.
- ``observe``: the verify forward ran over ``[pending, d_1..d_k]``; with ``a`` drafts accepted,
  position ``a`` (the state after ``pending, d_1..d_a``) predicted the final (recovered / bonus)
  token, which becomes the new pending token. ``a = len(new_tokens) - 1``.

``propose`` then chains the stages from ``s_0`` = that state and ``token_0`` = the request's last
token. No KV cache: the state is one vector per slot. Drafts are argmax, except with
``probabilistic`` rejection, where they are sampled from each head's distribution (the request's
temperature / top-k / top-p applied) and that distribution is returned over the full target
vocabulary. ``num_speculative_tokens`` defaults to ``n_predict`` (spec_config) and may not
exceed it (error at start-up, as vLLM raises when asked for more tokens than heads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.drafters.mlp_speculator import MLPSpeculator
from infer.models.llama import inference_layout
from infer.models.output import FeatureSpec, ModelOutput
from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  VerifiedStep, joined)
from infer.sampling import logits_to_probs, sample_from_probs
from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import config_error

_WIRING = "the engine must call proposer.prefilled(...) after each prefill"


@PROPOSERS.register("mlp_speculator")
class MLPSpeculatorProposer(Proposer):
    provides_draft_probs = True

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        where = f"mlp_speculator {spec.model}"
        self.drafter = inference_layout(MLPSpeculator.from_pretrained(
            spec.model, dtype=ctx.dtype, device=ctx.device))
        cfg = self.drafter.config
        self.k = spec.num_speculative_tokens
        if self.k > cfg.n_predict:
            raise config_error("num_speculative_tokens", self.k, f"an integer <= the "
                               f"speculator's n_predict ({cfg.n_predict}): it has one head per "
                               "drafted token", "speculative_config")
        if cfg.emb_dim != ctx.target_config.hidden_size:
            raise config_error("emb_dim", cfg.emb_dim, f"the target's hidden_size "
                               f"({ctx.target_config.hidden_size})", where)
        if cfg.vocab_size > ctx.vocab_size:
            raise config_error("vocab_size", cfg.vocab_size, f"<= the target's vocab_size "
                               f"({ctx.vocab_size})", where)
        self.sample = spec.draft_sample_method == "probabilistic"  # else argmax drafts
        self.state: dict[int, Tensor] = {}  # slot -> [emb_dim] target state behind the pending

    # ---- lifecycle ---------------------------------------------------------------------------

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(hidden=True)

    def prefilled(self, slots: list[int], num_tokens: list[int],
                  target_output: ModelOutput) -> None:
        hidden = target_output.hidden  # [B, T, H]
        for row, (slot, n) in enumerate(zip(slots, num_tokens)):
            self.state[slot] = hidden[row, n - 1].clone()

    def observe(self, step: VerifiedStep) -> None:
        hidden = step.target_output.hidden  # [B, k + 1, H]
        for row, (slot, new) in enumerate(zip(step.slots, step.new_tokens)):
            self.state[slot] = hidden[row, len(new) - 1].clone()

    def finish(self, slot: int) -> None:
        self.state.pop(slot, None)

    # ---- drafting ----------------------------------------------------------------------------

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        missing = [s for s in batch.slots if s not in self.state]
        if missing:
            raise RuntimeError(f"no target hidden state for slots {missing}; {_WIRING}")
        k = min(batch.k, self.k)
        self.drafter.check_k(k)
        device = self.ctx.device
        state = self.drafter.prepare(torch.stack([self.state[s] for s in batch.slots]))  # [B, H]
        tok = torch.tensor([t[-1] for t in batch.token_ids], dtype=torch.long, device=device)
        tokens, probs, conf = [], [], []
        for i in range(k):
            logits, state = self.drafter.step(i, state, tok)  # [B, V'], [B, D]
            tok, q = self._choose(logits, batch)
            tokens.append(tok)
            probs.append(q)
            conf.append(self.confidence(logits[:, None]))  # [B, 1] or None
        draft_ids = torch.stack(tokens, dim=1)  # [B, k]
        confidence = joined(conf)  # [B, k] or None
        draft_probs = torch.stack(probs, dim=1) if self.sample else None  # [B, k, vocab]
        if k < batch.k:  # engine asked for more than we draft: -1 suffix
            pad = draft_ids.new_full((draft_ids.shape[0], batch.k - k), -1)
            draft_ids = torch.cat([draft_ids, pad], dim=1)
            if draft_probs is not None:
                draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(
                    draft_probs.shape[0], batch.k - k, draft_probs.shape[-1])], dim=1)
            if confidence is not None:
                confidence = torch.cat([confidence, confidence.new_zeros(
                    confidence.shape[0], batch.k - k)], dim=1)
        return Proposal(draft_ids, draft_probs, confidence=confidence)

    def _choose(self, logits: Tensor, batch: DraftBatch) -> tuple[Tensor, Tensor | None]:
        """Drafts ``[B]`` and, when sampling, their distribution ``[B, vocab]`` (target vocab)."""
        if not self.sample:
            return logits.argmax(dim=-1), None
        temperature = batch.temperature if batch.temperature is not None else 0.0
        q = logits_to_probs(logits, temperature, batch.top_k, batch.top_p)  # [B, V']
        tok = sample_from_probs(q, batch.generator)
        pad = self.ctx.vocab_size - q.shape[-1]
        if pad:
            q = torch.cat([q, q.new_zeros(q.shape[0], pad)], dim=-1)
        return tok, q

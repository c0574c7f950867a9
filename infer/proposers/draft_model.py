"""Draft-model proposers: an independent small causal LM with the target's tokenizer (or another
one, with ``use_heterogeneous_vocab``: greedy drafts over the two vocabularies' intersection,
``infer/vocab_bridge.py``).

Sequential (``method: draft_model``): each step first *catches up* (one ragged forward over the
tokens the draft's KV cache has not seen: the whole prompt at first, afterwards the accepted
tokens and the new pending token) which also yields draft 1, then k - 1 single-token forwards.
The draft cache is rolled back to the verified tokens after drafting (a length reset), so
rejected drafts never linger in it.

Parallel (PARD, ``draft_model`` + ``parallel_drafting: true``): the catch-up forward carries
``k - 1`` mask tokens after the real ones, and its last k logits are the k drafts; one forward per
step. The mask id is ``pard_token`` (or ``mask_token_id`` / ``ptd_token_id``) in the draft's
config.json.

Drafts are argmax, except with ``probabilistic`` rejection on sampled rows, where they are sampled
from the draft's distribution ``q`` (same temperature / top-k / top-p as the target) and ``q`` is
returned for the acceptance test.
"""

from __future__ import annotations

import torch

from infer.foundation.errors import ConfigError, FileFormatError
from infer.foundation.files import load_tokenizer
from infer.graphs import StaticForward
from infer.kv_cache import KVCache, cache_rows
from infer.models.groups import ForwardGroup
from infer.models.loader import load_model
from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  joined)
from infer.sampling import logits_to_probs, sample_from_probs
from infer.draft_config import draft_config_path, read_draft_config
from infer.spec_config import SpeculativeConfig
from infer.vocab_bridge import VocabBridge

MASK_KEYS = ("pard_token", "mask_token_id", "ptd_token_id")


@PROPOSERS.register("draft_model")
class DraftModelProposer(Proposer):
    provides_draft_probs = True
    parallel_drafting = None  # sequential, or PARD with the flag

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        self.model = load_model(spec.model, dtype=ctx.dtype, device=ctx.device)
        self.bridge = _bridge(spec, ctx, self.model.config.vocab_size)
        self.k = spec.num_speculative_tokens
        self.max_len = spec.max_model_len or ctx.max_model_len  # SpeculativeConfig.for_target
        self.mask_id = _mask_token(spec) if spec.parallel_drafting else None
        # room for the catch-up tokens plus k - 1 drafts or masks beyond the longest sequence
        self.cache = KVCache.for_model(self.model.config, ctx.max_num_seqs, self.max_len + self.k,
                                       dtype=ctx.dtype, device=ctx.device)
        self.fed = [0] * ctx.max_num_seqs  # verified tokens held in each slot's draft cache
        # the k - 1 one-token steps as CUDA graphs (the catch-up forward is ragged: eager)
        self.static = StaticForward(self.model, self.cache) if ctx.static_steps else None
        self.sample = spec.draft_sample_method == "probabilistic"  # else argmax drafts

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        self.fed[slot] = 0

    def propose(self, batch: DraftBatch) -> Proposal:
        # a row whose drafts would reach past the draft's max_model_len drafts nothing (as vLLM)
        fits = [len(t) + batch.k - 1 <= self.max_len for t in batch.token_ids]
        if all(fits):
            return self._propose_rows(batch)
        rows = [i for i, ok in enumerate(fits) if ok]
        draft_ids = torch.full((len(fits), batch.k), -1, dtype=torch.long, device=self.ctx.device)
        if not rows:
            return Proposal(draft_ids)
        index = torch.tensor(rows, device=self.ctx.device)
        proposal = self._propose_rows(batch.select(rows))
        draft_ids[index] = proposal.draft_ids
        probs = None
        if proposal.draft_probs is not None:  # rows without drafts never read theirs
            probs = proposal.draft_probs.new_zeros(len(fits), *proposal.draft_probs.shape[1:])
            probs[index] = proposal.draft_probs
        return Proposal(draft_ids, probs)

    def _propose_rows(self, batch: DraftBatch) -> Proposal:
        slots = torch.tensor(batch.slots, device=self.ctx.device)  # [B]
        rows = cache_rows(batch.slots, slots)  # None when in order: views, no gathers
        self.cache.truncate(slots, torch.tensor([self.fed[s] for s in batch.slots],
                                                device=self.ctx.device))
        backlogs = self._backlog_groups(batch)
        feeds = [self._draft_ids(toks[self.fed[s]:]) for s, toks in zip(batch.slots,
                                                                          batch.token_ids)]
        for s, toks in zip(batch.slots, batch.token_ids):
            self.fed[s] = len(toks)  # after this step's catch-up the cache holds all of them
        if self.mask_id is not None:
            logits = self._parallel(feeds, rows, batch.k, backlogs)  # [B, k, vocab]
            tokens, probs = self._choose(logits, batch)
            confidence = self.confidence(logits)
        else:
            tokens, probs, confidence = self._sequential(feeds, slots, rows, batch, backlogs)
        if self.bridge is not None:  # drafted over the intersection: the target's ids
            tokens = self.bridge.to_target[tokens]
        return Proposal(tokens, probs if self.sample else None, confidence=confidence)

    def _draft_ids(self, target_ids: list[int]) -> list[int]:
        return target_ids if self.bridge is None else self.bridge.draft_ids(target_ids)

    def _backlog_groups(self, batch: DraftBatch) -> list[ForwardGroup]:
        """Rows with more unseen tokens than a verify step leaves (k + 1: a new prompt) feed all
        but their last token as a group of their own, unpadded, in the catch-up's forward
        (``Llama.forward_groups``): as rows of the catch-up they would pad every row to the
        prompt's length (the EAGLE proposers do the same, infer/proposers/eagle.py).
        ``self.fed`` counts them already."""
        groups, device = [], self.ctx.device
        for slot, toks in zip(batch.slots, batch.token_ids):
            feed = toks[self.fed[slot]:-1]
            if len(feed) <= self.k:
                continue
            groups.append(ForwardGroup.last_of(torch.tensor([self._draft_ids(feed)],
                                                            device=device), slot))
            self.fed[slot] += len(feed)
        return groups

    def _sequential(self, feeds: list[list[int]], slots: torch.Tensor,
                    rows: torch.Tensor | None, batch: DraftBatch,
                    backlogs: list[ForwardGroup]):
        logits = self._forward_ragged(feeds, rows, 1, backlogs)  # [B, 1, vocab]
        tokens, probs, conf = [], [], []
        for step in range(batch.k):
            if self.bridge is not None:  # greedy over the intersection, no distribution
                logits = self.bridge.mask(logits)
            tok, q = self._choose(logits, batch)  # [B, 1], [B, 1, vocab]
            tokens.append(tok)
            probs.append(q)
            conf.append(self.confidence(logits))  # [B, 1] or None
            if step + 1 < batch.k:
                logits = self._decode(tok, slots, rows, batch, step)  # [B, 1, vocab]
        return torch.cat(tokens, dim=1), torch.cat(probs, dim=1), joined(conf)

    def _decode(self, tok: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None,
                batch: DraftBatch, step: int) -> torch.Tensor:
        """One drafted token per row into the draft cache; logits ``[B, 1, vocab]``. ``slots``
        index the fixed-shape steps; eager ones take ``rows`` (``cache_rows``)."""
        if self.static is None:
            return self.model(tok, self.cache, rows).logits
        longest = max(len(t) for t in batch.token_ids) + step + 1  # cache rows after this step
        return self.static(tok, slots=batch.slots, index=slots, max_len=longest).logits

    def _parallel(self, feeds: list[list[int]], rows: torch.Tensor | None, k: int,
                  backlogs: list[ForwardGroup]) -> torch.Tensor:
        masked = [f + [self.mask_id] * (k - 1) for f in feeds]
        return self._forward_ragged(masked, rows, k, backlogs)

    def _forward_ragged(self, feeds: list[list[int]], rows: torch.Tensor | None, last: int,
                        backlogs: list[ForwardGroup]) -> torch.Tensor:
        """Append ragged token lists (after the ``backlogs`` groups, in the same forward);
        logits ``[B, last, vocab]`` at each row's last positions."""
        device = self.ctx.device
        lens = torch.tensor([len(f) for f in feeds], device=device)  # [B]
        ids = torch.zeros(len(feeds), max(len(f) for f in feeds), dtype=torch.long)
        for row, f in enumerate(feeds):
            ids[row, : len(f)] = torch.tensor(f, dtype=torch.long)
        at = lens[:, None] - last + torch.arange(last, device=device)  # [B, last]
        catch_up = ForwardGroup(ids.to(device), rows, lens, at)
        return self.model.forward_groups(backlogs + [catch_up], self.cache)[-1].logits

    def _choose(self, logits: torch.Tensor, batch: DraftBatch):
        """Draft tokens ``[B, n]`` and the draft distribution ``[B, n, vocab]`` they came from."""
        temperature = batch.temperature if batch.temperature is not None else 0.0
        q = logits_to_probs(logits, temperature, batch.top_k, batch.top_p)  # [B, n, vocab]
        if self.sample:
            return sample_from_probs(q, batch.generator), q
        return logits.argmax(dim=-1), q


def _bridge(spec: SpeculativeConfig, ctx: ProposerContext, vocab: int) -> VocabBridge | None:
    """The vocabulary map of a draft with another tokenizer (``use_heterogeneous_vocab``);
    None for a draft sharing the target's vocabulary, which is checked here."""
    if not spec.use_heterogeneous_vocab:
        if vocab != ctx.vocab_size:
            raise FileFormatError(f"speculative_config: the draft model {spec.model!r} has "
                                  f"vocab_size {vocab} but the target has {ctx.vocab_size}; a "
                                  "draft model must share the target's tokenizer and vocabulary "
                                  "(or set use_heterogeneous_vocab: true)")
        return None
    if ctx.tokenizer is None:
        raise ConfigError("speculative_config: use_heterogeneous_vocab needs the target's "
                          "tokenizer (the target has none: token-id prompts only)",
                          "use_heterogeneous_vocab")
    draft_tokenizer = load_tokenizer(spec.model, key="speculative_config.model")
    bridge = VocabBridge.build(draft_tokenizer, ctx.tokenizer, vocab, ctx.vocab_size,
                               ctx.device)
    if bridge.size == 0:
        raise ConfigError(f"speculative_config: the draft model {spec.model!r} shares no "
                          "token with the target's vocabulary (use_heterogeneous_vocab)",
                          "use_heterogeneous_vocab")
    return bridge


def _mask_token(spec: SpeculativeConfig) -> int:
    path = draft_config_path(spec.model)
    config = read_draft_config(path) if path is not None else {}
    for key in MASK_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    raise ConfigError(f"speculative_config: parallel_drafting needs a mask token id in the draft's "
                      f"config.json (one of {', '.join(MASK_KEYS)}); none found for "
                      f"{spec.model!r}")

"""DSpark proposer (``method: dspark``): DFlash's block forward, then the Markov head left to
right (infer/drafters/dspark.py).

The context cache, the block's rows and positions are DFlash's (infer/proposers/dflash.py); only
drafting differs. From the K mask rows' hidden states ``h [B, K, H]`` and base logits, slot i's
logits add the Markov bias of ``prev_i`` (the pending token for slot 1, then the token drafted
at i - 1, as a target id), and its draft is the argmax, or a sample from those logits under the
request's sampling transform with ``draft_sample_method: probabilistic`` (q returned over the
target vocabulary, so the rejection sampler judges exactly what was drawn). With adaptive
verification the confidence head's sigmoid is each draft's confidence; a checkpoint without one
falls back to the corrected logits' top probability.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.drafters.dspark import DSparkDrafter
from infer.proposers.base import PROPOSERS, DraftBatch, Proposal
from infer.proposers.dflash import DFlashProposer
from infer.sampling import logits_to_probs, sample_from_probs


@PROPOSERS.register("dspark")
class DSparkProposer(DFlashProposer):
    """Block drafting with a DSpark head (module doc)."""

    DRAFTER = DSparkDrafter

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        h = self.block_hidden(batch)  # [B, K, H]
        base = self.drafter.logits(h)  # [B, K, Vd]
        prev = torch.tensor([toks[-1] for toks in batch.token_ids], device=h.device)  # [B]
        temperature = batch.temperature if batch.temperature is not None else 0.0
        drafts, probs, logits, embeds = [], [], [], []
        for i in range(h.shape[1]):  # left to right: slot i reads the token drafted at i - 1
            bias, e = self.drafter.markov(prev)  # [B, Vd], [B, r]
            slot = base[:, i] + bias  # [B, Vd]
            if self.sample:
                q = logits_to_probs(slot[:, None], temperature, batch.top_k, batch.top_p)
                tok = sample_from_probs(q, batch.generator)[:, 0]  # [B]
                probs.append(q[:, 0])
            else:
                tok = slot.argmax(dim=-1)  # [B]
            drafts.append(tok)
            logits.append(slot)
            embeds.append(e)
            prev = self.drafter.to_target_ids(tok)
        ids = self.drafter.to_target_ids(torch.stack(drafts, dim=1))  # [B, K]
        confidence = self.head_confidence(h, torch.stack(embeds, dim=1),
                                          torch.stack(logits, dim=1))
        q = self.drafter.to_target_probs(torch.stack(probs, dim=1)) if self.sample else None
        return Proposal(ids, q, confidence=confidence)

    def head_confidence(self, h: Tensor, e: Tensor, logits: Tensor) -> Tensor | None:
        """Each draft's confidence ``[B, K]`` for adaptive verification: the confidence head's
        probability, else the corrected logits' top probability; None when not verifying
        adaptively."""
        if not self.spec.enable_adaptive_verification:
            return None
        if self.drafter.confidence_head is None:
            return self.confidence(logits)
        return torch.sigmoid(self.drafter.confidence_logit(h, e))

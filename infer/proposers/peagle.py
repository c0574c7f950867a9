"""P-EAGLE proposer (``method: eagle3`` + ``parallel_drafting: true``, or a ``peagle``
checkpoint, which the schema maps to exactly that): K drafts from ONE draft forward per step.

Rows of the step's forward, per request (right-padded across the batch)::

    catch-up pairs (g_j, x_{j+1})  ...  (g_last, pending token)  |  MASK x (K - 1)
    target features, prepared                                      prepare(mask_hidden)

Positions continue through the mask rows (the draft cache's own positions) and attention is the
ordinary causal one over the draft KV cache, so the mask row ``d`` sees the verified pairs and
the mask rows before it: the layout ``train/objectives/peagle.py`` trains. The last real row and
the K - 1 mask rows give the K drafts (``logits_at`` = the last K rows). The mask rows' cache
entries are dropped at the next step by the chain proposer's rollback to the verified pairs
(``self.fed``); the cache holds ``max_model_len + k`` rows, room for the K - 1 extra ones.

On CUDA the forward runs in fixed shapes and is replayed as a CUDA graph (``StaticForward``, as
the chain proposers' one-pair steps; ``logits_at`` goes in as a per-row keyword input): one graph
per row bucket x token count (longest catch-up + K - 1) x key bucket.

Matches vLLM 0.32's ``llm_base_proposer.py`` (``parallel_drafting``: one forward,
``_copy_and_expand_eagle_inputs`` appends K - 1 slots with ``parallel_drafting_token_id`` and
``parallel_drafting_hidden_state_tensor`` = ``combine_hidden_states(mask_hidden)``). Unlike
vLLM, a K above the depths the head was trained for is refused (vLLM drafts garbage there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.drafters.peagle import PEagleDrafter
from infer.proposers.base import PROPOSERS, DraftBatch, Proposal, ProposerContext
from infer.proposers.eagle3 import Eagle3Proposer
from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import config_error


@PROPOSERS.register("eagle3/parallel")
class PEagleProposer(Eagle3Proposer):
    """EAGLE-3 head with ``mask_hidden``: the chain proposer's bookkeeping (pending target
    features, catch-up, rollback), one forward instead of k."""

    parallel_drafting = True
    drafter_class = PEagleDrafter

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)  # self.static: the one forward in fixed shapes (graphs)
        trained = self.drafter.config.speculative_tokens
        if self.k > trained:
            raise config_error("num_speculative_tokens", self.k,
                               f"at most {trained}, the depths the P-EAGLE head {spec.model} was "
                               "trained for (its speculators_config.proposal_methods[0]."
                               "speculative_tokens); deeper mask rows draft noise",
                               "speculative_config")
        self.mask_id = self.drafter.config.mask_token_id
        with torch.no_grad():
            self.mask_feature = self.drafter.mask_features()[0, 0]  # [H], computed once

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        # mask rows are rolled back too; new prompts' backlogs join the eager catch-up forward
        step = self.begin_step(batch, apart=self.static is not None)
        ids, feats, num_tokens, last = self.with_mask_rows(step.ids, step.feats, step.counts,
                                                           batch.k)
        if self.static is None:
            logits, _ = self.catch_up(step, ids, feats, num_tokens, last)  # [B, K, V']
        else:  # cache rows after the step: the verified pairs plus the K - 1 mask rows
            longest = max(len(t) for t in batch.token_ids) + batch.k - 1
            logits, _ = self.static(ids, feats, slots=batch.slots, index=step.slots,
                                    max_len=longest, num_tokens=num_tokens,
                                    row_kwargs={"logits_at": last})
        tokens, probs = self._choose(logits, batch)  # [B, K], [B, K, vocab] or None
        return Proposal(tokens, probs if self.sample else None,
                        confidence=self.confidence(logits))

    def with_mask_rows(self, ids: Tensor, feats: Tensor, counts: list[int], k: int
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Append K - 1 mask rows after each row's ``counts[b]`` catch-up pairs.

        ``ids [B, T]``, ``feats [B, T, H]`` -> ``ids [B, T + K - 1]`` (mask token in the new
        rows), ``feats [B, T + K - 1, H]`` (``prepare(mask_hidden)`` there), ``num_tokens [B]``
        and ``logits_at [B, K]`` (the last real row and the mask rows). Built with device ops
        from the host-side counts: no device-to-host sync.
        """
        if k < 1:
            raise ValueError(f"P-EAGLE drafts k >= 1 tokens per step, asked for {k}")
        m, device = k - 1, ids.device
        n = torch.tensor(counts, device=device)[:, None]  # [B, 1]
        col = torch.arange(ids.shape[1] + m, device=device)[None]  # [1, T + m]
        is_mask = (col >= n) & (col < n + m)  # [B, T + m]
        ids = F.pad(ids, (0, m)).masked_fill(is_mask, self.mask_id)  # [B, T + m]
        mask_feature = self.mask_feature.to(feats.dtype)  # [H]
        feats = torch.where(is_mask[..., None], mask_feature, F.pad(feats, (0, 0, 0, m)))
        last = n - 1 + torch.arange(k, device=device)[None]  # [B, K]
        return ids, feats, n[:, 0] + m, last

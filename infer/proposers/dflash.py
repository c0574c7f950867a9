"""DFlash proposer (``method: dflash``): K drafts from one non-causal forward of 1 + K rows.

Per request the draft KV cache (one row per engine slot, positions = indices) holds, for every
layer, the context keys/values of every *verified* position (``infer/drafters/dflash.py``):

- ``prefilled``: the prompt's target aux states -> ``fc`` / ``hidden_norm`` -> each layer's
  k/v, appended at positions ``0 .. n - 1``;
- ``observe``: the verify forward's rows ``0 .. len(new_tokens) - 1`` (the pending token and the
  accepted drafts: the positions now verified) appended the same way;
- ``propose``: rows ``[pending token x_p, MASK x K]`` at positions ``p .. p + K`` (``p`` = the
  context length = the pending token's index); each row attends every context key and the whole
  block (keys ``< p + 1 + K``, no causal order); drafts = argmax of rows ``1 .. K``, or sampled
  with ``draft_sample_method: probabilistic`` (q returned over the full target vocabulary).

The block's keys are written into the cache at ``p .. p + K`` but the row length is not advanced,
so they are invisible afterwards and overwritten by the next context write (the KVCache rollback
contract: a length is the truth, stale keys beyond it never count). vLLM does the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.drafters.dflash import DFlashDrafter
from infer.foundation.errors import FileFormatError
from infer.graphs import StaticForward
from infer.kv_cache import KVCache, cache_rows
from infer.models.llama import inference_layout
from infer.models.output import FeatureSpec, ModelOutput
from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  VerifiedStep, aux_features, check_head_fits)
from infer.sampling import logits_to_probs, sample_from_probs
from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import config_error

_WIRING = "the engine must call proposer.prefilled(...) after each prefill"


@PROPOSERS.register("dflash")
class DFlashProposer(Proposer):
    """Block drafting with a DFlash head (module doc)."""

    provides_draft_probs = True
    parallel_drafting = True
    DRAFTER = DFlashDrafter  # DSpark's proposer loads its subclass

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        self.drafter = inference_layout(load_drafter(spec, ctx, self.DRAFTER))  # fused, frozen
        self.k = spec.num_speculative_tokens
        block = self.drafter.config.block_size
        if self.k > block - 1:
            raise config_error("num_speculative_tokens", self.k, f"at most {block - 1}: the "
                               f"DFlash drafter {spec.model} was trained on blocks of "
                               f"{block} (1 verified token + {block - 1} masks)",
                               "speculative_config")
        self.max_len = spec.max_model_len or ctx.max_model_len  # SpeculativeConfig.for_target
        self.cache = KVCache.for_model(self.drafter.layer_config, ctx.max_num_seqs,
                                       self.max_len + self.k + 1, dtype=ctx.dtype,
                                       device=ctx.device)
        self.fed = [0] * ctx.max_num_seqs  # verified positions held in each slot's cache row
        # the block forward in fixed shapes, replayed as CUDA graphs on CUDA (infer/graphs.py)
        self.static = StaticForward(self.block_step, self.cache) if ctx.static_steps else None
        self.sample = spec.draft_sample_method == "probabilistic"
        self.mask_id = self.drafter.config.mask_token_id

    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(aux_layer_ids=self.drafter.aux_layer_ids)

    # ---- context -----------------------------------------------------------------------------

    @torch.no_grad()
    def _append_context(self, slots: list[int], counts: list[int], out: ModelOutput) -> None:
        """Rows ``0 .. counts[i] - 1`` of ``out`` become context k/v of ``slots[i]``."""
        feats = aux_features(out, self.drafter.aux_layer_ids, "dflash")  # [B, T, n_t * H_t]
        ctx = self.drafter.context(feats)  # [B, T, H]
        index = torch.tensor(slots, device=self.ctx.device)
        num = torch.tensor(counts, device=self.ctx.device)  # [B]
        step = self.cache.plan(ctx.shape[0], ctx.shape[1], index, num_tokens=num,
                               kv_len=self.cache.capacity)  # positions = current lengths
        for layer, (k, v) in enumerate(self.drafter.context_kv(ctx, step.positions)):
            self.cache.write(layer, step.flat_index, k, v)
        self.cache.advance(step)
        for slot, n in zip(slots, counts):
            self.fed[slot] += n

    def prefilled(self, slots: list[int], num_tokens: list[int],
                  target_output: ModelOutput) -> None:
        index = torch.tensor(slots, device=self.ctx.device)
        self.cache.reset(index)
        for slot in slots:
            self.fed[slot] = 0
        self._append_context(slots, num_tokens, target_output)

    def observe(self, step: VerifiedStep) -> None:
        self._append_context(step.slots, [len(t) for t in step.new_tokens], step.target_output)

    def finish(self, slot: int) -> None:
        self.fed[slot] = 0

    # ---- drafting ----------------------------------------------------------------------------

    @torch.no_grad()
    def block_hidden(self, batch: DraftBatch) -> Tensor:
        """The K mask rows' hidden states after the final norm ``[B, K, H]`` (what the LM head
        reads; DSpark's heads read them too)."""
        device, k = self.ctx.device, min(batch.k, self.k)  # this step's k (k by batch size)
        for slot, toks in zip(batch.slots, batch.token_ids):
            if self.fed[slot] != len(toks) - 1:
                raise RuntimeError(f"slot {slot}: {self.fed[slot]} context positions held for "
                                   f"{len(toks) - 1} verified tokens; {_WIRING} and observe()")
        index = torch.tensor(batch.slots, device=device)  # [B]
        ids = torch.full((len(batch.slots), 1 + k), self.mask_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([toks[-1] for toks in batch.token_ids])
        ids = ids.to(device)  # [B, 1 + K]
        if self.static is not None:  # keys < p + 1 + K = len(tokens) + K
            longest = max(len(toks) for toks in batch.token_ids) + k
            return self.static(ids, slots=batch.slots, index=index, max_len=longest)
        return self.block_step(ids, self.cache, cache_rows(batch.slots, index))

    def block_step(self, ids: Tensor, cache: KVCache, slots: Tensor | None, *,
                   num_tokens: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        """``ids [B, 1 + K]`` at positions ``p .. p + K`` of cache rows ``slots``, the cache not
        advanced: the K mask rows' normed hidden states ``[B, K, H]``. The StaticForward
        contract (a row with ``num_tokens`` 0 writes only the scratch column; its output is
        dropped)."""
        step = cache.plan(ids.shape[0], ids.shape[1], slots, num_tokens, kv_len)
        end = step.positions[:, -1:] + 1  # [B, 1]: keys < p + 1 + K
        keys = torch.arange(step.kv_len, device=ids.device)  # [S]
        mask = (keys[None, None, :] < end[:, :, None])[:, None]  # [B, 1, 1, S]
        mask = mask.expand(-1, -1, ids.shape[1], -1)  # [B, 1, 1 + K, S]: same keys, every row
        h = self.drafter.block_forward(ids, step.positions, mask, step)  # [B, 1 + K, H]
        return h[:, 1:]  # [B, K, H]

    @torch.no_grad()
    def propose(self, batch: DraftBatch) -> Proposal:
        logits = self.drafter.logits(self.block_hidden(batch))  # [B, K, Vd]
        confidence = self.confidence(logits)  # [B, K] or None
        if not self.sample:
            return Proposal(self.drafter.to_target_ids(logits.argmax(dim=-1)),
                            confidence=confidence)  # [B, K]
        temperature = batch.temperature if batch.temperature is not None else 0.0
        q = logits_to_probs(logits, temperature, batch.top_k, batch.top_p)  # [B, K, Vd]
        tok = sample_from_probs(q, batch.generator)  # [B, K]
        return Proposal(self.drafter.to_target_ids(tok), self.drafter.to_target_probs(q),
                        confidence=confidence)


def load_drafter(spec: SpeculativeConfig, ctx: ProposerContext,
                 kind: type[DFlashDrafter] = DFlashDrafter) -> DFlashDrafter:
    """The checkpoint at ``spec.model`` as a ``kind`` drafter, checked against the target,
    sharing its embedding and LM head where the checkpoint has none."""
    drafter = kind.from_pretrained(spec.model, dtype=ctx.dtype, device=ctx.device)
    cfg, target = drafter.config, ctx.target_config
    where = f"{cfg.MODEL_TYPE} drafter {spec.model}"
    check_head_fits(where, "aux_hidden_state_layer_ids", cfg.aux_layer_ids, cfg.vocab_size,
                    cfg.target_hidden, ctx)
    shared = drafter.embed_tokens is None or drafter.lm_head is None
    if shared and drafter.layer_config.hidden_size != target.hidden_size:
        raise FileFormatError(f"{where}: has no embed_tokens.weight / lm_head.weight of its own "
                              f"and its hidden_size {drafter.layer_config.hidden_size} differs "
                              f"from the target's {target.hidden_size}")
    drafter.share_target(ctx.target.embed_tokens, ctx.target.lm_head)
    return drafter

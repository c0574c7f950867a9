"""One engine step's settings as one typed object: ``StepPlan``.

Built once per step from the running requests and the speculative config (:func:`plan_step`),
then handed to the proposer (as its :class:`~infer.proposers.base.DraftBatch`) and to the
rejection sampler (:meth:`StepPlan.verify`), so k, the per-row sampling tensors, the generators
and the verification rule are decided in one place and reach both sides unchanged (vLLM's
``SpecDecodeMetadata`` / ``SamplingMetadata``, as one object).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.proposers.base import DraftBatch, Proposal
from infer.rejection import argmax_verify, greedy_verify, rejection_sample
from infer.request import Request
from infer.sampling import BatchGenerator, Generator
from infer.spec_config import SpeculativeConfig


@dataclass(frozen=True)
class StepPlan:
    """What one step drafts and how it verifies."""

    k: int  # drafts per request this step (k by batch size; 0: a plain decoding step)
    draw_k: int  # the configured k: the sampler draws as for it, so a seeded row's stream
    # does not depend on how many drafts this step asked for
    temperature: torch.Tensor | float  # a scalar when every row shares it, else [B]
    top_k: torch.Tensor | None  # [B]; None: no row filters
    top_p: torch.Tensor | None  # [B]
    generator: Generator  # the engine's, or per-row streams for seeded requests
    rejection: str  # strict / probabilistic / block / synthetic (SpeculativeConfig)
    synthetic_rate: float | None = None

    @property
    def argmax(self) -> bool:
        """Every row greedy and a rule the argmax decides (greedy_verify, draft trees)."""
        return argmax_verify(self.temperature, self.rejection)

    def draft_batch(self, reqs: list[Request]) -> DraftBatch:
        return DraftBatch([r.slot for r in reqs], [r.tokens for r in reqs], self.k,
                          temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                          generator=self.generator)

    def verify(self, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """``[B, k + 1]`` emitted tokens, -1 padded, from the target's ``logits [B, w + 1, V]``
        (all-greedy batches take the argmax path, which returns the same)."""
        if self.argmax:
            return greedy_verify(logits, proposal.draft_ids)
        return rejection_sample(logits, proposal.draft_ids, proposal.draft_probs,
                                temperature=self.temperature, method=self.rejection,
                                top_k=self.top_k, top_p=self.top_p, generator=self.generator,
                                synthetic_acceptance_rate=self.synthetic_rate,
                                draw_k=self.draw_k)


def plan_step(reqs: list[Request], spec: SpeculativeConfig | None, generator: torch.Generator,
              device: torch.device, *, drafting: bool = True) -> StepPlan:
    """The plan of a step over ``reqs`` (``drafting`` False: a prefill's first tokens, sampled
    from the target's distribution itself)."""
    temps = [float(r.params.temperature) for r in reqs]
    temperature = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, device=device)
    top_k = top_p = None
    if any(r.params.top_k > 0 for r in reqs):
        top_k = torch.tensor([r.params.top_k for r in reqs], device=device)
    if any(r.params.top_p < 1.0 for r in reqs):
        top_p = torch.tensor([float(r.params.top_p) for r in reqs], device=device)
    if any(r.generator is not None for r in reqs):
        generator = BatchGenerator(generator, [r.generator for r in reqs])
    if spec is None or not drafting:
        return StepPlan(0, spec.num_speculative_tokens if spec else 0, temperature, top_k, top_p,
                        generator, "strict")
    rate = spec.synthetic_acceptance_rate if spec.rejection_sample_method == "synthetic" else None
    return StepPlan(spec.k_for_batch(len(reqs)), spec.num_speculative_tokens, temperature,
                    top_k, top_p, generator, spec.rejection_sample_method, rate)

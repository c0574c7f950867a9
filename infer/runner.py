"""The target's forwards over the KV cache: the engine's model runner.

Three kinds of forward, each in one place: :meth:`ModelRunner.prefill` (prompts into fresh cache
rows), :meth:`ModelRunner.verify` (a step's ``[pending token, drafts...]`` rows, with the prompts
of newly admitted requests riding in the same forward on eager steps) and
:meth:`ModelRunner.verify_tree` (a chain with sibling leaves, ``infer/draft_tree.py``). On CUDA
without ``enforce_eager`` the verify forward runs in fixed shapes captured as CUDA graphs
(``infer/graphs.py``) and prompts are prefilled apart, in padded groups of similar lengths.
"""

from __future__ import annotations

import torch

from infer.adaptive import time_forward
from infer.draft_tree import SiblingTree
from infer.graphs import StaticForward
from infer.kv_cache import KVCache, cache_rows
from infer.models.groups import ForwardGroup
from infer.models.output import FeatureSpec, ModelOutput, pad_outputs
from infer.request import Request, prefill_groups
from infer.target import Target
from infer.timing import EngineTimers, measure


class ModelRunner:
    """Runs ``target`` over ``cache``; ``features``: what the proposer reads from each forward
    (aux streams); ``static``: fixed-shape (CUDA graph) verify steps; ``grouped``: eager steps
    that prefill prompts unpadded (``Llama.forward_groups``) and inside the verify forward
    while requests run (see the engine's module doc)."""

    def __init__(self, target: Target, cache: KVCache, features: FeatureSpec, *, static: bool,
                 grouped: bool) -> None:
        self.target, self.cache, self.features = target, cache, features
        self.device, self.grouped = target.device, grouped
        self.timers: EngineTimers | None = None
        self.static_forward = None  # None: the plain forward (CPU, eager)
        if static:
            self.static_forward = StaticForward(target.model, cache,
                                                aux_layer_ids=features.aux_layer_ids)

    def prefill(self, reqs: list[Request]) -> ModelOutput:
        """The prompts of ``reqs`` into freshly reset cache rows; logits ``[B, 1, vocab]`` at
        each prompt's last token, states right-padded."""
        with measure(self.timers and self.timers.prefill):
            if self.grouped:
                return pad_outputs(self.target.model.forward_groups(
                    self.prompt_groups(reqs), self.cache,
                    aux_layer_ids=self.features.aux_layer_ids))
            return self._padded_prefill(reqs)

    def prefill_batches(self, reqs: list[Request]) -> list[list[Request]]:
        """How admitted requests are prefilled: all in one unpadded forward when grouped, else
        in groups of similar lengths (little padding)."""
        if self.grouped:
            return [reqs]
        # a forward's fixed cost in padded tokens: a weight read against one token's FLOPs
        # (~300 on an H100 in bf16; ~50 on 2 CPU cores in fp32, Python included)
        call_cost = 256 if self.device.type == "cuda" else 64
        return [[reqs[i] for i in group]
                for group in prefill_groups([len(r.prompt_ids) for r in reqs], call_cost)]

    def verify(self, inputs: torch.Tensor, reqs: list[Request], slots: torch.Tensor,
               num_tokens: torch.Tensor, new: list[Request]
               ) -> tuple[ModelOutput, list[ModelOutput]]:
        """The step's one target forward over ``inputs [B, k + 1]`` (``num_tokens [B]`` real)
        and the prompts of ``new`` requests (one output each; grouped steps only)."""
        with measure(self.timers and self.timers.verify, rows=inputs.shape[0]):
            if self.static_forward is not None:
                longest = max(len(r.tokens) for r in reqs) + inputs.shape[1] - 1  # cache + step
                return self.static_forward(inputs, slots=[r.slot for r in reqs], index=slots,
                                           num_tokens=num_tokens, max_len=longest), []
            rows = cache_rows([r.slot for r in reqs], slots)  # in order: views, no gather
            groups = [ForwardGroup(inputs, rows, num_tokens)]
            groups += self.prompt_groups(new) if new else []
            outs = self.target.model.forward_groups(groups, self.cache,
                                                    aux_layer_ids=self.features.aux_layer_ids)
            return outs[0], outs[1:]

    def verify_tree(self, inputs: torch.Tensor, reqs: list[Request], slots: torch.Tensor,
                    tree: SiblingTree, num_tokens: torch.Tensor) -> ModelOutput:
        """One forward over each row's draft tree (``inputs [B, T]``, ``num_tokens [B]``)."""
        with measure(self.timers and self.timers.verify, rows=inputs.shape[0]):
            return self.target.model(inputs, self.cache,
                                     cache_rows([r.slot for r in reqs], slots),
                                     num_tokens=num_tokens,
                                     aux_layer_ids=self.features.aux_layer_ids, tree=tree)

    def profile_verify(self, reqs: list[Request], slots: torch.Tensor,
                       max_width: int) -> list[float]:
        """Seconds of a verify forward over the running rows at each width 1 .. ``max_width``
        (dummy tokens, the cache rolled back after each): adaptive verification's costs."""
        lens = self.cache.lens[slots].clone()
        rows = cache_rows([r.slot for r in reqs], slots)
        costs = []
        for width in range(1, max_width + 1):
            ids = torch.zeros(len(reqs), width, dtype=torch.long, device=self.device)

            def run() -> None:
                self.target.model(ids, self.cache, rows,
                                  aux_layer_ids=self.features.aux_layer_ids)
                self.cache.truncate(slots, lens)
            costs.append(time_forward(run, self.device))
        return costs

    def prompt_groups(self, reqs: list[Request]) -> list[ForwardGroup]:
        """Each request's prompt as a group of its own (fresh cache row, the last logits)."""
        self.cache.reset(torch.tensor([r.slot for r in reqs], device=self.device))
        return [ForwardGroup.last_of(torch.tensor([r.prompt_ids], device=self.device), r.slot)
                for r in reqs]

    def _padded_prefill(self, reqs: list[Request]) -> ModelOutput:
        """The prompts as one right-padded ragged forward into freshly reset cache rows."""
        lens = [len(r.prompt_ids) for r in reqs]
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        self.cache.reset(slots)
        ids = torch.zeros(len(reqs), max(lens), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
        n = torch.tensor(lens, device=self.device)
        return self.target.model(ids.to(self.device), self.cache, cache_rows(
            [r.slot for r in reqs], slots), num_tokens=n, logits_at=(n - 1)[:, None],
            aux_layer_ids=self.features.aux_layer_ids)

"""How a speculative step verifies its drafts: a strategy per draft shape.

The engine drafts, then hands the drafts to one of two strategies, which run the target's verify
forward (``infer/runner.py``), decide what each row emits and put the KV cache in order:

- :func:`chain_step`: ``[pending token, drafts...]`` per row, the shared rejection sampler
  (the step plan's verification rule: strict, probabilistic or block), rejected positions rolled
  back by resetting the cache lengths. With no drafts it is plain autoregressive decoding.
- :func:`tree_step`: greedy rows whose proposer also returned each draft's next-best tokens
  (``draft_tree_siblings``, ``infer/draft_tree.py``): one forward over the tree, the greedy
  walk, the accepted path moved into place.

Both return a :class:`Verified`; what follows (appending tokens, metrics, telling the proposer)
is the same for both and stays in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.draft_tree import along_path, settle_path, tree_inputs
from infer.models.output import ModelOutput
from infer.proposers.base import Proposal
from infer.request import Request, mask_early_stops
from infer.runner import ModelRunner
from infer.step import StepPlan


@dataclass
class StepRows:
    """The running batch of a step: its requests (sorted by slot), their cache slots ``[B]``
    and pending tokens ``[B]`` on the device, and the target's EOS ids (for min_tokens)."""

    reqs: list[Request]
    slots: torch.Tensor
    pending: torch.Tensor
    eos_ids: frozenset[int]


@dataclass
class Verified:
    """Per row: the tokens it emits (accepted drafts + one recovered or bonus token), how many
    it drafted and accepted; the target's output along what was kept (for the proposer) and
    the outputs of the prompts that rode in the forward."""

    emitted: list[list[int]]
    drafted: list[int]
    accepted: list[int]
    out: ModelOutput
    prompts: list[ModelOutput]


def chain_step(runner: ModelRunner, rows: StepRows, proposal: Proposal, plan: StepPlan,
               new: list[Request]) -> Verified:
    """Verify each row's draft chain and roll the cache back past the rejected drafts."""
    num_drafted = (proposal.draft_ids >= 0).sum(dim=1)  # [B]
    inputs = torch.cat([rows.pending[:, None], proposal.draft_ids.clamp_min(0)],
                       dim=1)  # [B, k + 1]
    out, prompts = runner.verify(inputs, rows.reqs, rows.slots, 1 + num_drafted, new)
    tokens = plan.verify(mask_early_stops(out.logits, rows.reqs, rows.eos_ids), proposal)
    emitted, drafted = tokens.tolist(), num_drafted.tolist()  # the step's one host sync
    accepted = [sum(t >= 0 for t in row) - 1 for row in emitted]
    new_lens = [len(r.tokens) + a for r, a in zip(rows.reqs, accepted)]  # pending + accepted
    runner.cache.truncate(rows.slots, torch.tensor(new_lens, device=rows.slots.device))
    return Verified([row[: a + 1] for row, a in zip(emitted, accepted)], drafted, accepted,
                    out, prompts)


def tree_step(runner: ModelRunner, rows: StepRows, proposal: Proposal, plan: StepPlan,
              new: list[Request]) -> Verified:
    """Verify each row's chain with sibling leaves greedily (never with prompts riding:
    tree steps are not grouped) and move the accepted path into place in the cache."""
    tree, inputs, num_drafted = tree_inputs(rows.pending, proposal.draft_ids,
                                            proposal.sibling_ids)
    out = runner.verify_tree(inputs, rows.reqs, rows.slots, tree,
                             1 + num_drafted * (1 + tree.siblings))
    logits = mask_early_stops(out.logits, rows.reqs, rows.eos_ids, tree.depths())
    emitted, path, accepted = tree.walk(inputs, logits.argmax(-1), num_drafted)  # [B, k+1] x2
    settle_path(runner.cache, rows.slots, [len(r.tokens) - 1 for r in rows.reqs], path,
                accepted)
    kept = accepted.tolist()
    return Verified([row[: a + 1] for row, a in zip(emitted.tolist(), kept)],
                    num_drafted.tolist(), kept, along_path(out, path), [])


def strategy_for(proposal: Proposal, plan: StepPlan):
    """The tree step for greedy rows with siblings, else the chain step."""
    return tree_step if proposal.sibling_ids is not None and plan.argmax else chain_step

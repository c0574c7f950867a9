"""Several cached forwards as one: vLLM's flattened batch on a padded-row engine.

A decode step's rows ``[B, k + 1]`` and a new prompt ``[1, n]`` have different shapes; run apart,
each pays a whole forward's fixed cost (per-op dispatch, reading every weight), and run as one
padded batch, the short rows pay for the long one's padding. :class:`GroupedStep` runs them as one
flat ``[1, N]`` batch through every projection, norm and MLP and splits them only for attention.
The models' ``forward_groups`` (:meth:`infer.models.llama.Llama.forward_groups`,
:meth:`infer.drafters.common.PairDrafter.forward_groups`) build on these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infer.kv_cache import CacheStep, KVCache
from infer.models.attention import attend, cache_mask
from infer.models.output import ModelOutput


@dataclass
class ForwardGroup:
    """One sub-batch of a grouped forward (:meth:`Llama.forward_groups`): what one cached
    forward's arguments would be, for rows of its own shape (a decode step's ``[B, k + 1]``, a new
    prompt's ``[1, n]``)."""

    input_ids: Tensor  # [B, T]
    slots: Tensor | None = None  # [B] cache rows; None = rows 0 .. B-1
    num_tokens: Tensor | None = None  # [B] real tokens per row (default T)
    logits_at: Tensor | None = None  # [B, K] outputs only there (default every position)
    hidden: Tensor | None = None  # [B, T, H] a pair drafter's feature inputs (EAGLE heads)

    @classmethod
    def last_of(cls, ids: Tensor, slot: int, hidden: Tensor | None = None) -> "ForwardGroup":
        """One cache row's tokens ``ids [1, n]`` (a prompt, a head's backlog), logits at the
        last only: how new sequences join a grouped forward."""
        return cls(ids, torch.tensor([slot], device=ids.device),
                   logits_at=torch.tensor([[ids.shape[1] - 1]], device=ids.device), hidden=hidden)


class GroupedStep:
    """The cache steps of several groups run as one forward: every projection, norm and MLP sees
    the groups' tokens as one flat ``[1, N]`` batch, and only attention splits them, each group
    writing and attending its own cache rows under its own masks. This is how vLLM puts new
    prompts inside a decode step: one forward's fixed cost (per-op dispatch, the weight reads)
    instead of one per shape, and no padding of a prompt to the others' length or back.

    The groups are planned in order and each one's lengths advanced before the next is planned,
    and each layer attends them in that order, so a later group of the same cache rows sees the
    keys an earlier one wrote in that layer (a head's prompt backlog, then its catch-up)."""

    def __init__(self, steps: list[CacheStep], masks: list[list[Tensor | None]]):
        self.steps = steps
        self.masks = masks  # [group][layer]: the group's cache mask for that layer
        self.sizes = [step.positions.numel() for step in steps]  # B * T per group

    @property
    def cache(self) -> KVCache:
        """The cache every group writes (one per forward; :func:`plan_groups` takes one)."""
        return self.steps[0].cache

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``q [1, heads, N, hd]``, ``k, v [1, kv_heads, N, hd]`` (the groups' tokens in order)
        -> ``[1, heads, N, hd]``."""
        outs = []
        parts = (x.split(self.sizes, dim=2) for x in (q, k, v))
        for step, masks, qg, kg, vg in zip(self.steps, self.masks, *parts):
            b, t = step.positions.shape
            qg, kg, vg = (x[0].unflatten(1, (b, t)).transpose(0, 1) for x in (qg, kg, vg))
            kg, vg = step.update(layer, kg, vg)  # [B, kv_heads, S, hd]
            out = attend(qg, kg, vg, masks[layer])  # [B, heads, T, hd]
            outs.append(out.transpose(0, 1).flatten(1, 2))  # [heads, B * T, hd]
        return torch.cat(outs, dim=1)[None]


def plan_groups(cache: KVCache, groups: list[ForwardGroup], layer_masks) -> GroupedStep:
    """:class:`GroupedStep` of ``groups`` in ``cache``, the cache lengths advanced past all of
    them (a grouped forward's writes all land; there is no partial rollback).
    ``layer_masks(make)``: a model's per-layer masks from ``make(window)``."""
    steps, masks = [], []
    for g in groups:
        step = cache.plan(*g.input_ids.shape, g.slots, g.num_tokens)
        cache.advance(step)  # the next group of these rows starts after this one's tokens
        steps.append(step)
        masks.append(layer_masks(lambda window, s=step: cache_mask(s, window)))
    return GroupedStep(steps, masks)


def flat_tokens(groups: list[ForwardGroup], step: GroupedStep) -> tuple[Tensor, Tensor]:
    """The groups' token ids and positions on one flat axis: ``([1, N], [1, N])``."""
    ids = torch.cat([g.input_ids.flatten() for g in groups])[None]  # [1, N]
    positions = torch.cat([s.positions.flatten() for s in step.steps])[None]  # [1, N]
    return ids, positions


def flat_logits_at(groups: list[ForwardGroup]) -> Tensor:
    """Every group's ``logits_at`` as indices into the flat token axis ``[1, K_total]``."""
    index, offset = [], 0
    for g in groups:
        b, t = g.input_ids.shape
        at = g.logits_at
        if at is None:
            at = torch.arange(t, device=g.input_ids.device).expand(b, t)
        rows = torch.arange(b, device=at.device)[:, None] * t  # [B, 1]
        index.append((offset + rows + at).flatten())
        offset += b * t
    return torch.cat(index)[None]


def split_picked(x: Tensor, groups: list[ForwardGroup]) -> list[Tensor]:
    """Rows taken at :func:`flat_logits_at` ``[K_total, ...]`` -> one ``[B, K, ...]`` per group."""
    sizes = [g.input_ids.shape[0] * (g.input_ids.shape[1] if g.logits_at is None
                                     else g.logits_at.shape[1]) for g in groups]
    return [part.unflatten(0, (g.input_ids.shape[0], -1))
            for g, part in zip(groups, x.split(sizes))]


def split_groups(out: ModelOutput, groups: list[ForwardGroup]) -> list[ModelOutput]:
    """A grouped forward's flat output -> one :class:`ModelOutput` per group, in its shapes."""
    sizes = [g.input_ids.numel() for g in groups]

    def per_group(x: Tensor) -> list[Tensor]:  # [1, N, H] -> [B, T, H] each
        return [part.unflatten(0, (g.input_ids.shape[0], -1))
                for g, part in zip(groups, x[0].split(sizes))]

    aux = list(zip(*(per_group(x) for x in out.aux))) or [()] * len(groups)
    return [ModelOutput(logits, hidden, tuple(a)) for logits, hidden, a in
            zip(split_picked(out.logits[0], groups), per_group(out.hidden), aux)]

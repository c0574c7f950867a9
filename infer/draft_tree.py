"""A chain of drafts with sibling leaves, verified as a tree in one target forward (greedy).

Why: on a small target a verify forward's cost barely grows with its token count (6 tokens cost
1.07 one-token forwards on the tiny target, 16 cost 1.26), while every head forward costs a fixed
0.13-0.25 of one. Hanging the head's next-best tokens at each chain position as leaves adds
verify tokens but no head forward: when draft ``i`` is rejected and the target's token is one of
its siblings, the step keeps that sibling and the target's token after it (docs/benchmarks-history.md,
"Sibling leaves": +11 % acceptance at k=3 with one sibling per depth).

Layout of one row's ``T = 1 + k * (1 + S)`` verify tokens (per depth, so that a row with fewer
than ``k`` drafts has its valid tokens as a prefix and ``num_tokens`` pads the rest)::

    index 0                      the pending token (depth 0)
    index 1 + (i - 1) * (1 + S)  the chain draft at depth i (1 .. k)
    the S indices after it       its siblings: other candidates for the same position

A node attends the cache, its ancestors and itself: the chain draft at depth ``i`` sees the
pending token and the chain drafts ``1 .. i``; a sibling at depth ``i`` sees the pending token,
the chain drafts ``1 .. i - 1`` and itself. Positions are ``start + depth``.

This module is the tree's arithmetic (layout, mask, the greedy walk, moving the accepted
nodes into place); the engine's greedy step runs it when a chain proposer returns siblings
(``draft_tree_siblings`` in the speculative config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from infer.kv_cache import KVCache
from infer.models.output import ModelOutput


@dataclass(frozen=True)
class SiblingTree:
    """``k`` chain drafts, each with ``siblings`` leaves beside it (see the module doc)."""

    k: int
    siblings: int

    def __post_init__(self) -> None:
        if self.k < 1 or self.siblings < 0:
            raise ValueError(f"SiblingTree: expected k >= 1 and siblings >= 0, got k={self.k}, "
                             f"siblings={self.siblings}")

    @property
    def size(self) -> int:
        """Verify tokens per row, the pending one included."""
        return 1 + self.k * (1 + self.siblings)

    def chain_index(self, depth: Tensor) -> Tensor:
        """Index of the chain draft at ``depth`` (0 = the pending token), any shape."""
        return torch.where(depth > 0, 1 + (depth - 1) * (1 + self.siblings), 0)

    def depths(self, device=None) -> Tensor:
        """``[T]`` depth of every index: 0 for the pending token, ``i`` for depth ``i``'s group."""
        group = torch.arange(self.k, device=device).repeat_interleave(1 + self.siblings) + 1
        return torch.cat([torch.zeros(1, dtype=torch.long, device=device), group])

    def ancestors(self, device=None) -> Tensor:
        """``[T, T]`` bool: row ``q`` may attend new token ``j`` (its ancestors and itself)."""
        depth = self.depths(device)  # [T]
        idx = torch.arange(self.size, device=device)  # [T]
        is_chain = idx == self.chain_index(depth)  # [T] the pending token counts as chain
        # key j is an ancestor of q when j is a chain node strictly shallower than q, or j == q;
        # a chain node q also sees itself, which the j == q term covers
        shallower = depth[None, :] < depth[:, None]  # [T, T]
        return (is_chain[None, :] & shallower) | (idx[None, :] == idx[:, None])

    def layout(self, pending: Tensor, chain: Tensor, siblings: Tensor) -> Tensor:
        """``pending [B]``, ``chain [B, k]``, ``siblings [B, k, S]`` -> tokens ``[B, T]``."""
        groups = torch.cat([chain[:, :, None], siblings], dim=2)  # [B, k, 1 + S]
        return torch.cat([pending[:, None], groups.flatten(1)], dim=1)

    def walk(self, tokens: Tensor, best: Tensor, num_drafts: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
        """The greedy walk: ``tokens [B, T]`` (:meth:`layout`), ``best [B, T]`` the target's
        argmax at every node, ``num_drafts [B]`` valid chain drafts per row (its siblings are
        valid with it). Returns ``(emitted [B, k + 1], path [B, k + 1], accepted [B])``, -1
        padded: the tokens the step emits (the accepted drafts, then the target's token after
        the last of them) and the node index of each accepted position (0 = pending first), as
        :func:`~infer.rejection.greedy_verify` would for the chain alone plus one sibling."""
        b, device = tokens.shape[0], tokens.device
        depth = torch.arange(1, self.k + 1, device=device)  # [k]
        chain_idx = self.chain_index(depth)  # [k]
        parent_idx = self.chain_index(depth - 1)  # [k]
        ok = (tokens[:, chain_idx] == best[:, parent_idx]) & (depth[None] <= num_drafts[:, None])
        run = ok.long().cumprod(dim=1).sum(dim=1)  # [B] chain drafts accepted
        rows = torch.arange(b, device=device)
        last_chain = self.chain_index(run)  # [B] node the chain stops at
        want = best[rows, last_chain]  # [B] the target's token after it
        sib = self._sibling_hit(tokens, want, run, num_drafts)  # [B] node index or -1
        hit = sib >= 0
        accepted = run + hit.long()  # [B]
        path = torch.full((b, self.k + 1), -1, dtype=torch.long, device=device)
        emitted = torch.full_like(path, -1)
        slots = torch.arange(self.k + 1, device=device)[None]  # [1, k + 1]
        chain_nodes = self.chain_index(slots.expand(b, -1))  # [B, k + 1]
        in_chain = slots <= run[:, None]  # [B, k + 1]
        path = torch.where(in_chain, chain_nodes, path)
        path[rows[hit], run[hit] + 1] = sib[hit]
        # emitted token p is the target's argmax at path node p (its prediction after it)
        filled = path >= 0
        safe = path.clamp_min(0)
        emitted = torch.where(filled, best.gather(1, safe), emitted)
        return emitted, path, accepted

    def _sibling_hit(self, tokens: Tensor, want: Tensor, run: Tensor, num_drafts: Tensor
                     ) -> Tensor:
        """``[B]`` index of the sibling at depth ``run + 1`` equal to ``want``, else -1."""
        if self.siblings == 0:
            return torch.full_like(run, -1)
        open_ = run < num_drafts  # [B] a rejected depth exists (not every draft accepted)
        first = self.chain_index((run + 1).clamp_max(self.k)) + 1  # [B] its first sibling
        offs = torch.arange(self.siblings, device=tokens.device)  # [S]
        idx = first[:, None] + offs  # [B, S]
        match = (tokens.gather(1, idx.clamp_max(self.size - 1)) == want[:, None]) & open_[:, None]
        found = match.any(dim=1)
        j = match.long().argmax(dim=1)  # first match
        return torch.where(found, first + j, torch.full_like(run, -1))


def tree_inputs(pending: Tensor, draft_ids: Tensor, sibling_ids: Tensor
                ) -> tuple[SiblingTree, Tensor, Tensor]:
    """A step's tree, verify tokens ``[B, T]`` and valid chain drafts ``[B]`` from the pending
    tokens ``[B]``, the drafts ``[B, w]`` (-1 padded) and their siblings ``[B, >= w, S]``."""
    tree = SiblingTree(draft_ids.shape[1], sibling_ids.shape[2])
    tokens = tree.layout(pending, draft_ids.clamp_min(0), sibling_ids[:, : tree.k])
    return tree, tokens, (draft_ids >= 0).sum(dim=1)


def settle_path(cache: KVCache, slots: Tensor, starts: list[int], path: Tensor,
                accepted: Tensor) -> None:
    """Move each row's accepted nodes (``path [B, k + 1]``, -1 padded, from
    :meth:`SiblingTree.walk`) from their verify columns ``start + node`` to the columns of their
    depths ``start + depth`` (``starts``: the pending tokens' columns), then cut every row after
    its accepted tokens: the cache then holds them in order, as after a chain's step."""
    start = torch.tensor(starts, device=path.device)[:, None]  # [B, 1]
    depth = torch.arange(path.shape[1], device=path.device).expand_as(path)  # [B, k + 1]
    moved = (path >= 0) & (path != depth)  # [B, k + 1] accepted, not in place
    if bool(moved.any()):
        row = torch.arange(path.shape[0], device=path.device)[:, None].expand_as(path)[moved]
        cache.move(slots[row], (start + path)[moved], (start + depth)[moved])
    cache.truncate(slots, start[:, 0] + 1 + accepted)


def along_path(out: ModelOutput, path: Tensor) -> ModelOutput:
    """``out`` at each row's accepted nodes ``path [B, L]`` (-1 padding reads node 0), in
    order: what the proposer's ``observe`` reads as the verified positions."""
    index = path.clamp_min(0)[..., None]  # [B, L, 1]

    def pick(x: Tensor) -> Tensor:
        return x.gather(1, index.expand(-1, -1, x.shape[-1]))
    return ModelOutput(pick(out.logits), pick(out.hidden), tuple(pick(a) for a in out.aux))

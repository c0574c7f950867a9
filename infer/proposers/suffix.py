"""Suffix decoding proposer (``method: suffix``), after SuffixDecoding (Arctic Inference).

Two frequency trees are consulted every step:

- a *per-request* tree over the request's prompt + generated tokens (self-repetition), and
- a *global* tree over the outputs of past requests (cross-request repetition: agents, code
  edits, templated answers). Outputs only, as in SuffixDecoding; prompts are not cached.

For every match length m (1 .. depth - 1) such that the history's last m tokens occur in a tree,
a draft is built greedily from there: follow the most frequent child while the path probability
(product of ``child.count / parent.count``) stays >= min_token_prob. The draft's score is the sum
of its tokens' path probabilities (the expected number of accepted tokens); the best-scoring
draft over all match lengths and both trees wins (ties: longer match, then the request's own
tree), as in SuffixDecoding.

Deliberate differences from Arctic Inference's SuffixDecodingCache: a request's output enters
the global tree when it finishes (Arctic streams it in while it runs, so the global tree also
holds the running request); and in the request's own tree the history's current occurrence of a
pattern (which has no next token yet) is left out of the denominator, so one earlier occurrence
gives probability 1 in either tree and the two trees' scores compare fairly.

The ``suffix_decoding_*`` keys:

- ``max_tree_depth`` (D, default 24): the trees hold every substring of length <= D; a match plus
  its draft is at most D tokens (a match of m leaves room for D - m), so matches use the last
  D - 1 tokens of the history.
- ``max_cached_requests`` (default 10000): how many finished requests' outputs the global tree
  holds; the oldest is evicted first (FIFO) and its counts are really subtracted. 0 disables the
  global tree.
- ``max_spec_factor`` (default 1.0): a match of m tokens drafts at most ``int(m * factor)``
  tokens (short, unreliable matches draft little); also at most k.
- ``min_token_prob`` (default 0.1): drafting stops before the first token whose estimated path
  probability falls below it.

The tree is a trie of all substrings of length <= D with occurrence counts, stored compactly: a
node seen once (count 1) is a *leaf* that points at its single occurrence in the stored token
list instead of materialising the chain below it, so memory grows with the number of repeated
substrings, not with length x D. Appending a token updates the (at most D - 1) materialised
suffix nodes of the sequence: O(D) per token. Memory is still Python objects: about 0.5 KB
per cached output token on code (measured, D = 24), so the default 10000 cached requests of
1000 tokens would take ~5 GB of host memory; lower ``max_cached_requests`` for long outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  VerifiedStep, pad_drafts)
from infer.spec_config import SpeculativeConfig

# A position in a trie: (node, match length, tokens consumed inside the node's leaf chain).
Cursor = tuple["_Node", int, int]


class _Node:
    """A substring seen ``count`` times. Internal nodes have ``children`` (token -> node) and
    cache ``best``, the token of their most frequent child (None: recompute). A leaf
    (``children is None``) was seen once: ``seqs[seq][pos:]`` is what followed it."""

    __slots__ = ("count", "children", "best", "seq", "pos")

    def __init__(self, seq: int | None = None, pos: int = 0) -> None:
        self.count = 1
        self.children: dict[int, _Node] | None = None
        self.best: int | None = None
        self.seq = seq
        self.pos = pos


class SuffixTrie:
    """Counts of every substring of length <= ``depth`` over several token sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.root.children = {}
        self.seqs: dict[int, list[int]] = {}
        self._open: dict[int, list[Cursor]] = {}  # per sequence: its materialised suffix nodes

    # ---- updates ---------------------------------------------------------------------------

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append tokens to a sequence (new or not); O(depth) per token."""
        text = self.seqs.setdefault(seq_id, [])
        open_ = self._open.get(seq_id, [])
        for tok in tokens:
            text.append(tok)
            open_ = self._insert(open_, tok, seq_id, len(text))
        self._open[seq_id] = open_

    def close(self, seq_id: int) -> None:
        """The sequence will not grow again: drop its bookkeeping, keep its counts."""
        self._open.pop(seq_id, None)

    def _insert(self, open_: list[Cursor], tok: int, seq_id: int, end: int) -> list[Cursor]:
        """Count the new occurrence of every suffix ending at ``tok``. Suffixes that reach a
        leaf are the only occurrence of their string: the leaf chain covers their future growth,
        so only suffixes at internal nodes (seen before) stay open."""
        still_open = []
        for node, d, _ in [(self.root, 0, 0), *open_]:
            child = self._count_child(node, tok, seq_id, end, d + 1)
            if child.children is not None and d + 1 < self.depth:
                still_open.append((child, d + 1, 0))
        return still_open

    def _count_child(self, node: _Node, tok: int, seq_id: int, end: int, depth: int) -> _Node:
        child = node.children.get(tok)
        if child is None:
            child = node.children[tok] = _Node(seq_id, end)
        else:
            if child.children is None:
                self._split(child, depth)
            child.count += 1
        best = node.best
        if best is not None and best != tok and child.count > node.children[best].count:
            node.best = tok
        return child

    def _split(self, leaf: _Node, depth: int) -> None:
        """A leaf's string is seen a second time: materialise the next node of its first
        occurrence (a leaf again), so both occurrences are counted explicitly from here on."""
        seq_id, pos = leaf.seq, leaf.pos
        text = self.seqs[seq_id]
        leaf.children, leaf.seq = {}, None
        if depth < self.depth and pos < len(text):
            leaf.children[text[pos]] = _Node(seq_id, pos + 1)
            leaf.best = text[pos]
        elif depth < self.depth and seq_id in self._open:  # a suffix of a sequence still growing
            self._open[seq_id] = sorted([*self._open[seq_id], (leaf, depth, 0)],
                                        key=lambda cursor: cursor[1])

    def remove(self, seq_id: int) -> None:
        """Subtract every occurrence in a sequence; nodes left with no occurrence are deleted."""
        text = self.seqs.pop(seq_id)
        self._open.pop(seq_id, None)
        for start in range(len(text)):
            node = self.root
            for tok in text[start : start + self.depth]:
                child = node.children[tok]
                if node.best == tok:
                    node.best = None  # it may no longer be the most frequent
                if child.count == 1:  # only this occurrence below here
                    del node.children[tok]
                    break
                child.count -= 1
                node = child

    # ---- lookups ---------------------------------------------------------------------------

    def open_cursors(self, seq_id: int) -> list[Cursor]:
        """Cursors at the sequence's own repeated suffixes, by increasing match length."""
        return self._open.get(seq_id, [])

    def advance(self, cursors: list[Cursor], tok: int) -> list[Cursor]:
        """The history grew by ``tok``: follow it from each cursor and from the root (a new
        match of length 1); drop cursors that leave the trie or leave no room to draft."""
        out = []
        for node, d, extra in [(self.root, 0, 0), *cursors]:
            if node.children is not None:
                child = node.children.get(tok)
                nxt = None if child is None else (child, d + 1, 0)
            else:
                nxt = (node, d + 1, extra + 1) if self._chain_token(node, extra) == tok else None
            if nxt is not None and d + 1 < self.depth:
                out.append(nxt)
        return out

    def _chain_token(self, leaf: _Node, extra: int) -> int | None:
        text = self.seqs[leaf.seq]
        return text[leaf.pos + extra] if leaf.pos + extra < len(text) else None

    def _best_child(self, node: _Node) -> tuple[int, _Node] | None:
        if not node.children:
            return None
        if node.best is None:
            node.best = max(node.children, key=lambda t: node.children[t].count)
        return node.best, node.children[node.best]

    def speculate(self, cursor: Cursor, budget: int, min_prob: float,
                  own: frozenset[int] = frozenset()) -> tuple[list[int], float]:
        """Greedy path from a match: (tokens, score = sum of their path probabilities).

        ``own``: ids of the nodes that are suffixes of the history being continued. Their count
        includes that very occurrence, which has no next token yet, so it is left out of the
        denominator: a pattern seen once before continues with probability 1, as it would
        from the global trie, which does not hold the running request.
        """
        node, depth, extra = cursor
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < budget and depth < self.depth:
            if node.children is None:  # one occurrence: its continuation, probability unchanged
                tok = self._chain_token(node, extra)
                extra += 1
            else:
                step = self._best_child(node)
                if step is None:
                    break
                tok, child = step
                prob *= child.count / (node.count - (id(node) in own))
                if prob < min_prob:
                    break
                node, extra = child, 0
            if tok is None:
                break
            tokens.append(tok)
            score += prob
            depth += 1
        return tokens, score

    def best_draft(self, cursors: list[Cursor], k: int, factor: float, min_prob: float,
                   own: frozenset[int] = frozenset()) -> tuple[list[int], float]:
        """The best-scoring draft over all matches (ties go to the longer match)."""
        best, best_score = [], 0.0
        for cursor in cursors:
            match = cursor[1]
            budget = min(k, int(match * factor + 1e-6), self.depth - match)
            tokens, score = self.speculate(cursor, budget, min_prob, own)
            if tokens and score >= best_score:
                best, best_score = tokens, score
        return best, best_score


@dataclass
class _Request:
    """Per-request state: its own trie (sequence 0) and its cursors in the global trie."""

    trie: SuffixTrie
    prompt_len: int
    cursors: list[Cursor] = field(default_factory=list)
    version: int = -1  # the global trie version the cursors belong to


@PROPOSERS.register("suffix")
class SuffixProposer(Proposer):
    """Suffix decoding over a per-request trie and a global trie of past outputs (see the
    module docstring for the algorithm and the ``suffix_decoding_*`` keys)."""

    provides_draft_probs = False

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        self.depth = spec.suffix_decoding_max_tree_depth
        self.max_cached = spec.suffix_decoding_max_cached_requests
        self.factor = spec.suffix_decoding_max_spec_factor
        self.min_prob = spec.suffix_decoding_min_token_prob
        self.global_trie = SuffixTrie(self.depth) if self.max_cached > 0 else None
        self._cached: deque[int] = deque()  # global sequence ids, oldest first
        self._next_id = 0
        self._version = 0  # bumped whenever the global trie changes
        self._requests: dict[int, _Request] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        """Index the prompt in a fresh per-request trie."""
        trie = SuffixTrie(self.depth)
        trie.extend(0, list(prompt_ids))
        self._requests[slot] = _Request(trie, len(prompt_ids))

    def observe(self, step: VerifiedStep) -> None:
        """Index the tokens the step appended (the last step's tokens arrive only here)."""
        for slot, new in zip(step.slots, step.new_tokens):
            req = self._requests.get(slot)
            if req is not None and new:
                self._append(req, list(new))

    def finish(self, slot: int) -> None:
        """Move the request's output into the global trie, then free its state."""
        req = self._requests.pop(slot, None)
        if req is None or self.global_trie is None:
            return
        output = req.trie.seqs[0][req.prompt_len:]
        if output:
            self._cache_output(output)

    def reset(self) -> None:
        """Empty the global trie; running requests keep their own tries."""
        if self.global_trie is not None:
            self.global_trie = SuffixTrie(self.depth)
        self._cached.clear()
        self._version += 1  # running requests' global cursors point into the old trie

    def _cache_output(self, output: list[int]) -> None:
        """Add one output to the global trie; evict the oldest beyond max_cached_requests."""
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.global_trie.extend(seq_id, output)
        self.global_trie.close(seq_id)
        self._cached.append(seq_id)
        while len(self._cached) > self.max_cached:
            self.global_trie.remove(self._cached.popleft())
        self._version += 1

    # ---- drafting --------------------------------------------------------------------------

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = [self._draft(self._synced(slot, tokens), batch.k)
                  for slot, tokens in zip(batch.slots, batch.token_ids)]
        return Proposal(draft_ids=pad_drafts(drafts, batch.k, self.ctx.device), draft_probs=None)

    def _synced(self, slot: int, tokens: list[int]) -> _Request:
        """The slot's state, caught up with the engine's history (e.g. the token sampled at
        prefill, which no ``observe`` reports). A history that does not extend the indexed one
        means a request we were not told about: index it afresh, all of it as prompt."""
        req = self._requests.get(slot)
        text = req.trie.seqs[0] if req is not None else None
        if text is None or len(text) > len(tokens) or (text and text[-1] != tokens[len(text) - 1]):
            self.start(slot, tokens)
            return self._requests[slot]
        if len(tokens) > len(text):
            self._append(req, tokens[len(text):])
        return req

    def _append(self, req: _Request, new: list[int]) -> None:
        req.trie.extend(0, new)
        if self.global_trie is not None and req.version == self._version:
            for tok in new:
                req.cursors = self.global_trie.advance(req.cursors, tok)

    def _global_cursors(self, req: _Request) -> list[Cursor]:
        """Cursors in the global trie; rebuilt from the last depth - 1 tokens after it changed."""
        if req.version != self._version:
            req.cursors = []
            for tok in req.trie.seqs[0][-(self.depth - 1):] if self.depth > 1 else []:
                req.cursors = self.global_trie.advance(req.cursors, tok)
            req.version = self._version
        return req.cursors

    def _draft(self, req: _Request, k: int) -> list[int]:
        """The better of the request's own and the global draft (ties: the request's own)."""
        args = (k, self.factor, self.min_prob)
        cursors = req.trie.open_cursors(0)
        own, own_score = req.trie.best_draft(cursors, *args, frozenset(id(c[0]) for c in cursors))
        if self.global_trie is None or not self.global_trie.seqs:
            return own
        other, other_score = self.global_trie.best_draft(self._global_cursors(req), *args)
        return own if own_score >= other_score else other

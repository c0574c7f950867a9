"""N-gram proposer (prompt lookup decoding, ``method: ngram``).

The drafts are copied from the request's own history: take the longest suffix n-gram of the
history (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) that also occurs earlier,
and propose the (up to) k tokens that followed that earlier occurrence. No model, no
probabilities (``provides_draft_probs = False``): acceptance is decided by the target alone.

Which occurrence, when the n-gram occurs several times. vLLM (v1 ``NgramProposer``) copies after
the *earliest* occurrence. draftsmith copies after the *most recent* earlier occurrence that
still has k tokens after it, and falls back to the earliest occurrence (the one with the longest
continuation) when none has. Why: in code the nearest repetition is usually the relevant one
(the variable just defined, the loop body just written), while the fallback keeps vLLM's good
behaviour in tight repeats (a run of identical tokens, ``0, 0, 0, ...``) where the most recent
occurrence is only a token or two before the end and would leave almost nothing to copy.
(Measured on Python standard-library files as word tokens, k = 5, accepted tokens per step:
n = 2..5: 0.50 vs 0.45 for the earliest vs 0.50 for the plain most recent occurrence;
n = 1..3: 0.63 vs 0.50 vs 0.60.)
The continuation may overlap the suffix itself, as in vLLM.

Cost: one vectorised comparison over the history per step (O(len) in numpy), then work on the
surviving candidate positions only; no per-token Python over the history. Each slot keeps a
growing numpy copy of its history, extended by the new tail each step instead of re-converting
the whole list.
"""

from __future__ import annotations

import numpy as np

from infer.proposers.base import (PROPOSERS, DraftBatch, Proposal, Proposer, ProposerContext,
                                  pad_drafts)
from infer.spec_config import SpeculativeConfig


def longest_match_ends(tokens: np.ndarray, n_max: int) -> tuple[int, np.ndarray]:
    """The longest n <= n_max such that the last n tokens also occur earlier, and the end
    indices (ascending) of those earlier occurrences. ``(0, empty)`` when even the last token
    never occurred before.

    An occurrence ending at ``e`` means ``tokens[e-n+1 : e+1] == tokens[-n:]`` with
    ``e < len - 1`` (strictly earlier; it may overlap the suffix). Candidates start as every
    earlier position of the last token and are filtered one token further back per n, so the
    work after the first O(len) comparison is proportional to the surviving candidates.
    """
    last = len(tokens) - 1
    ends = np.flatnonzero(tokens[:last] == tokens[last]) if last > 0 else np.empty(0, np.int64)
    if ends.size == 0:
        return 0, ends
    n = 1
    while n < n_max:
        longer = ends[ends >= n]  # room for one more token before the occurrence
        longer = longer[tokens[longer - n] == tokens[last - n]]
        if longer.size == 0:
            break
        ends, n = longer, n + 1
    return n, ends


def choose_end(ends: np.ndarray, length: int, k: int) -> int:
    """The most recent occurrence with k tokens after it; else the earliest (longest copy)."""
    full = ends[ends <= length - 1 - k]
    return int(full[-1]) if full.size else int(ends[0])


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k draft tokens for a history (1-D int array), or [] when no n-gram of length
    ``n_min..n_max`` ending the history occurred earlier in it."""
    if k <= 0 or len(tokens) < n_min + 1:
        return []
    n, ends = longest_match_ends(tokens, n_max)
    if n < n_min:
        return []
    start = choose_end(ends, len(tokens), k) + 1
    return tokens[start : start + k].tolist()


class _History:
    """A slot's history as a growing numpy array, synced from the engine's token list.

    Histories only grow within a request, so each step appends the new tail. A history that
    shrank or whose last known token changed belongs to a new request: rebuild it.
    """

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        n = self.n
        if n > len(tokens) or (n and self.buf[n - 1] != tokens[n - 1]):
            n = self.n = 0
        if len(tokens) > self.buf.size:
            grown = np.empty(max(len(tokens), 2 * self.buf.size), dtype=np.int64)
            grown[:n] = self.buf[:n]
            self.buf = grown
        if len(tokens) > n:
            self.buf[n : len(tokens)] = tokens[n:]
            self.n = len(tokens)
        return self.buf[: self.n]


@PROPOSERS.register("ngram")
class NgramProposer(Proposer):
    """Prompt lookup over each request's prompt + generated tokens (see the module docstring).

    Honours ``prompt_lookup_min`` / ``prompt_lookup_max`` (already resolved by
    SpeculativeConfig: 5 / 5 by default, one mirrors the other). The engine clips drafts to
    max_tokens / max_model_len, so this class does not.
    """

    provides_draft_probs = False

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        super().__init__(spec, ctx)
        self.n_min = spec.prompt_lookup_min
        self.n_max = spec.prompt_lookup_max
        self._histories: dict[int, _History] = {}

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        self._histories[slot] = _History()

    def propose(self, batch: DraftBatch) -> Proposal:
        drafts = []
        for slot, tokens in zip(batch.slots, batch.token_ids):
            history = self._histories.setdefault(slot, _History()).sync(tokens)
            drafts.append(ngram_propose(history, self.n_min, self.n_max, batch.k))
        return Proposal(draft_ids=pad_drafts(drafts, batch.k, self.ctx.device), draft_probs=None)

    def finish(self, slot: int) -> None:
        self._histories.pop(slot, None)


@PROPOSERS.register("ngram_gpu")
class NgramGpuProposer(NgramProposer):
    """``ngram_gpu``: vLLM computes the same prompt lookup on the device; the drafts are the
    same, so on every device this engine runs the one CPU implementation above."""
